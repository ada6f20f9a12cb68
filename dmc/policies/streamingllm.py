"""StreamingLLM (Xiao et al., ICLR 2024, "Efficient Streaming Language Models with Attention
Sinks").

Keep the first ``sinks`` tokens (attention sinks, 4 in the paper) and the most recent
``b - sinks`` ones; positions are those IN THE CACHE (Sec. 3.2, "we focus on positions within the
cache rather than those in the original text"): a kept key sits at its cache index ``j`` and the
query at the next one.

Keys are cached post-RoPE at their original positions. RoPE scores depend on ``query - key``
positions only, so the cache-position layout equals one shifted by ``delta = n - L`` (tokens seen
minus slots held) everywhere: the contiguous recent window already sits at ``j + delta`` (its
original positions) and queries keep their original positions; only the sink slots (the first
``sinks`` of the cache) must move, to ``i + delta``. They are re-rotated by RoPE (rotations compose)
from a float32 copy of each sink's key as it was before its first move, so no rounding
accumulates however often they move.
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
    seq_state_names = ("sink_keys", "sink_rotation")

    def __init__(self, compression_ratio: float = 2.0, *, sinks: int = 4):
        super().__init__(compression_ratio)
        if int(sinks) != sinks or sinks < 0:
            raise ValueError(f"sinks must be an integer >= 0, got {sinks!r}")
        self.sinks = int(sinks)

    def bind(self, shape) -> None:
        super().bind(shape)
        s = shape
        heads = (s.max_seqs, s.num_layers, s.num_kv_heads, self.sinks)
        self.sink_keys = torch.zeros(heads + (s.head_dim,), device=s.device)  # float32 copies
        self.sink_rotation = torch.zeros(heads, dtype=torch.long, device=s.device)  # their RoPE
        self.sink_owner = torch.full(heads, -1, dtype=torch.long, device=s.device)  # position

    def reset(self, seq: int) -> None:
        super().reset(seq)
        self.sink_owner[seq] = -1

    def scores(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(view.keys[..., 0])

    def protected(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        sinks = budget.clamp(max=self.sinks)
        return first_mask(view, sinks) | recent_mask(view, budget - sinks)

    def merge(self, view: LayerView, keep: torch.Tensor):
        """Re-rotate the sink slots ``i < sinks`` to ``i + delta`` (``delta = n - kept``,
        Sec. 3.2). A slot entering the sink region was never moved: its key is at its original
        position, which is where its copy starts."""
        count = min(self.sinks, view.keys.shape[2])
        if count == 0:
            return None
        rows = view.seqs.to(view.keys.device)
        source = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :count]
        lands = torch.arange(count, device=keep.device) < keep.sum(-1, keepdim=True)
        occupant = torch.where(lands, view.positions.gather(2, source), -1)  # [batch, kv, s]
        current = view.keys.gather(2, source[..., None].expand(-1, -1, -1, view.keys.shape[-1]))
        owner = self.sink_owner[rows, view.layer, :, :count]
        fresh = (owner != occupant)
        copy = torch.where(fresh[..., None], current, self.sink_keys[rows, view.layer, :, :count])
        rotation = torch.where(fresh, occupant, self.sink_rotation[rows, view.layer, :, :count])
        self.sink_keys[rows, view.layer, :, :count] = copy
        self.sink_rotation[rows, view.layer, :, :count] = rotation
        self.sink_owner[rows, view.layer, :, :count] = occupant
        delta = view.tokens[:, None] - keep.sum(-1)  # [batch, kv]
        target = torch.arange(count, device=keep.device) + delta[..., None]
        moved = apply_rope(copy, target - rotation, self.shape.inv_freq)
        keys = view.keys.clone()
        index = torch.where(lands, source, view.keys.shape[2])  # misses land past the end
        padded = torch.cat([keys, keys[:, :, :1]], dim=2)
        padded.scatter_(2, index[..., None].expand_as(moved), moved)
        return padded[:, :, :-1], view.values
