"""Ada-KV (Feng et al., NeurIPS 2025, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
Allocation for Efficient LLM Inference", arXiv 2407.11550): head-wise adaptive budgets over any
score-based policy.

Instead of ``b`` slots in every KV head of a layer, the layer's ``H b`` slots (``H`` KV heads) go
to the best-scored tokens of the layer as a whole (the base policy's scores, compared across
heads: Ada-KV's top-k over the concatenated heads, Alg. 1), so a head whose attention is
concentrated gives slots to one whose attention is spread. Each head keeps the base's protected
slots (window, sinks, recent) and, as Ada-KV's safeguard (kvpress's ``alpha_safeguard``), at least
``floor(safeguard b)`` slots, filled with its own best tokens. The layer never holds more than
``H b`` slots; one head may hold more than ``b``. The cache's page tables are per (sequence,
layer, KV head), so the uneven budgets are real memory, not a mask.

Bases: policies whose scores differ across the heads of a layer: not TOVA (its scores are
averaged over the layer's heads, so the layer-wide ranking would favour one head by tie order),
StreamingLLM (no scores) or OmniKV (no eviction).

Schedule: the base policy's paper's by default (Ada-KV changes the allocation, not when it
happens: Ada-SnapKV and Ada-PyramidKV compress once after the prompt, ``"prefill"``).
"""
from __future__ import annotations

import torch

from .base import LayerView, PolicyWrapper, top_mask
from .d2o import D2O
from .h2o import H2O
from .keydiff import KeyDiff
from .knorm import KNorm
from .pyramidkv import PyramidKV
from .random import Random
from .snapkv import SnapKV


class AdaKV(PolicyWrapper):
    """The base policy's scores and budgets, shared by the KV heads of a layer.

    Args:
        base: ``"snapkv"`` (default, Ada-SnapKV), ``"pyramidkv"``, ``"h2o"``, ``"d2o"``,
            ``"knorm"``, ``"keydiff"`` or ``"random"``.
        safeguard: share of ``b`` every head keeps at least, in [0, 1] (Ada-KV: 0.2).
        kwargs: ``schedule``, ``recompress_every``, ``rerotate`` (see
            :class:`~dmc.policies.base.PolicyWrapper`), the others passed to the base policy.
    """

    name = "adakv"
    bases = {cls.name: cls for cls in (SnapKV, PyramidKV, H2O, D2O, KNorm, KeyDiff, Random)}
    default_base = "snapkv"

    def __init__(self, compression_ratio: float = 2.0, *, base: str | None = None,
                 safeguard: float = 0.2, **kwargs):
        super().__init__(compression_ratio, base=base, **kwargs)
        if not 0.0 <= float(safeguard) <= 1.0:
            raise ValueError(f"safeguard must be in [0, 1], got {safeguard!r}")
        self.safeguard = float(safeguard)

    def select(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        """Keep mask ``[batch, kv_heads, L]``: per head the protected slots and its best up to
        ``floor(safeguard b)``; then the best-scored others of the whole layer up to
        ``kv_heads b`` slots (``budget [batch]`` = ``b``)."""
        valid = view.valid
        heads = valid.shape[1]
        guard = self.base.protected(view, budget) & valid
        candidates = valid & ~guard
        scores = self.base.scores(view, budget).masked_fill(~candidates, float("-inf"))
        floor = torch.floor(self.safeguard * budget.double()).long()
        keep = guard | (top_mask(scores, (floor[:, None] - guard.sum(-1)).clamp(min=0))
                        & candidates)
        room = (heads * budget - keep.sum(dim=(1, 2))).clamp(min=0)
        layer_wide = top_mask(scores.masked_fill(keep, float("-inf")).flatten(1), room)
        return keep | (layer_wide.view_as(keep) & candidates)
