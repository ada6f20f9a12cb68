"""DMS's KV-write strategy (Dynamic Memory Sparsification; Łańcucki et al. 2025, Sec. 3) with the
eval-mode hard decisions, over a :class:`~dmc.inference.dms_cache.DMSPagedCache`.

Decisions (DMS Sec. 3.1, NVIDIA Model-Optimizer's ``prepare_attention_input``): for the first
query head g of each KV group, ``alpha_t = [q_{t,g}[..., -1] * dms_logit_scale - c > 0]``
(:func:`dmc.ops.split_dms_channels`, computed in the model's dtype as the eval-mode attention
does); that channel of the query is zeroed before RoPE and again after it
(:func:`dmc.ops.zero_dms_channel`: rotate-half moves channel ``d/2 - 1`` into the last one);
keys keep every channel and are rotated at their own position. ``alpha_t`` marks key ``t - 1``
for eviction after the window of ``dms_window`` more queries (the cache's delayed eviction).

Adapter decisions (``dms_decision: adapter``, NVIDIA's ``dms_separate_alpha=True``; see
:mod:`dmc.megatron.dms_attention`): ``alpha_t = [decision_proj(x_t)_g * dms_logit_scale - c > 0]``
from the attention input ``x_t``. The :class:`~dmc.inference.model_runner.ModelRunner` hands
``decision_proj(x_t)`` over as one extra channel appended to every query head
(:func:`append_adapter_logits`; the KV-write interface takes queries, keys and values only);
:meth:`DMSKV._decide` reads it off the first head of each group exactly as it reads the
borrowed channel and drops it, and no channel of the query is zeroed.

Shapes as :mod:`dmc.inference.kv_write`: queries ``[tokens, heads, dim]``, keys and values
``[tokens, kv_heads, dim]`` of one batch row for a prefill chunk, ``[batch, heads, dim]`` for
decode tokens.
"""
from __future__ import annotations

import torch

from dmc.inference.kernels import EvictionChannel, resolve_use_triton
from dmc.inference.kv_write import KVWrite
from dmc.megatron.config import DMCConfig
from dmc.ops import dms_alpha_logit, split_dms_channels, zero_dms_channel
from dmc.ops.rope import apply_rope, rotate


def append_adapter_logits(query: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``query [..., heads, dim]`` with ``logits [..., kv_heads]`` (the adapter's
    ``decision_proj`` output of each token) appended as channel ``dim`` of every head of the
    KV group: ``[..., heads, dim + 1]``."""
    group = query.shape[-2] // logits.shape[-1]
    extra = logits.to(query.dtype).repeat_interleave(group, dim=-1)
    return torch.cat([query, extra[..., None]], dim=-1)


class DMSKV(KVWrite):
    """DMS with the hard decisions of ``config`` (``c``, ``dms_logit_scale``, ``dms_window``);
    arguments of :class:`KVWrite` after ``config`` (its policy is ``NoPolicy``: the engine
    refuses a KV policy on a DMS model). The cache's window ring counts as the method's per-head
    state (``keeps_merge_state``: reported as ``dmc_state``)."""

    keeps_merge_state = True
    defers_writes = True

    def __init__(self, config: DMCConfig, *args):
        super().__init__(*args)
        self.config = config
        self.adapter = config.dms_decision == "adapter"

    def _decide(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``query [batch, heads, n, dim]`` pre-RoPE (adapter mode: ``dim + 1`` channels, the
        last one the adapter's logit) -> (the query with the borrowed channels zeroed, or the
        adapter channel dropped, float32; ``alpha [batch, kv_heads, n]`` bool)."""
        if self.adapter:
            logit = dms_alpha_logit(query, self.cache.num_kv_heads, self.config.c,
                                    self.config.dms_logit_scale)
            return query[..., :-1].float(), logit > 0
        channels = split_dms_channels(query, self.cache.num_kv_heads, self.config.c,
                                      self.config.dms_logit_scale)
        return channels.query.float(), channels.alpha_logit > 0

    def _zero_again(self, rotated: torch.Tensor) -> torch.Tensor:
        """Rotated queries ``[..., heads, n, dim]`` with the borrowed channels zeroed again (none
        in adapter mode)."""
        return rotated if self.adapter else zero_dms_channel(rotated, self.cache.num_kv_heads)

    def static_ready(self, seqs: list[int]) -> bool:
        """A static (captured) decode step needs every sequence's window ring full: then every
        row has a token leaving and the cache's write reads nothing from the host."""
        return self.cache.rings_full(seqs)

    def write_token(self, layer, step, query, key, value):
        if not self.adapter and resolve_use_triton(query.device, self.use_triton):
            channel = EvictionChannel(self.cache.num_kv_heads, self.config.c,
                                      self.config.dms_logit_scale)  # one launch: see the kernel
            return self.cache.decode_write(layer, step.seqs, key, value, None, step.positions,
                                           use_triton=True,
                                           query=(query, step.cos, step.sin, channel))
        query, alpha = self._decide(query[:, :, None])
        self.cache.decode_write(layer, step.seqs, self.rotate_rows(key), value, alpha[..., 0],
                                step.positions, use_triton=self.use_triton)
        return self._zero_again(rotate(query, step.cos[:, :, None], step.sin[:, :, None]))[:, :, 0]

    def prefill(self, layer: int, seq: int, query, key, value, start: int) -> torch.Tensor:
        """Exact chunked prefill of ``n`` tokens at positions ``start ..`` (see
        :meth:`DMSPagedCache.prefill`). Returns ``[n, heads, dim]``."""
        positions = torch.arange(start, start + query.shape[0], device=query.device)
        query, alpha = self._decide(query.transpose(0, 1)[None])
        q_rot = self._zero_again(apply_rope(query, positions, self.inv_freq))[0]
        keys = apply_rope(key.float().transpose(0, 1), positions, self.inv_freq)
        context = self.cache.prefill(layer, seq, start, q_rot, keys, value.transpose(0, 1),
                                     alpha[0], self.scale)
        return context.transpose(0, 1)
