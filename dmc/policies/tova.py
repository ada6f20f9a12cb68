"""TOVA, Token Omission Via Attention (Oren et al., 2024, "Transformers are Multi-State RNNs").

Whenever a layer holds more states than its budget, drop the token with the lowest attention
score of the CURRENT (last) query, the scores being averaged over the layer's heads (Sec. 3.3:
the same token is dropped in every head of the layer). A prompt chunk is scored by its last
token's attention, as the authors' prefill does; a decode step by the new token's.

GQA: the average runs over all query heads of the layer, so every KV head keeps the same tokens.

Schedule: ``"streaming"`` by default, the paper's (Sec. 3.3: a multi-state RNN of bounded size,
one state dropped at every decoding step once the limit is reached).
"""
from __future__ import annotations

import torch

from .base import KVPolicy, LayerView


class TOVA(KVPolicy):
    """TOVA eviction: keep the ``b`` tokens the last query attends to most (head-averaged)."""

    name = "tova"
    slot_state_names = ("last",)

    def bind(self, shape) -> None:
        super().bind(shape)
        self.last = self._slot_tensor()  # [seqs, layers, kv, slots], head-averaged

    def observe(self, view, queries, q_positions, probs, prefill) -> None:
        rows = view.seqs.to(probs.device)
        latest = probs[:, :, :, -1].mean(dim=(1, 2))  # [batch, L]: mean over all query heads
        self.last[rows, view.layer, :, :probs.shape[-1]] = latest[:, None]

    def scores(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        width = view.positions.shape[-1]
        return self.last[view.seqs.to(view.device), view.layer, :, :width]
