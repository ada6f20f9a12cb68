"""The memory a decode benchmark mode holds at equal budget: every byte a
:class:`~dmc.inference.PagedKVCache` allocates, and the largest batch that fits a budget."""
from __future__ import annotations

import math

import torch

INT32 = 4
FLOAT32 = 4


def cache_allocation(num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                     page_size: int, max_seqs: int, window: int | None, dtype: torch.dtype,
                     max_seq_len: int) -> dict:
    """Bytes a :class:`~dmc.inference.PagedKVCache` built with these arguments allocates on its
    device, by part: ``pages`` (K and V pools), ``block_tables`` (one int32 row of
    ``ceil(max_seq_len / page_size)`` page ids per (sequence slot, layer, KV head)), ``lengths``
    (int32 per head), ``dmc_state`` (float32 ring of ``window`` pre-RoPE keys and values, or the
    running mean, their weights, and the int32 token count, per head), ``rope`` (the float32
    frequencies); ``total`` sums them."""
    heads = max_seqs * num_layers * num_kv_heads
    rows = window or 1
    element = torch.empty((), dtype=dtype).element_size()
    out = {
        "pages": 2 * num_pages * page_size * head_dim * element,
        "block_tables": heads * math.ceil(max_seq_len / page_size) * INT32,
        "lengths": heads * INT32,
        "dmc_state": heads * (2 * rows * head_dim * FLOAT32 + rows * FLOAT32 + INT32),
        "rope": head_dim // 2 * FLOAT32,
    }
    out["total"] = sum(out.values())
    return out


def fit_batch(budget: int, pages_per_seq: int, state_per_seq: int, shape: dict) -> tuple:
    """The largest batch whose cache (:func:`cache_allocation` with ``batch * pages_per_seq``
    pages) plus ``state_per_seq`` bytes per sequence fits ``budget`` bytes, and the pages the
    budget then holds: ``(batch, num_pages)``; batch 0 when not even one sequence fits."""
    def fixed(batch):
        return cache_allocation(num_pages=0, max_seqs=batch, **shape)["total"] \
            + batch * state_per_seq

    page = cache_allocation(num_pages=1, max_seqs=0, **shape)["pages"]
    batch = 0
    while fixed(batch + 1) + (batch + 1) * pages_per_seq * page <= budget:
        batch += 1
    return batch, (budget - fixed(batch)) // page if batch else 0
