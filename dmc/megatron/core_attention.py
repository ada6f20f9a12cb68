"""Causal core attention through ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` materialises the ``[batch, heads, seq, seq]`` scores,
fills a mask into them and runs an unfused softmax; at 1024 tokens on a CPU that is half of a
training step. :class:`SDPACoreAttention` computes the same ``softmax(q k^T * scale + causal) v``
with PyTorch's fused kernels (flash attention on CPU and CUDA, no score tensor kept for backward)
and falls back to megatron's path for anything it does not cover (an explicit mask, dropout,
softmax offsets, windows, query-key layer scaling).
"""
from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPACoreAttention(DotProductAttention):
    """megatron's ``DotProductAttention`` with a fused causal fast path.

    ``forward(query [sq, b, np, hn], key/value [sk, b, ng, hn], attention_mask, ...)`` returns
    ``[sq, b, np * hn]`` like the parent class.
    """

    def _fused(self, query, key, attention_mask, attn_mask_type) -> bool:
        """Whether SDPA's causal mask is the attention's: self-attention over one span (SDPA
        aligns ``is_causal`` top left, so queries fewer than the keys would see the wrong ones;
        the parent refuses that case) with none of what the fast path leaves out."""
        cfg = self.config
        mask_type = attn_mask_type or self.attn_mask_type
        return (attention_mask is None and mask_type == AttnMaskType.causal
                and query.shape[0] == key.shape[0]
                and not (self.training and cfg.attention_dropout)
                and self.softmax_offset is None and cfg.window_size is None
                and not cfg.apply_query_key_layer_scaling)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if (attention_bias is not None or packed_seq_params is not None
                or not self._fused(query, key, attention_mask, attn_mask_type)):
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 scale=self.softmax_scale)
        seq, batch = query.shape[:2]
        return context.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)


def use_sdpa(spec):
    """``spec`` (a layer ``ModuleSpec`` from megatron's local spec) with its core attention
    replaced by :class:`SDPACoreAttention`, in place; returns it."""
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec

