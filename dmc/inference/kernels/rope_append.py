"""Triton vanilla decode write: RoPE of a step's keys and queries and the keys' and values' store
into their reserved page slots, in one launch per layer (the PyTorch path it replaces, and the
oracle: :func:`dmc.ops.rope.rotate` of the queries and of the keys, then an indexed store of
each pool, five launches).

One program per (row, KV head): the group's query heads rotated into a float32 output, the key
rotated and stored with its value at the head's reserved ``(page, offset)`` in the pools' dtype,
each vector in halves (rotate-half RoPE needs no shuffle: ``out_lo = x_lo cos - x_hi sin``,
``out_hi = x_hi cos + x_lo sin``). A reserved page outside the pool is not written and is
counted in the fault counter (:mod:`.faults`) with its (sequence slot, layer, KV head), as
the DMC and DMS writes count theirs. Import this module only
after ``TRITON_INTERPRET`` is settled.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_rope import _load_group, _rotate_half, _store_group, step_tables
from .faults import unread_counter


@triton.jit
def _rope_append_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out, k_pages, v_pages,
                        pages_ptr, offsets_ptr, faults, num_pages, rows_ptr, layer, num_layers,
                        stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                        stride_cb, stride_pb, stride_ph,
                        GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr, HALF: tl.constexpr,
                        HALF_BLOCK: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Every load before every store (a store ahead of a load keeps the compiler from issuing
    the load early: it cannot tell that they do not alias)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_lo, q_hi, cos, sin, rows, cols, q_mask = _load_group(
        q_ptr, cos_ptr, sin_ptr, b, h, stride_qb, stride_qh, stride_cb, GROUP, GROUP_BLOCK, HALF,
        HALF_BLOCK)
    q_lo, q_hi = _rotate_half(q_lo, q_hi, cos, sin)
    row_mask = (cols < HALF)[None, :]  # the key and value as one row, [1, HALF_BLOCK]
    k_row = k_ptr + b * stride_kb + h * stride_kh + cols[None, :]
    k_lo, k_hi = _rotate_half(tl.load(k_row, mask=row_mask, other=0.0).to(tl.float32),
                              tl.load(k_row + HALF, mask=row_mask, other=0.0).to(tl.float32),
                              cos, sin)
    v_row = v_ptr + b * stride_vb + h * stride_vh + cols[None, :]
    v_lo = tl.load(v_row, mask=row_mask, other=0.0)
    v_hi = tl.load(v_row + HALF, mask=row_mask, other=0.0)
    page = tl.load(pages_ptr + b * stride_pb + h * stride_ph).to(tl.int64)
    offset = tl.load(offsets_ptr + b * stride_pb + h * stride_ph).to(tl.int64)
    seq = tl.load(rows_ptr + b).to(tl.int64)

    _store_group(q_out, q_lo, q_hi, b, h, rows, cols, q_mask, GROUP, HALF)
    outside = (page < 0) | (page >= num_pages)  # not a page of the pool: not written, counted
    tl.atomic_add(faults, 1, mask=outside)
    tl.atomic_max(faults + 1, (seq * num_layers + layer) * tl.num_programs(1) + h, mask=outside)
    pages = page + tl.zeros([1, HALF_BLOCK], dtype=tl.int64)  # a row (the interpreter's masks)
    store = row_mask & (pages >= 0) & (pages < num_pages)
    dst = k_pages + (page * PAGE_SIZE + offset) * (2 * HALF) + cols[None, :]
    out_ty = k_pages.dtype.element_ty
    tl.store(dst, k_lo.to(out_ty), mask=store)
    tl.store(dst + HALF, k_hi.to(out_ty), mask=store)
    v_dst = v_pages + (page * PAGE_SIZE + offset) * (2 * HALF) + cols[None, :]
    tl.store(v_dst, v_lo.to(out_ty), mask=store)
    tl.store(v_dst + HALF, v_hi.to(out_ty), mask=store)


def rope_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                pages: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor, layer: int,
                num_layers: int, faults: torch.Tensor | None = None) -> torch.Tensor:
    """A vanilla decode step's write of one layer; returns the rotated queries.

    Args:
        q: ``[batch, q_heads, dim]``; k, v: ``[batch, kv_heads, dim]`` (pre-RoPE keys; each
            with a unit stride on ``dim``, any dtype).
        cos, sin: the step's tables of :func:`~dmc.ops.rope.rope_tables` (``[batch, 1, dim]``
            float32).
        k_pages, v_pages: ``[num_pages, page_size, dim]`` pools (contiguous).
        pages, offsets: ``[batch, kv_heads]`` integer tensors (any strides, equal): each
            head's reserved slot.
        rows, layer, num_layers: the sequences' cache rows ``[batch]`` (device), the layer
            and the model's layer count: where a fault is located.
        faults: a fault counter; None: one nobody reads.

    Returns:
        ``[batch, q_heads, dim]`` float32: the queries rotated (:func:`~dmc.ops.rope.rotate`).
    """
    batch, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    if q_heads % kv_heads or dim % 2 or pages.stride() != offsets.stride():
        raise ValueError(f"rope_append: {q_heads} query heads of dim {dim} for {kv_heads} KV "
                         f"heads, page strides {pages.stride()} and {offsets.stride()}: need "
                         f"whole groups of rotate-half pairs and equal strides")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cos, sin = step_tables(cos, sin, batch, dim)
    q_rot = torch.empty(batch, q_heads, dim, dtype=torch.float32, device=q.device)
    group = q_heads // kv_heads
    _rope_append_kernel[(batch, kv_heads)](
        q, k, v, cos, sin, q_rot, k_pages, v_pages, pages, offsets,
        unread_counter(q.device) if faults is None else faults, k_pages.shape[0], rows, layer,
        num_layers,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), pages.stride(0), pages.stride(1),
        GROUP=group, GROUP_BLOCK=triton.next_power_of_2(group), HALF=dim // 2,
        HALF_BLOCK=triton.next_power_of_2(dim // 2), PAGE_SIZE=k_pages.shape[1],
    )
    return q_rot
