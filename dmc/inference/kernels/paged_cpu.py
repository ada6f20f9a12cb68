"""Batched paged decode attention on the CPU (semantics of
:func:`~dmc.inference.kernels.reference.paged_decode_reference`, which stays the oracle).

The compiled kernel of :mod:`~dmc.inference.kernels.native` runs when it can (it reads the
pages in place: about 2x faster than the PyTorch code below at 1K-token contexts, 4x under DMC);
the PyTorch path below is the fallback without a C compiler and for inputs the kernel does not
take.

Its cost is the bytes it reads: each (sequence, KV head) row gathers its whole pages with one
``index_select`` per length bucket (no per-slot index), slots past a head's length are hidden from
the scores only (keys and values are never copied a second time; the few padded value rows are
zeroed in place so that whatever they hold cannot leak through a zero probability), and the
``G = q_heads / kv_heads`` query heads of a row share its keys and values in one ``bmm``.

Rows are grouped by page count into buckets whose longest and shortest row differ by at most a
factor ``growth`` (plus ``slack`` pages), so padding is bounded while the number of buckets, the
only Python loop, stays logarithmic in the longest head: one for vanilla (all heads of a layer
equal), a few under DMC.
"""
from __future__ import annotations

import math

import torch

from .faults import refuse_outside_pool
from .native import native_paged_decode

GROWTH = 1.25  # longest / shortest (pages + SLACK) within a bucket
SLACK = 4  # pages of padding a bucket of short rows may always carry
CHUNK_BYTES = 4 * 2**20  # gathered keys and values per batched matmul: allocations stay small


def length_buckets(pages: torch.Tensor, growth: float = GROWTH,
                   slack: int = SLACK) -> list[tuple[torch.Tensor, int]]:
    """Non-empty rows grouped by page count: ``[(rows, width)]`` with ``rows`` a long tensor of
    row indices into ``pages [rows]`` (host) and ``width`` the most pages of a row of the bucket;
    within a bucket ``(width + slack) / (pages + slack) < growth``. Rows of 0 pages are left out."""
    order = torch.argsort(pages, descending=True)
    counts = pages[order]
    order, counts = order[counts > 0], counts[counts > 0]
    if not order.numel():
        return []
    keys = torch.floor(torch.log((counts + slack).double()) / math.log(growth)).long()
    sizes = torch.unique_consecutive(keys, return_counts=True)[1].tolist()
    starts = [0] + list(torch.tensor(sizes).cumsum(0)[:-1].tolist())
    firsts = counts[torch.tensor(starts)].tolist()
    return list(zip(order.split(sizes), firsts))


def paged_decode_batched(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    host_lengths: torch.Tensor | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    return_lse: bool = False,
    native: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One-query attention over each head's paged slots, with GQA, batched over length buckets.

    Args:
        q: ``[batch, q_heads, head_dim]``; query head ``i`` reads KV head ``i // G``.
        k_pages, v_pages: ``[num_pages, page_size, head_dim]``.
        block_tables: ``[batch, kv_heads, max_pages]`` int page ids (``-1`` = no page).
        lengths: ``[batch, kv_heads]`` slots per head; a head with no slot yields zeros.
        scale: softmax scale.
        host_lengths: ``lengths`` on the host when the caller has them (saves a device read).
        chunk_bytes: most bytes of float32 keys and values gathered at once.
        return_lse: also return each query's log-sum-exp of its scaled scores, ``[batch,
            q_heads]`` float32 (``-inf`` for a head with no slot), so that attention over
            further keys can be merged in (DMS's window ring).
        native: try the compiled kernel first (``False``: the PyTorch path only).

    Returns:
        ``[batch, q_heads, head_dim]`` in the dtype of ``q``; computed in float32 (and the
        log-sum-exp with ``return_lse``).
    """
    compiled = native and native_paged_decode(q, k_pages, v_pages, block_tables,
                                              lengths if host_lengths is None else host_lengths,
                                              scale)
    if compiled:
        out, lse = compiled
        return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)
    batch, q_heads, head_dim = q.shape
    kv_heads = block_tables.shape[1]
    group = q_heads // kv_heads
    page_size = k_pages.shape[1]
    rows = batch * kv_heads
    host = (lengths if host_lengths is None else host_lengths).reshape(rows).long().cpu()
    queries = (q.float() * scale).reshape(rows, group, head_dim)
    tables = block_tables.reshape(rows, -1)
    k_flat = k_pages.view(k_pages.shape[0], -1)  # 2-D index_select: a row copy per page
    v_flat = v_pages.view(v_pages.shape[0], -1)
    out = torch.zeros(rows, group, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((rows, group), float("-inf"), dtype=torch.float32, device=q.device)
    row_bytes = 2 * page_size * head_dim * 4  # one page of keys and values in float32
    for bucket, width in length_buckets((host + page_size - 1) // page_size):
        for picked in bucket.split(max(1, chunk_bytes // (width * row_bytes))):
            _attend(out, lse, queries, k_flat, v_flat, tables, host, picked, width * page_size)
    out = out.reshape(batch, q_heads, head_dim).to(q.dtype)
    return (out, lse.reshape(batch, q_heads)) if return_lse else out


def _attend(out, lse, queries, k_flat, v_flat, tables, host, picked, slots) -> None:
    """Rows ``picked`` (host long ``[n]``) of one bucket, ``slots`` (a whole number of pages)
    each: ``out[picked] = softmax(queries[picked] @ keys^T) @ values`` over their valid slots,
    ``lse[picked]`` the log-sum-exp of those scores.

    ``out``, ``queries``: ``[rows, group, head_dim]`` float32; ``lse``: ``[rows, group]``;
    ``k_flat``, ``v_flat``:
    ``[num_pages, page_size * head_dim]``; ``tables``: ``[rows, max_pages]``; ``host``: ``[rows]``
    host lengths."""
    device, head_dim = queries.device, queries.shape[-1]
    page_size = k_flat.shape[1] // head_dim
    rows = picked.to(device, non_blocking=True)
    ids = tables.index_select(0, rows)[:, :slots // page_size].long()
    refuse_outside_pool(ids, k_flat.shape[0], torch.arange(ids.shape[1]) * page_size
                        < host[picked, None], "paged decode attention (PyTorch path)",
                        lambda i: f"(sequence, KV head) row {int(picked[i[0]])}, page column "
                                  f"{i[1]}")
    ids = ids.clamp(min=0).reshape(-1)
    keys = k_flat.index_select(0, ids).view(-1, slots, head_dim).float()
    values = v_flat.index_select(0, ids).view(-1, slots, head_dim).float()
    hidden = torch.arange(slots) >= host[picked, None]  # [n, slots], host
    padded = hidden.view(-1).nonzero()[:, 0].to(device, non_blocking=True)
    values.view(-1, head_dim).index_fill_(0, padded, 0.0)  # a zero probability times NaN is NaN
    hidden = hidden.to(device, non_blocking=True)
    scores = torch.bmm(queries.index_select(0, rows), keys.transpose(1, 2))
    scores.masked_fill_(hidden[:, None, :], float("-inf"))
    row_lse = torch.logsumexp(scores, dim=-1)  # [n, group]
    probs = torch.exp(scores.sub_(row_lse[..., None]))  # [n, group, slots]
    out.index_copy_(0, rows, torch.bmm(probs, values))
    lse.index_copy_(0, rows, row_lse)
