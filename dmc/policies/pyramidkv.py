"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling"), ``papers/pyramidkv.txt``.

Budget allocation (Sec. 4.2.1): the KV of the last ``alpha`` tokens (the "instruction tokens",
SnapKV's observation window; paper alpha = 8) is kept in every layer; the pyramid is built over
the budget that remains. With ``m`` layers and ``b = ceil(n / CR)`` slots per head per layer, the
remaining total is ``k_total = m (b - alpha)``; the top layer gets ``k^{m-1} = k_total / (beta m)``,
the bottom one ``k^0 = 2 k_total / m - k^{m-1}``, and ``k^l = k^0 - (k^0 - k^{m-1}) l / (m - 1)``
in between (Eq. 1, beta = 20, Sec. 5.1). Layer ``l`` holds ``alpha + k^l`` slots, rounded to
integers that sum exactly to ``m b`` (largest remainders; a layer's ``k^l`` is capped at the
``n - alpha`` tokens it can hold, the excess going to the others, see
:func:`~dmc.policies.base.split_budget`).

When ``b <= alpha`` nothing is left to shape (a layer's budget would be below the window) and
every layer gets ``b`` (uniform), the window shrinking to the budget as in :class:`SnapKV`.

Selection (Sec. 4.2.2, Eq. 2-3): SnapKV's, with the last ``alpha`` queries voting.

Schedule: ``"prefill"`` by default, the paper's (Sec. 4.2.2: the instruction tokens are the last
``alpha`` of the input, ``[n - alpha, n]``, and the discarded KV "will not be utilized in any
subsequent computations throughout the generation process": one compression after the prompt).
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from .base import split_budget
from .snapkv import SnapKV


def pyramid_weights(num_layers: int, beta: float) -> list[float]:
    """``k^l`` of Eq. 1 in units of the mean (they sum to ``num_layers``)."""
    if num_layers == 1:
        return [1.0]
    top = 1.0 / beta
    bottom = 2.0 - top
    return [bottom - (bottom - top) * layer / (num_layers - 1) for layer in range(num_layers)]


@dataclass(eq=False)
class PyramidKV(SnapKV):
    """SnapKV selection under pyramidal (arithmetic) per-layer budgets above the window.

    Args:
        beta: ratio of the mean remaining budget to the top layer's (paper: 20), > 1.
        window: ``alpha``, instruction tokens kept in every layer and voting (paper: 8).
        kernel_size, pooling: as :class:`SnapKV`.
    """

    name = "pyramidkv"
    _: KW_ONLY
    beta: float = 20.0
    window: int = 8

    def __post_init__(self):
        super().__post_init__()
        if not float(self.beta) > 1.0:
            raise ValueError(f"beta must be > 1, got {self.beta!r}")
        self.beta = float(self.beta)

    def budgets(self, view_seqs, tokens):
        """``alpha + k^l`` slots per head of every layer, ``[batch, layers]``."""
        layers = self.shape.num_layers
        weights = pyramid_weights(layers, self.beta)
        rows = []
        for b, n in zip(self.budget(tokens).tolist(), tokens.tolist()):
            rest = b - self.window
            if rest <= 0:
                rows.append([b] * layers)
                continue
            shaped = split_budget(layers * rest, weights, int(n) - self.window)
            rows.append([self.window + k for k in shaped])
        return torch.tensor(rows, dtype=torch.long, device=tokens.device)
