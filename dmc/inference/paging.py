"""Page arithmetic of the paged KV cache and its host-to-device copies: pages a head of ``n``
slots owns, whether its next slot starts a page, a slot's page and offset (shifts and masks when
the page size is a power of two), the default pool size and the engine's size checks, gathers
of per-sequence host tables, and copies to the device that do not wait for it."""
from __future__ import annotations

import math

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a stream sync: ``non_blocking`` from pageable memory
    stages the bytes before returning, so the (temporary) source may change afterwards."""
    return tensor.to(device, non_blocking=True)


def pages_for(lengths: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages heads of ``lengths`` (integer) slots own: ``ceil(lengths / page_size)``; a shift
    when ``page_size`` is a power of two (integer division is 4-6x slower on the CPU, where a
    decode step computes this over every (sequence, layer, KV head))."""
    if page_size & (page_size - 1) == 0:
        return (lengths + (page_size - 1)) >> (page_size.bit_length() - 1)
    return torch.div(lengths + page_size - 1, page_size, rounding_mode="floor")


def at_page_boundary(lengths: torch.Tensor, page_size: int) -> torch.Tensor:
    """Whether heads of ``lengths`` (integer) slots need a new page for their next slot:
    ``lengths % page_size == 0`` (a mask when ``page_size`` is a power of two)."""
    if page_size & (page_size - 1) == 0:
        return (lengths & (page_size - 1)) == 0
    return lengths % page_size == 0


def page_and_offset(slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``divmod(slots, page_size)`` of slot indices: the block-table column and the offset in
    its page (a shift and a mask when ``page_size`` is a power of two)."""
    if page_size & (page_size - 1) == 0:
        return slots >> (page_size.bit_length() - 1), slots & (page_size - 1)
    return torch.div(slots, page_size, rounding_mode="floor"), slots % page_size


PAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # of the K/V pages


def check_engine_sizes(chunk_size: int, max_batch: int, page_size: int, max_seq_len: int | None,
                       step_tokens: int | None, cache_dtype: torch.dtype | None) -> None:
    """Raises ValueError naming the first of :class:`~dmc.inference.Engine`'s sizes out of range
    or a cache dtype it does not take."""
    for name, value in (("chunk_size", chunk_size), ("max_batch", max_batch),
                        ("page_size", page_size)):
        if value < 1:
            raise ValueError(f"Engine: {name} must be >= 1, got {value}")
    for name, value in (("max_seq_len", max_seq_len), ("step_tokens", step_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"Engine: {name} must be None or >= 1, got {value}")
    if cache_dtype is not None and cache_dtype not in PAGE_DTYPES:
        raise ValueError(f"Engine: cache_dtype must be one of {PAGE_DTYPES} (or None: the "
                         f"model's), got {cache_dtype}")


def default_num_pages(max_batch: int, max_seq_len: int, page_size: int, heads: int,
                      page_bytes: int, budget: int | None, device: torch.device,
                      reserved: int = 0) -> int:
    """Pages for ``max_batch`` uncompressed sequences of ``max_seq_len`` tokens over ``heads``
    (layers x KV heads), within ``budget`` bytes (default: 90% of the free CUDA memory, or a
    quarter of the host RAM) less ``reserved`` bytes (what the cache allocates besides its
    pages: :func:`~dmc.inference.allocation.cache_allocation` with no page)."""
    full = max_batch * math.ceil(max_seq_len / page_size) * heads
    if budget is None:
        if device.type == "cuda":
            budget = int(0.9 * torch.cuda.mem_get_info(device)[0])
        else:
            import psutil

            budget = psutil.virtual_memory().total // 4
    pages = min(full, (budget - reserved) // page_bytes)
    if pages < 1:
        raise ValueError(f"kv_cache_bytes={budget} holds no page of {page_bytes} bytes beside the "
                         f"{reserved} bytes the cache allocates for its sequence slots")
    return pages


def rows_or_zeros(table: torch.Tensor, seq_slots: list) -> torch.Tensor:
    """``table[seq_slots]`` (host, first dimension a sequence slot) with zeros for ``None``."""
    held = [i for i, slot in enumerate(seq_slots) if slot is not None]
    if len(held) == len(seq_slots):  # a decode batch: one gather
        return table[torch.tensor(seq_slots, dtype=torch.long)]
    out = torch.zeros((len(seq_slots),) + table.shape[1:], dtype=table.dtype)
    if held:
        rows = torch.tensor([seq_slots[i] for i in held], dtype=torch.long)
        out[torch.tensor(held, dtype=torch.long)] = table[rows]
    return out
