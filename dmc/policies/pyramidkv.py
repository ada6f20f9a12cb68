"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling").

SnapKV's selection (observation window, pooled votes, window kept) with per-layer budgets on an
arithmetic sequence (Sec. 3.3): with ``m`` layers and a total of ``T`` slots per head summed over
layers, the top layer gets ``k_{m-1} = T / (beta m)``, the bottom one ``k_0 = 2T/m - k_{m-1}``, and
``k_l = k_0 - (k_0 - k_{m-1}) l / (m - 1)`` in between (``beta = 20``). Here
``T = m ceil(n / CR)``, rounded to integers that sum exactly to ``T`` (largest remainders; a layer
rounded down to 0 gets 1 slot from the largest, see :func:`~dmc.policies.base.layer_budgets`).
"""
from __future__ import annotations

from .base import layer_budgets
from .snapkv import SnapKV


def pyramid_weights(num_layers: int, beta: float) -> list[float]:
    """``k_l`` of Sec. 3.3 in units of the mean budget (they sum to ``num_layers``)."""
    if num_layers == 1:
        return [1.0]
    top = 1.0 / beta
    bottom = 2.0 - top
    return [bottom - (bottom - top) * layer / (num_layers - 1) for layer in range(num_layers)]


class PyramidKV(SnapKV):
    """SnapKV selection under pyramidal (arithmetic) per-layer budgets.

    Args:
        beta: ratio of the mean budget to the top layer's (paper: 20), > 1.
        window, kernel_size, pooling: as :class:`SnapKV`.
    """

    name = "pyramidkv"

    def __init__(self, compression_ratio: float = 2.0, *, beta: float = 20.0, window: int = 32,
                 kernel_size: int = 5, pooling: str = "avgpool"):
        super().__init__(compression_ratio, window=window, kernel_size=kernel_size,
                         pooling=pooling)
        if not float(beta) > 1.0:
            raise ValueError(f"beta must be > 1, got {beta!r}")
        self.beta = float(beta)

    def budgets(self, view_seqs, tokens):
        weights = pyramid_weights(self.shape.num_layers, self.beta)
        return layer_budgets(self.budget(tokens), tokens, [weights] * len(tokens))
