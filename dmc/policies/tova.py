"""TOVA, Token Omission Via Attention (Oren et al., 2024, "Transformers are Multi-State RNNs").

Whenever a layer holds more states than its budget, drop the token with the lowest attention
score of the CURRENT (last) query, the scores being averaged over the layer's heads (Sec. 3.3:
the same token is dropped in every head of the layer). A prompt chunk is scored by its last
token's attention, as the authors' prefill does; a decode step by the new token's.

GQA: the average runs over all query heads of the layer, so every KV head keeps the same tokens.
``per_head=True`` scores each KV head by its own query group's attention instead (CAOTE's
per-head alpha, Eq. 8): CAOTE over TOVA selects per head, and once the heads hold different
tokens, an average over heads slot by slot would mix different tokens.

Schedule: ``"streaming"`` by default, the paper's (Sec. 3.3: a multi-state RNN of bounded size,
one state dropped at every decoding step once the limit is reached).
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from .base import KVPolicy, LayerView


@dataclass(eq=False)
class TOVA(KVPolicy):
    """TOVA eviction: keep the ``b`` tokens the last query attends to most (head-averaged)."""

    _: KW_ONLY
    per_head: bool = False

    name = "tova"
    slot_state_names = ("last",)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.per_head, bool):
            raise ValueError(f"per_head must be true or false, got {self.per_head!r}")

    def bind(self, shape) -> None:
        super().bind(shape)
        self.last = self._slot_tensor()  # [seqs, layers, kv, slots]

    def observe(self, view, queries, q_positions, probs, prefill) -> None:
        rows = view.seqs.to(probs.device)
        latest = probs[:, :, :, -1].mean(dim=2)  # [batch, kv, L]: each query group's mean
        if not self.per_head:  # groups are equal: the mean over all query heads
            latest = latest.mean(dim=1, keepdim=True)
        self.last[rows, view.layer, :, :probs.shape[-1]] = latest

    def scores(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        width = view.positions.shape[-1]
        return self.last[view.seqs.to(view.device), view.layer, :, :width]
