"""A Llama model with Dynamic Memory Sparsification (Łańcucki, Staniszewski, Nawrot, Ponti 2025,
"Inference-Time Hyper-Scaling with KV Cache Compression", arXiv 2506.05345) for Hugging Face
transformers.

``dmc convert mcore-to-hf`` copies this file as ``modeling_dms.py`` into an exported folder with
:mod:`.hf_modeling_common` and the ``dmc/ops`` files it imports (``decisions.py``, ``rope.py``),
and points ``config.json``'s ``auto_map`` at it, so that
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads the model.

Attention is DMS in eval mode (hard decisions), the semantics of
:class:`dmc.megatron.dms_attention.DMSSelfAttention` in ``eval`` mode and of
``dmc.inference.Engine`` with ``method="dms"``:

* decision (DMS Sec. 3.1, the borrowed-neuron recipe of DMC): ``alpha_t = [q_g,t[-1] *
  dms_logit_scale - dms_c > 0]`` from the pre-RoPE query of the first head ``g`` of each KV
  group (:func:`split_dms_channels`), that channel zeroed before and after RoPE; ``alpha_t``
  marks key ``t - 1`` for eviction (the first token's decision marks nothing);
* adapter decisions (``dms_decision: "adapter"``, NVIDIA Model-Optimizer's
  ``dms_separate_alpha``): ``alpha_t = [dms_decision_proj(x_t) * dms_logit_scale - dms_c > 0]``
  per KV head from the attention input ``x_t = input_layernorm(h_t)`` (NVIDIA's separate
  RMSNorm folded into the projection, :mod:`dmc.megatron.dms_attention`); no channel is zeroed;
* delayed eviction (DMS Sec. 3): key ``j`` is visible to query ``i >= j`` iff ``i - j <= w``
  (``dms_window``) or key ``j`` was not marked.

Without a cache (or with an empty one) a forward computes all positions at once under that mask.
:class:`DMSCache` holds what ``generate()`` uses: per (layer, sequence, KV head) the keys
(rotated at their own positions), values, positions and eviction marks of the tokens a query can
still see; a marked token is dropped from its head's cache when it leaves the window, so a head
holds exactly its survivors plus the last ``min(tokens, w + 1)`` tokens. Left padding is
supported (a 2-D ``attention_mask`` of zeros followed by ones per row).
"""
from __future__ import annotations

import torch
from torch import nn

from .hf_modeling_common import (CompressedAttention, CompressedCache, CompressedCacheLayer,
                                  CompressedLlamaConfig, CompressedLlamaForCausalLM,
                                  CompressedLlamaModel)

try:  # the exported folder: the dmc/ops files shipped next to modeling_dms.py
    from .decisions import split_dms_channels, zero_dms_channel
    from .rope import apply_rope
except ImportError:  # imported from the dmc package
    from dmc.ops.decisions import split_dms_channels, zero_dms_channel
    from dmc.ops.rope import apply_rope


class DMSLlamaConfig(CompressedLlamaConfig):
    """Llama hyper-parameters (:class:`CompressedLlamaConfig`) plus the DMS settings.

    dms_window: w, the queries after a key that still see it whatever its decision.
    dms_c, dms_logit_scale: the eviction logit is ``q[..., -1] * dms_logit_scale - dms_c``
    (NVIDIA's ``dms_initial_alpha_offset`` and ``dms_alpha_scale``).
    dms_channel: which channel carries the logit (only "last", of the first query head of each
    KV group). dms_decision: "query" (that channel) or "adapter" (``dms_decision_proj``, a
    linear map of the attention input to one logit per KV head). dms_target_cr, dms_measured_cr:
    the training target and the CR measured at export (or None). With ``qk_norm`` the logit is
    read from ``q_norm(q)``, as NVIDIA's Qwen3 DMS models do.
    """

    model_type = "dms_llama"

    def __init__(self, dms_window=512, dms_c=5.0, dms_logit_scale=100.0, dms_channel="last",
                 dms_target_cr=None, dms_measured_cr=None, dms_decision="query", **kwargs):
        if dms_channel != "last":
            raise ValueError(f"dms_channel must be 'last', got {dms_channel!r}")
        if dms_decision not in ("query", "adapter"):
            raise ValueError(f"dms_decision must be 'query' or 'adapter', got {dms_decision!r}")
        if int(dms_window) < 0:
            raise ValueError(f"dms_window must be >= 0, got {dms_window!r}")
        self.dms_decision = dms_decision
        self.dms_window = int(dms_window)
        self.dms_c = dms_c
        self.dms_logit_scale = dms_logit_scale
        self.dms_channel = dms_channel
        self.dms_target_cr = dms_target_cr
        self.dms_measured_cr = dms_measured_cr
        super().__init__(**kwargs)


