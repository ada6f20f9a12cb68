"""The memory a decode benchmark mode holds at equal budget: every byte its cache allocates
(:func:`~dmc.inference.allocation.cache_allocation`), the pages a batch holds when each
sequence's pages vary (:func:`batch_pages_bound`), and the largest batch that fits a budget."""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from dmc.inference.allocation import cache_allocation, page_bytes

__all__ = ["batch_pages_bound", "cache_allocation", "fit_batch", "student_quantile"]

MIN_SAMPLES = 8  # probed sequences below which no spread is estimated


def batch_pages_bound(per_seq: list[int], z: float = 3.0) -> Callable[[int], int]:
    """``batch -> pages`` that ``batch`` sequences hold at their longest, from the pages each of
    ``n`` probed sequences held (``per_seq``).

    DMC's and DMS's decisions depend on the text, so one sequence's pages vary (at the GPU
    decode preset's layout, forced DMC 4x: 9791 to 10889 pages over 4 sequences,
    docs/performance.md). The batch's total is a sum of ``batch`` such draws: with ``n`` >=
    :data:`MIN_SAMPLES` the one-sided prediction bound of that sum, ``batch * m + t * s *
    sqrt(batch + batch^2 / n)`` (``m``, ``s``: the sample mean and standard deviation; the
    ``batch^2 / n`` term is the uncertainty of ``m`` itself; ``t``: Student's quantile, for
    ``n - 1`` degrees of freedom, of the level ``z`` standard deviations give a normal law,
    :func:`student_quantile`; ``z`` = 3: a batch above the bound about once in 740 under
    normality); with fewer, ``batch`` times the largest probed (too few to estimate a spread).
    A constant ``per_seq`` gives ``batch`` times it either way."""
    if not per_seq:
        raise ValueError("batch_pages_bound: no probed sequence")
    if len(per_seq) < MIN_SAMPLES:
        return lambda batch: batch * max(per_seq)
    mean, spread, n = statistics.fmean(per_seq), statistics.stdev(per_seq), len(per_seq)
    t = student_quantile(z, n - 1)
    return lambda batch: math.ceil(batch * mean + t * spread * math.sqrt(batch + batch**2 / n))


def student_quantile(z: float, dof: int) -> float:
    """Student's t quantile at the level of the normal quantile ``z``, for ``dof`` degrees of
    freedom: the Cornish-Fisher expansion to ``1 / dof^3`` (Abramowitz & Stegun 26.7.5; at
    ``z`` = 3 within 0.5% of the exact value for ``dof`` >= 7: 4.51 at 7, 3.59 at 15, 3.12 at
    63, a test compares)."""
    return (z + (z**3 + z) / (4 * dof)
            + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * dof**3))


def fit_batch(budget: int, pages_per_seq: int | Callable[[int], int], state_per_seq: int,
              shape: dict, headroom_pages: int = 0) -> tuple:
    """The largest batch whose cache (:func:`cache_allocation` with the batch's pages +
    ``headroom_pages`` pages) plus ``state_per_seq`` bytes per sequence fits ``budget`` bytes,
    and the pages the budget then holds: ``(batch, num_pages)``; batch 0 when not even one
    sequence fits. ``pages_per_seq``: the pages each sequence holds at its longest, or a
    function giving those of a whole batch (:func:`batch_pages_bound`). ``headroom_pages``:
    what the scheduler keeps free beyond a prompt's expected pages to admit it while others run
    (a page per head), so that the whole batch runs at once."""
    pages_for = pages_per_seq if callable(pages_per_seq) else (
        lambda batch: batch * pages_per_seq)

    def fixed(batch):
        return cache_allocation(num_pages=0, max_seqs=batch, **shape)["total"] \
            + batch * state_per_seq

    page = page_bytes(**shape)  # K, V, a free-list id on the CPU
    batch = 0
    while fixed(batch + 1) + (pages_for(batch + 1) + headroom_pages) * page <= budget:
        batch += 1
    return batch, (budget - fixed(batch)) // page if batch else 0
