"""``DMSSelfAttention``: megatron-core self-attention with Dynamic Memory Sparsification.

DMS (Łańcucki, Staniszewski, Nawrot, Ponti 2025, "Inference-Time Hyper-Scaling with KV Cache
Compression", arXiv 2506.05345) keeps DMC's borrowed-channel decision but evicts instead of
merging, and delays the eviction: a key marked at token t stays visible to the next w queries.
This class shares everything with :class:`~dmc.megatron.attention.DMCSelfAttention` (modes,
Gumbel noise keyed per (seed, layer, step, micro-batch), straight-through ``hard`` /
``hard_loss``, CR statistics, the CR loss of :mod:`dmc.megatron.cr_loss`) except what the
attention computes:

- decision (DMC Sec. 3.1's borrowed neuron, which DMS Sec. 3 reuses; NVIDIA Model-Optimizer's
  ``prepare_attention_input`` with ``dms_separate_alpha=False``):
  ``alpha_logit = q_g[..., -1] * dms_logit_scale - c`` from the pre-RoPE query of the first head
  ``g`` of each KV group (:func:`dmc.ops.split_dms_channels`); that channel is zeroed before and
  after RoPE (rotate-half moves channel ``d/2 - 1`` into the last one). Keys and values keep
  every channel and are not accumulated.
- ``train``: alpha = sigmoid((alpha_logit + logistic noise) / tau) (the Gumbel-sigmoid of DMS
  Sec. 3 / DMC Eq. 8); alpha_t decides key t - 1 (alpha_0 := 0) and the delayed-eviction mask
  (DMS Sec. 3, :func:`dmc.ops.mask.bias_from_log_keep` with ``delay = dms_window``) adds
  ``log(1 - alpha_{j+1})`` to query i's score of key j only for ``i - j > w``, computed stably
  from the logits (``log_keep_next_from_logits``).
- ``eval``: alpha = [alpha_logit > 0], bias 0 / -inf: the attention of a cache that drops a
  key marked for eviction once it leaves the window.
- ``zero_out``: megatron's core attention with only the borrowed query channels scaled by
  ``zero_out_scale`` before and after RoPE (DMC Eq. 12 applied to DMS's channel; with a
  q norm, before the norm: :meth:`~dmc.megatron.attention.DMCSelfAttention._scale_before_norm`);
  :func:`~dmc.megatron.attention.zero_decision_rows_` then zeroes only those rows of
  ``linear_qkv`` (:func:`~dmc.megatron.attention.decision_rows` of a DMS layer).
- adapter decisions (``dms_decision: adapter``; NVIDIA's ``dms_separate_alpha=True``):
  ``alpha_logit = decision_proj(x) * dms_logit_scale - c`` with ``x`` the attention input
  (``input_layernorm(h)``) and ``decision_proj`` a linear map hidden -> KV heads; the query keeps
  every channel, nothing is zeroed, and ``zero_out`` mode is megatron's attention untouched.
  NVIDIA normalises ``h`` with a norm of its own (``dms_proj_alpha_norm``); an RMSNorm of the
  same ``h`` with the same eps differs from ``input_layernorm`` only by its weight, which the
  converter folds into ``decision_proj`` (:mod:`dmc.convert.nvidia_dms`), so one projection of
  the attention input is the same function with one norm fewer. ``decision_proj`` starts at 0
  (every token's logit -c, as the zeroed borrowed rows give) and is what adapter-only training
  (:mod:`dmc.training.adapter`) trains in this mode.
- CR loss and measured CR: the one-sided hinge of DMC Eq. 10 on the kept slots
  ``sum(1 - alpha)`` (the global prior per sequence equals NVIDIA's
  ``clamp(target_frac_to_close - frac_closed, min=0)``), annealed from 1x by the phases.

Deviations from NVIDIA's DMS code: it computes the loss on straight-through hard decisions
(our ``hard_loss=True``; the default ``False`` is the soft relaxation of the DMC paper); it
counts the decision at position 0, which decides no key, while here alpha_0 := 0 (a sequence
of n tokens has n slots, the last one never decided). Measured CR counts eventual evictions:
the up to w evicted keys still inside the window are not counted as held.

Megatron tensors are ``[seq, batch, heads, dim]``; the ops take ``[batch, heads, seq, dim]``.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear

from dmc.megatron.attention import DMCSelfAttention, to_bhsd, to_sbhd
from dmc.ops import dmc_attention, split_dms_channels, zero_dms_channel


def scale_dms_channel(x: torch.Tensor, kv_heads: int, scale: float) -> torch.Tensor:
    """``x [seq, batch, q_heads, dim]`` with the DMS-borrowed channels (last channel of the
    first query head of each KV group) multiplied by ``scale``, out of place, in x's layout."""
    return zero_dms_channel(x.transpose(1, 2), kv_heads, scale).transpose(1, 2)


