"""The memory a decode benchmark mode holds at equal budget: every byte its cache allocates
(:func:`~dmc.inference.allocation.cache_allocation`), and the largest batch that fits a
budget."""
from __future__ import annotations

from dmc.inference.allocation import cache_allocation, page_bytes

__all__ = ["cache_allocation", "fit_batch"]


def fit_batch(budget: int, pages_per_seq: int, state_per_seq: int, shape: dict,
              headroom_pages: int = 0) -> tuple:
    """The largest batch whose cache (:func:`cache_allocation` with ``batch * pages_per_seq +
    headroom_pages`` pages) plus ``state_per_seq`` bytes per sequence fits ``budget`` bytes, and
    the pages the budget then holds: ``(batch, num_pages)``; batch 0 when not even one sequence
    fits. ``headroom_pages``: what the scheduler keeps free beyond a prompt's expected pages to
    admit it while others run (a page per head), so that the whole batch runs at once."""
    def fixed(batch):
        return cache_allocation(num_pages=0, max_seqs=batch, **shape)["total"] \
            + batch * state_per_seq

    page = page_bytes(**shape)  # K, V, a free-list id on the CPU
    batch = 0
    while fixed(batch + 1) + ((batch + 1) * pages_per_seq + headroom_pages) * page <= budget:
        batch += 1
    return batch, (budget - fixed(batch)) // page if batch else 0
