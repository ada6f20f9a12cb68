"""Every byte a paged cache allocates, by part: what :class:`~dmc.inference.PagedKVCache`,
:class:`~dmc.inference.dms_cache.DMSPagedCache` and
:class:`~dmc.inference.delayed_cache.DelayedMergeCache` hold beside their pages (one
source for the engine's ``kv_cache_bytes`` and the decode benchmark's equal-memory batches;
tests compare it with the bytes the caches allocate)."""
from __future__ import annotations

import math

import torch

from .cache import open_slot_bytes
from .delayed_cache import delayed_ring_bytes
from .dms_cache import ring_bytes

INT32 = 4
INT64 = 8
FLOAT32 = 4


def cache_allocation(num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                     page_size: int, max_seqs: int, window: int | None, dtype: torch.dtype,
                     max_seq_len: int, dms_window: int | None = None,
                     device: str = "cpu", merge_delay: int | None = None,
                     ring_dtype: torch.dtype = torch.float32) -> dict:
    """Bytes the cache built with these arguments allocates on ``device``, by part: ``pages``
    (K and V pools), ``block_tables`` (one int32 row of ``ceil(max_seq_len / page_size)`` page
    ids per (sequence slot, layer, KV head)), ``lengths`` (int32 per head), ``dmc_state``
    (ring of ``window`` pre-RoPE keys and values in ``ring_dtype``, or the float32 running mean,
    their float32 weights, and the int32 token count, per head; a DMS cache, built with
    ``window=None``, allocates the one-row form too), ``rope`` (the float32 frequencies),
    ``fault_counter`` (two int64, see :mod:`dmc.inference.kernels.faults`), ``free_pages`` (the
    allocator's int32 stack of free page ids, host memory, counted only when ``device`` is the
    CPU); ``total`` sums them.

    With ``dms_window`` (a DMS cache; ``window`` must then be None) also ``dms_ring``: per head
    the window ring of ``dms_window + 1`` keys, values and eviction flags (:func:`ring_bytes`),
    and ``ring_positions``: the int64 tokens written per (sequence slot, layer), host memory,
    counted only when ``device`` is the CPU. With ``merge_delay`` (DMC with delayed merging,
    beside the DMC ``window``) instead ``delay_ring``: per head the ring of ``merge_delay + 1``
    raw keys, values and their float32 decisions (:func:`delayed_ring_bytes`), and
    ``ring_positions``."""
    if dms_window is not None and window is not None:
        raise ValueError(f"cache_allocation: a DMS cache has no DMC window, got {window}")
    if dms_window is not None and merge_delay is not None:
        raise ValueError("cache_allocation: dms_window and merge_delay exclude each other")
    heads = max_seqs * num_layers * num_kv_heads
    rows = window or 1
    element = torch.empty((), dtype=dtype).element_size()
    out = {
        "pages": 2 * num_pages * page_size * head_dim * element,
        "block_tables": heads * math.ceil(max_seq_len / page_size) * INT32,
        "lengths": heads * INT32,
        "dmc_state": heads * open_slot_bytes(rows, head_dim, ring_dtype),
        "rope": head_dim // 2 * FLOAT32,
        "fault_counter": 2 * INT64,
    }
    if dms_window is not None:
        out["dms_ring"] = heads * ring_bytes(dms_window, head_dim, element)
    if merge_delay is not None:
        out["delay_ring"] = heads * delayed_ring_bytes(merge_delay, head_dim, element)
    on_host = torch.device(device).type == "cpu"
    out["free_pages"] = num_pages * INT32 if on_host else 0
    if dms_window is not None or merge_delay is not None:
        out["ring_positions"] = max_seqs * num_layers * INT64 if on_host else 0
    out["total"] = sum(out.values())
    return out


def page_bytes(**shape) -> int:
    """Bytes one more page costs a cache of ``shape`` (:func:`cache_allocation`'s arguments but
    ``num_pages`` and ``max_seqs``): its keys and values, and on the CPU its free-list id."""
    return (cache_allocation(num_pages=1, max_seqs=0, **shape)["total"]
            - cache_allocation(num_pages=0, max_seqs=0, **shape)["total"])
