"""Triton DMS decode write (DMS paper Sec. 3, delayed eviction), one launch per layer: the
semantics of :meth:`dmc.inference.dms_cache.DMSPagedCache.decode_write`'s PyTorch path (which
stays the oracle), where that path runs ~35 small ops per layer (ring indices, the eviction
flag, the leaving token's page, its copy to the pages, the length, the fault count, the ring
rows) that a CUDA graph replays as as many kernel launches.

One program per (sequence, KV head), the token at position ``p``, ring of ``R = w + 1`` rows:

1. token ``p - 1``'s eviction flag ``evict and p > 0`` into ring row ``(p - 1) mod R``;
2. where ``p >= R``, token ``p - R`` leaves ring row ``p mod R``: it is copied to slot
   ``length`` of its head's pages (its page reserved when the step opened) and the length grows
   by one unless it is flagged (a flagged token's copy lies past the length, where nothing reads
   it: copying it anyway keeps the pages equal to the other paths', bit for bit); a
   block-table entry there that is no page of the pool is counted in the fault counter
   (:mod:`.faults`) and not followed;
3. token ``p`` (rotated key, value) into ring row ``p mod R``, its flag cleared.

With ``query=`` the program also takes its KV group's decode queries: it reads the eviction
from their borrowed channel and rotates them (as :func:`~.decode_rope.decode_rope` does, in a
launch of its own), and rotates the token's key by the same tables (the key then comes
pre-RoPE): the decode step's whole write in one launch.

Pools, block tables, lengths and rings contiguous, as the cache builds them. Import this module
only after ``TRITON_INTERPRET`` is settled (the cache imports it lazily).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_rope import (
    _dms_query_rope,
    _load_group,
    _rotate_half,
    _store_group,
    query_operands,
)
from .faults import unread_counter


@triton.jit
def _dms_write_kernel(
    k_pages, v_pages, tables, lengths, ring_k, ring_v, ring_flags,
    row_ptr, pos_ptr, k_ptr, v_ptr, evict_ptr, faults,
    layer, num_layers, max_pages, num_pages,
    stride_kb, stride_kh, stride_vb, stride_vh,
    q_ptr, cos_ptr, sin_ptr, q_out, stride_qb, stride_qh, stride_cb, evict_c, evict_scale,
    HEADS: tl.constexpr, DIM: tl.constexpr, DIM_BLOCK: tl.constexpr,
    PAGE_SIZE: tl.constexpr, RING: tl.constexpr, QUERY: tl.constexpr, GROUP: tl.constexpr,
    GROUP_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr,
):
    """Every load first, then every store (a store ahead of a load keeps it from being issued
    before it: the compiler cannot tell that they do not alias); the one address read after
    it is written, the flag of ring row ``p mod R`` when ``R = 1``, is read from the register
    that holds the value written. A barrier between loads and stores: the leaving token's row
    is loaded in one layout and the new token stored into it in another (and a scalar is
    stored by one lane of several that read it), so without it a lane could overwrite what
    another lane of another warp has not read yet."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(row_ptr + b).to(tl.int64)
    head = (row * num_layers + layer) * HEADS + h  # flat (row, layer, head) of the cache state
    p = tl.load(pos_ptr + b).to(tl.int64)
    slot = p % RING
    previous = (p - 1 + RING) % RING
    cols = tl.arange(0, DIM_BLOCK)
    col_mask = cols < DIM
    ring_row = (head * RING + slot) * DIM
    leaving = p >= RING
    if QUERY:  # the group's queries (their eviction, rotated) and the key rotated, by halves
        q_lo, q_hi, q_cos, q_sin, q_rows, half, q_mask = _load_group(
            q_ptr, cos_ptr, sin_ptr, b, h, stride_qb, stride_qh, stride_cb, GROUP, GROUP_BLOCK,
            DIM // 2, HALF_BLOCK)
        decided, q_lo, q_hi = _dms_query_rope(q_lo, q_hi, q_cos, q_sin, q_mask, half, q_rows,
                                              evict_c, evict_scale, q_ptr, DIM // 2)
        evict = decided & (p > 0)
        half_mask = (half < DIM // 2)[None, :]  # the key as one row, [1, HALF_BLOCK]
        k_row = k_ptr + b * stride_kb + h * stride_kh + half[None, :]
        k_lo, k_hi = _rotate_half(
            tl.load(k_row, mask=half_mask, other=0.0).to(tl.float32),
            tl.load(k_row + DIM // 2, mask=half_mask, other=0.0).to(tl.float32), q_cos, q_sin)
    else:
        evict = (tl.load(evict_ptr + b * HEADS + h) != 0) & (p > 0)
    flag = tl.load(ring_flags + head * RING + slot)
    length = tl.load(lengths + head)
    leaves = col_mask & (p + tl.zeros([DIM_BLOCK], dtype=tl.int64) >= RING)  # a vector mask
    leaving_k = tl.load(ring_k + ring_row + cols, mask=leaves, other=0.0)
    leaving_v = tl.load(ring_v + ring_row + cols, mask=leaves, other=0.0)
    if not QUERY:
        key = tl.load(k_ptr + b * stride_kb + h * stride_kh + cols, mask=col_mask, other=0.0)
    value = tl.load(v_ptr + b * stride_vb + h * stride_vh + cols, mask=col_mask, other=0.0)
    column = length // PAGE_SIZE
    page = tl.load(tables + head * max_pages + column, mask=column < max_pages,
                   other=-1).to(tl.int64)

    flag = tl.where(previous == slot, evict.to(tl.uint8), flag)  # R = 1: step 1's flag
    kept = leaving & (flag == 0)
    page = tl.where(leaving, page, 0)  # nothing leaves: no entry looked at
    outside = (page < 0) | (page >= num_pages)  # not followed, counted
    pages = tl.where(leaving, page, -1) + tl.zeros([DIM_BLOCK], dtype=tl.int64)  # a vector
    move = col_mask & (pages >= 0) & (pages < num_pages)  # (the interpreter's masks)
    dst = (page * PAGE_SIZE + length % PAGE_SIZE) * DIM + cols
    ring_ty = ring_k.dtype.element_ty

    tl.debug_barrier()  # every lane's loads done before any lane stores (the docstring)
    tl.store(ring_flags + head * RING + previous, evict.to(tl.uint8))
    tl.atomic_add(faults, 1, mask=outside)
    tl.atomic_max(faults + 1, head, mask=outside)
    tl.store(k_pages + dst, leaving_k, mask=move)
    tl.store(v_pages + dst, leaving_v, mask=move)
    tl.store(lengths + head, length + kept.to(length.dtype))
    if QUERY:
        tl.store(ring_k + ring_row + half[None, :], k_lo.to(ring_ty), mask=half_mask)
        tl.store(ring_k + ring_row + DIM // 2 + half[None, :], k_hi.to(ring_ty), mask=half_mask)
        _store_group(q_out, q_lo, q_hi, b, h, q_rows, half, q_mask, GROUP, DIM // 2)
    else:
        tl.store(ring_k + ring_row + cols, key.to(ring_ty), mask=col_mask)
    tl.store(ring_v + ring_row + cols, value.to(ring_ty), mask=col_mask)
    tl.store(ring_flags + head * RING + slot, 0)


def dms_write(k_pages, v_pages, block_tables, lengths, ring_k, ring_v, ring_evict, layer: int,
              rows: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor, evict: torch.Tensor | None, faults=None,
              query=None) -> torch.Tensor | None:
    """The decode write of one layer (module docstring), in place.

    Args:
        k_pages, v_pages: ``[num_pages, page_size, head_dim]``.
        block_tables: ``[rows, layers, kv_heads, max_pages]`` int32; lengths: ``[rows, layers,
            kv_heads]`` int32 (device), grown where a token is kept.
        ring_k, ring_v: ``[rows, layers, kv_heads, R, head_dim]``; ring_evict: ``[rows, layers,
            kv_heads, R]`` bool, the flags of the ring's tokens.
        layer: the layer; rows: ``[batch]`` the sequences' cache rows (device ints).
        positions: ``[batch]`` the tokens' positions p (device ints).
        keys, values: ``[batch, kv_heads, head_dim]`` (rotated keys; any float dtype, unit stride
            on the last dimension).
        evict: ``[batch, kv_heads]`` bool or 0 / 1, token p - 1's eviction decision.
        faults: a fault counter (:func:`~dmc.inference.kernels.faults.fault_counter`; None: one
            nobody reads).
        query: ``(q [batch, q_heads, head_dim], cos, sin, channel)``: the step's queries (unit
            stride on ``head_dim``), RoPE tables (:func:`~dmc.ops.rope.rope_tables`, ``[batch,
            1, head_dim]`` float32) and :class:`~dmc.inference.kernels.EvictionChannel`: the
            eviction read from the queries (``evict`` then None), the queries rotated as
            :func:`~.decode_rope.decode_rope` rotates them (returned, float32), and ``keys``
            pre-RoPE, rotated by the same tables; None: ``evict`` given, ``keys`` rotated.
    """
    batch, heads = keys.shape[:2]
    head_dim = k_pages.shape[-1]
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    query = query_operands(query, batch, heads, head_dim, "dms_write", "evict",
                           evict is not None)
    _dms_write_kernel[(batch, heads)](
        k_pages, v_pages, block_tables, lengths, ring_k, ring_v, ring_evict.view(torch.uint8),
        rows, positions, keys, values,
        None if evict is None else evict.to(torch.uint8).contiguous(),
        unread_counter(k_pages.device) if faults is None else faults,
        layer, block_tables.shape[1], block_tables.shape[-1], k_pages.shape[0],
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        query.q, query.cos, query.sin, query.out, *query.strides,
        0.0 if query.channel is None else query.channel.c,
        0.0 if query.channel is None else query.channel.scale,
        HEADS=heads, DIM=head_dim, DIM_BLOCK=triton.next_power_of_2(head_dim),
        PAGE_SIZE=k_pages.shape[1], RING=ring_k.shape[3], QUERY=query.q is not None,
        GROUP=query.group, GROUP_BLOCK=triton.next_power_of_2(query.group),
        HALF_BLOCK=triton.next_power_of_2(head_dim // 2),
    )
    return query.out