class DMSSelfAttention(DMCSelfAttention):
    """Self-attention whose KV heads learn which keys to evict after a delay of
    ``dms_window`` tokens (built by :func:`dmc.megatron.layer_spec.dmc_layer_spec` when
    ``dmc.method`` is ``"dms"``)."""

    method = "dms"

    def __init__(self, config, submodules, layer_number, dmc, **kwargs):
        super().__init__(config, submodules, layer_number, dmc, **kwargs)
        self.decision_proj = None
        if dmc.config.dms_decision == "adapter":
            if hasattr(self.linear_qkv, "layer_norm_weight"):
                raise ValueError("dmc.dms_decision: adapter needs the layer input norm outside "
                                 "linear_qkv (layer spec backend 'local', not 'te')")
            # column-parallel: each TP rank holds the rows of its own KV heads, as linear_qkv
            self.decision_proj = ColumnParallelLinear(
                config.hidden_size, config.num_query_groups, config=config,
                init_method=torch.nn.init.zeros_, bias=False, gather_output=False,
                skip_bias_add=False, is_expert=False, tp_group=self.pg_collection.tp)
            with torch.no_grad():  # also when config.perform_initialization is off
                self.decision_proj.weight.zero_()

    def _adapter(self) -> bool:
        """Whether this layer decides with ``decision_proj``; the runtime's config must agree."""
        if (self.decision_proj is None) != (self.dmc.config.dms_decision == "query"):
            raise ValueError(f"dmc.dms_decision is {self.dmc.config.dms_decision!r} but this "
                             f"layer was built for the other: build the model from its config")
        return self.decision_proj is not None

    def decision_logits(self, hidden_states):
        """Adapter mode: ``hidden_states [seq, batch, hidden]`` (the attention input) ->
        ``decision_proj(hidden_states) [seq, batch, local_kv_heads]``, before the scale and
        offset (``* dms_logit_scale - c``)."""
        if not self._adapter():
            raise ValueError("decision_logits: this DMS layer reads its decisions from the query")
        return self.decision_proj(hidden_states)[0]

    def _compressed_attention(self, hidden_states, rotary_pos_emb):
        """DMS attention of ``train`` and ``eval`` mode: ``hidden_states [seq, batch, hidden]
        -> (context [batch, q_heads, seq, dim], alpha [batch, kv_heads, seq])`` (this rank's
        heads; under TP each rank decides for its own whole KV groups)."""
        cfg = self.dmc.config
        groups = self.num_query_groups_per_partition
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if self._adapter():
            logit = self.decision_logits(hidden_states) * cfg.dms_logit_scale - cfg.c
            alpha, log_keep = self._decisions(logit.permute(1, 2, 0))
            query, key = self._rotate(query, key, rotary_pos_emb)
        else:
            channels = split_dms_channels(to_bhsd(query), groups, cfg.c, cfg.dms_logit_scale)
            alpha, log_keep = self._decisions(channels.alpha_logit)
            query, key = self._rotate(to_sbhd(channels.query), key, rotary_pos_emb)
            query = scale_dms_channel(query, groups, 0.0)
        context = dmc_attention(
            to_bhsd(query),
            to_bhsd(key),
            to_bhsd(value),
            log_keep,
            scale=self.softmax_scale,
            backend=cfg.attention_backend,
            delay=cfg.dms_window,
        )
        return context, alpha

    def _zero_out_forward(self, hidden_states, attention_mask, rotary_pos_emb):
        """Megatron's core attention with the borrowed query channels multiplied by
        ``zero_out_scale`` before and after RoPE (keys untouched); at scale 0 this is the
        ``eval`` model that evicts nothing. Adapter mode borrows no channel: scale 1."""
        scale = 1.0 if self._adapter() else self.dmc.zero_out_scale
        query, key, value = self._zero_out_qkv(hidden_states, scale)
        query, key = self._rotate(query, key, rotary_pos_emb)
        query = scale_dms_channel(query, self.num_query_groups_per_partition, scale)
        context = self.core_attention(query, key, value, attention_mask,
                                      attn_mask_type=self.attn_mask_type)
        return self.linear_proj(context)

    def _scale_borrowed(self, x, is_query, scale):
        """DMS borrows the last channel of the first query head of each KV group only; keys
        are untouched (and everything in adapter mode)."""
        if not is_query or self.decision_proj is not None:
            return x
        return scale_dms_channel(x, self.num_query_groups_per_partition, scale)