# ----------------------------------------------------------------------------- cache
class DMSCacheLayer(CompressedCacheLayer):
    """The evicting cache of one layer: ``keys, values [batch, kv_heads, capacity, dim]``
    (keys rotated), ``positions [batch, kv_heads, capacity]``, ``marked`` (bool, same shape:
    the token's successor decided to evict it), ``lengths [batch, kv_heads]`` entries per head;
    entries ``< lengths`` are packed at the front of each head."""

    state_names = ("keys", "values", "positions", "marked", "lengths")

    def __init__(self, window: int):
        super().__init__(window)
        self.positions = self.marked = None

    def lazy_initialization(self, key_states, value_states) -> None:
        raise NotImplementedError("DMSCacheLayer is written by DMS attention (fill / append)")

    def _pack(self, keys, values, positions, marked, keep) -> None:
        """Stores the entries with ``keep [batch, kv, m]`` set, in order, at the front of each
        head (the rest is padding beyond ``lengths``)."""
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
        self.lengths = keep.sum(-1)
        width = max(int(self.lengths.max()), 1) if keep.numel() else 1
        order = order[..., :width]
        gather = order[..., None].expand(-1, -1, -1, keys.shape[-1])
        self.keys = keys.gather(2, gather)
        self.values = values.gather(2, gather)
        self.positions = positions.gather(2, order)
        self.marked = marked.gather(2, order)
        self.is_initialized = True

    def fill(self, keys, values, positions, marked, real) -> None:
        """Packs a prefilled batch: ``keys, values [batch, kv, n, dim]`` (keys rotated),
        ``positions [batch, n]``, ``marked [batch, kv, n]``, ``real [batch, n]``; keeps the real
        tokens that the newest one still sees (what the cache holds after a decode step)."""
        last = positions.masked_fill(~real, -1).max(-1).values  # the newest real position
        positions = positions[:, None].expand_as(marked)
        gone = marked & (last[:, None, None] - positions > self.window)
        self._pack(keys, values, positions, marked, real[:, None] & ~gone)

    def append(self, key, value, mark_previous, position) -> None:
        """One token per sequence: ``key, value [batch, kv, dim]`` (key rotated), its decision
        ``mark_previous [batch, kv]`` (marks the head's newest entry, the previous token) and
        ``position [batch]``. Drops the marked entries that leave the window (the query at
        ``position`` no longer sees them), then appends the token."""
        index = torch.arange(self.keys.shape[2], device=self.keys.device)
        newest = index == (self.lengths - 1)[..., None]
        marked = self.marked | (newest & mark_previous[..., None])
        valid = index < self.lengths[..., None]
        gone = marked & (position[:, None, None] - self.positions > self.window)
        keys = torch.cat([self.keys, key[:, :, None].to(self.keys.dtype)], dim=2)
        values = torch.cat([self.values, value[:, :, None].to(self.values.dtype)], dim=2)
        positions = torch.cat([self.positions,
                               position[:, None, None].expand(-1, key.shape[1], 1)], dim=2)
        marked = torch.cat([marked, torch.zeros_like(marked[..., :1])], dim=2)
        keep = torch.cat([valid & ~gone, torch.ones_like(valid[..., :1])], dim=2)
        self._pack(keys, values, positions, marked, keep)


class DMSCache(CompressedCache):
    """Evicting KV cache of a :class:`DMSLlamaForCausalLM`: one :class:`DMSCacheLayer` per layer
    plus, per sequence, the tokens seen (``seen``) and the RoPE position of the next token
    (``next_position [batch]``)."""

    def __init__(self, config: DMSLlamaConfig):
        super().__init__([DMSCacheLayer(config.dms_window)
                          for _ in range(config.num_hidden_layers)])


