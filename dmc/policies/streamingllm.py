"""StreamingLLM (Xiao et al., ICLR 2024, "Efficient Streaming Language Models with Attention Sinks").

Keep the first ``sinks`` tokens (attention sinks, 4 in the paper) and the most recent
``b - sinks`` ones; positions are those IN THE CACHE (Sec. 3.2, "we focus on positions within the
cache rather than those in the original text"): a kept key sits at its cache index ``j`` and the
query at the next one.

Keys are cached post-RoPE at their original positions. RoPE scores depend on ``query - key``
positions only, so the cache-position layout equals one shifted by ``delta = n - L`` (tokens seen
minus slots held) everywhere: the contiguous recent window already sits at ``j + delta`` (its
original positions) and queries keep their original positions; only the sinks must move, from
``i`` to ``i + delta``. They are re-rotated by ``RoPE(delta)`` (rotations compose) from a float32
copy of their keys as first cached, so no rounding accumulates however often they move.
"""
from __future__ import annotations

import torch

from dmc.inference.kernels import apply_rope

from .base import KVPolicy, LayerView, first_mask, recent_mask


class StreamingLLM(KVPolicy):
    """Attention sinks + recent window, with cache-position RoPE for the sinks.

    Args:
        sinks: attention-sink tokens kept at the start (paper: 4).
    """

    name = "streamingllm"
    seq_state_names = ("sink_keys",)

    def __init__(self, compression_ratio: float = 2.0, *, sinks: int = 4):
        super().__init__(compression_ratio)
        if int(sinks) != sinks or sinks < 0:
            raise ValueError(f"sinks must be an integer >= 0, got {sinks!r}")
        self.sinks = int(sinks)

    def bind(self, shape) -> None:
        super().bind(shape)
        s = shape
        self.sink_keys = torch.zeros(s.max_seqs, s.num_layers, s.num_kv_heads, self.sinks,
                                     s.head_dim, device=s.device)

    def observe(self, view, queries, q_positions, probs, prefill) -> None:
        """Keep a float32 copy of the sinks' keys (rotated at their own positions)."""
        first = int(q_positions[q_positions >= 0].min()) if (q_positions >= 0).any() else 0
        if first >= self.sinks:
            return
        count = min(self.sinks, view.keys.shape[2])
        rows = view.seqs.to(view.keys.device)
        self.sink_keys[rows, view.layer, :, :count] = view.keys[:, :, :count]

    def scores(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(view.keys[..., 0])

    def protected(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        sinks = budget.clamp(max=self.sinks)
        return first_mask(view, sinks) | recent_mask(view, budget - sinks)

    def merge(self, view: LayerView, keep: torch.Tensor):
        """Re-rotate the sinks to ``i + delta`` (``delta = n - kept slots``, Sec. 3.2)."""
        delta = view.tokens[:, None] - keep.sum(-1)  # [batch, kv]
        count = min(self.sinks, view.keys.shape[2])
        rows = view.seqs.to(view.keys.device)
        moved = apply_rope(self.sink_keys[rows, view.layer, :, :count], delta[..., None],
                           self.shape.inv_freq)
        keys = view.keys.clone()
        keys[:, :, :count] = torch.where(view.valid[:, :, :count, None], moved,
                                         keys[:, :, :count])
        return keys, view.values
