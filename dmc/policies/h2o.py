"""H2O, Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023).

Score of a cached token: the attention it has received so far, accumulated over every query
(Sec. 3, Alg. 1 "accumulated attention"; the authors' ``_update_hh_score`` adds the new queries'
column sums to the running sums and starts each new token at its own column sum). The budget is
split evenly between recent tokens (the last ``ceil(b / 2)`` slots, always kept) and heavy hitters
(the ``floor(b / 2)`` others with the largest accumulated attention).

GQA: a KV head's score is the SUM over the query heads of its group (ranking-equivalent to the
mean). Prompt chunks accumulate every query of the chunk; a decode step, the new query's row.

Schedule: ``"streaming"`` by default, the paper's (Alg. 1: the cache of size ``k`` is brought
back to ``k`` as every token ``i = k + 1 .. n`` arrives, one eviction per decoding step).
"""
from __future__ import annotations

import torch

from .base import KVPolicy, LayerView, recent_mask


class H2O(KVPolicy):
    """H2O eviction: recent window + heavy hitters of accumulated attention (Alg. 1)."""

    name = "h2o"
    slot_state_names = ("accumulated",)

    def bind(self, shape) -> None:
        super().bind(shape)
        self.accumulated = self._slot_tensor()  # [seqs, layers, kv, slots]

    def observe(self, view, queries, q_positions, probs, prefill) -> None:
        rows = view.seqs.to(probs.device)
        width = probs.shape[-1]
        self.accumulated[rows, view.layer, :, :width] += probs.sum(dim=(2, 3))

    def scores(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        width = view.positions.shape[-1]
        return self.accumulated[view.seqs.to(view.device), view.layer, :, :width]

    def protected(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        return recent_mask(view, budget - budget // 2)