# ----------------------------------------------------------------------------- modules
class DMSAttention(CompressedAttention):
    """Eval-mode DMS self-attention (see the module docstring)."""

    def __init__(self, config: DMSLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.c = float(config.dms_c)
        self.logit_scale = float(config.dms_logit_scale)
        self.window = config.dms_window
        self.dms_decision_proj = (nn.Linear(config.hidden_size, self.kv_heads, bias=False)
                                  if config.dms_decision == "adapter" else None)

    def forward(self, hidden, positions, real, inv_freq, cache: DMSCacheLayer | None,
                prefill: bool):
        """``hidden [batch, n, hidden]``, ``positions [batch, n]``, ``real [batch, n]`` bool.
        ``prefill``: the cache (if any) is empty and all ``n`` tokens are processed at once;
        otherwise ``n == 1`` and the token goes through ``cache``."""
        batch, n, _ = hidden.shape
        if self.dms_decision_proj is None:
            channels = split_dms_channels(self._queries(hidden), self.kv_heads, self.c,
                                          self.logit_scale)
            logit = channels.alpha_logit
            q = zero_dms_channel(apply_rope(channels.query, positions[:, None], inv_freq),
                                 self.kv_heads)
        else:
            proj = self.dms_decision_proj(hidden).transpose(1, 2)  # [batch, kv, n]
            logit = (proj * self.logit_scale - self.c).float()
            q = apply_rope(self._queries(hidden), positions[:, None], inv_freq)
        evict = logit > 0  # [batch, kv, n]: alpha_t marks key t - 1
        k = apply_rope(self._keys(hidden), positions[:, None], inv_freq)
        v = self._split(self.v_proj(hidden), self.kv_heads)
        if prefill:
            context = self._prefill(q, k, v, evict, positions, real, cache)
        else:
            cache.append(k[:, :, 0], v[:, :, 0], evict[..., 0], positions[:, 0])
            context = self._attend(q, cache)
        context = context.transpose(1, 2).reshape(batch, n, self.heads * self.head_dim)
        return self.o_proj(context.to(hidden.dtype))

    def _prefill(self, q, k, v, evict, positions, real, cache):
        batch, n = real.shape
        marked = torch.zeros_like(evict)  # marked[j] = alpha_{j+1}: the next token's decision
        marked[..., :-1] = evict[..., 1:]
        index = torch.arange(n, device=q.device)
        causal = index[None, :] <= index[:, None]  # [query i, key j]
        recent = (index[:, None] - index[None, :]) <= self.window
        visible = causal & (recent | ~marked[..., None, :]) & real[:, None, None, :]
        visible = visible | torch.eye(n, dtype=torch.bool, device=q.device)  # padding: no NaN
        scores = torch.einsum("bhgqd,bhkd->bhgqk",
                              q.view(batch, self.kv_heads, self.group, n, -1), k) * self.scale
        scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
        context = torch.einsum("bhgqk,bhkd->bhgqd", scores.softmax(-1), v)
        if cache is not None:
            cache.fill(k, v, positions, marked, real)
        return context.reshape(q.shape)

    def _attend(self, q, cache: DMSCacheLayer):
        """One query per sequence over each head's entries: ``q [batch, heads, 1, dim]``."""
        batch = q.shape[0]
        scores = torch.einsum("bhgd,bhsd->bhgs", q.view(batch, self.kv_heads, self.group, -1),
                              cache.keys.float()) * self.scale
        valid = torch.arange(cache.keys.shape[2], device=q.device) < cache.lengths[..., None]
        scores = scores.masked_fill(~valid[:, :, None], float("-inf"))
        context = torch.einsum("bhgs,bhsd->bhgd", scores.softmax(-1), cache.values.float())
        return context.reshape(batch, self.heads, 1, -1)


class DMSLlamaModel(CompressedLlamaModel):
    config_class = DMSLlamaConfig
    attention_class = DMSAttention
    cache_class = DMSCache


class DMSLlamaForCausalLM(CompressedLlamaForCausalLM):
    config_class = DMSLlamaConfig
    model_class = DMSLlamaModel
