"""Triton paged decode attention with GQA and split-K; semantics in
:func:`dmc.inference.kernels.reference.paged_decode_reference`.

One program per (sequence, KV head, split) serves the ``G = q_heads / kv_heads`` query heads of
the group, so each cached K/V page is read once per group. Each split runs an online softmax
(base 2) over its chunk of slots, the scores ``q K^T`` and the update ``P V`` as ``tl.dot`` on
tensor cores (the group padded to 16 rows, the probabilities cast to the cache's dtype for
``P V`` as FlashAttention does; float32 caches keep IEEE float32 products), the softmax state
in float32; with several splits a second kernel combines the partial maxima, sums and outputs.
Keys outside the pages (a DMS window ring: ``ring=``) are one more part, computed by the same
kernel in its ring mode, which reads each sequence's ring rows in place (one more launch).
Import this module only after ``TRITON_INTERPRET`` is settled (the dispatcher imports it lazily;
the interpreter computes its dots in float32, which numpy lacks bf16 for).
"""
from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from .faults import unread_counter
from .tuning import tuning_for

_LOG2E = 1.4426950408889634
_EMPTY = tl.constexpr(-1.0e30)  # running max before any slot: exp2(_EMPTY - m) == 0 for finite m
_WAVES = 4  # programs per multiprocessor the split heuristic aims at
_MIN_BLOCKS_PER_SPLIT = 2
_MAX_SPLITS = 32
_DOT_MIN = 16  # tl.dot needs every dimension >= 16


@triton.jit
def _decode_split_kernel(
    q_ptr, k_pages, v_pages, tables, lengths, out_ptr, part_max, part_sum, faults,
    ring_k, ring_v, ring_rows, ring_count,
    scale_log2, blocks_per_split, parts, num_pages, table_width,
    stride_qb, stride_qh, stride_kp, stride_kt, stride_vp, stride_vt,
    stride_tb, stride_th, stride_lb, stride_lh, stride_ob, stride_oh,
    stride_rb, stride_rh, stride_rn,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr,
    DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, RING_MODE: tl.constexpr,
):
    """One part of one (sequence, KV head): a split of its paged slots, or in ``RING_MODE`` its
    ring rows ``0 .. ring_count[b] - 1`` of ring ``ring_rows[b]`` (the last part)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // KV_HEADS
    kh = pid % KV_HEADS
    if RING_MODE:
        lo = 0
        hi = tl.load(ring_count + b).to(tl.int32)
        ring_at = tl.load(ring_rows + b).to(tl.int64) * stride_rb + kh * stride_rh
        part = parts - 1
    else:
        length = tl.load(lengths + b * stride_lb + kh * stride_lh)
        lo = split * blocks_per_split * BLOCK_N
        hi = tl.minimum(lo + blocks_per_split * BLOCK_N, length)
        part = split

    g = tl.arange(0, GROUP_BLOCK)
    d = tl.arange(0, DIM_BLOCK)
    g_mask = g < GROUP
    d_mask = d < DIM
    q_heads = kh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + q_heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32) if UPCAST else q.to(k_pages.dtype.element_ty)  # the dot's operand type
    row_max = tl.full([GROUP_BLOCK], _EMPTY, tl.float32)
    row_sum = tl.zeros([GROUP_BLOCK], tl.float32)
    acc = tl.zeros([GROUP_BLOCK, DIM_BLOCK], tl.float32)
    table = tables + b * stride_tb + kh * stride_th
    outside_count = tl.zeros([BLOCK_N], dtype=tl.int32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        if RING_MODE:
            k_rows = ring_k + ring_at + n[:, None] * stride_rn
            v_rows = ring_v + ring_at + n[:, None] * stride_rn
        else:
            column = n // PAGE_SIZE  # past the table's width: no entry, counted as outside
            page = tl.load(table + column, mask=n_mask & (column < table_width),
                           other=-1).to(tl.int64)
            outside = n_mask & ((page < 0) | (page >= num_pages))  # not a page: skipped, counted
            outside_count += outside.to(tl.int32)
            n_mask = n_mask & ~outside
            offset = n % PAGE_SIZE
            k_rows = k_pages + page[:, None] * stride_kp + offset[:, None] * stride_kt
            v_rows = v_pages + page[:, None] * stride_vp + offset[:, None] * stride_vt
        kv_mask = n_mask[:, None] & d_mask[None, :]
        keys = tl.load(k_rows + d[None, :], mask=kv_mask, other=0.0)
        values = tl.load(v_rows + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            keys = keys.to(tl.float32)
            values = values.to(tl.float32)
        scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale_log2
        scores = tl.where(n_mask[None, :], scores, float("-inf"))  # [GROUP_BLOCK, BLOCK_N]
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(values.dtype), values,
                                              input_precision=PRECISION)
        row_max = new_max

    outside_total = tl.sum(outside_count, axis=0).to(tl.int64)
    tl.atomic_add(faults, outside_total, mask=outside_total > 0)
    out_mask = g_mask[:, None] & d_mask[None, :]
    if PARTIAL:
        # max, sum: [batch, q_heads, parts]; unnormalised out: [batch, q_heads, parts, DIM]
        row = (b * KV_HEADS * GROUP + q_heads) * parts + part
        tl.store(part_max + row, row_max, mask=g_mask)
        tl.store(part_sum + row, row_sum, mask=g_mask)
        tl.store(out_ptr + row[:, None] * DIM + d[None, :], acc, mask=out_mask)
    else:
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + q_heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out, part_max, part_sum, out_ptr, parts, stride_ob, stride_oh,
    Q_HEADS: tl.constexpr, DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)  # flat (batch, q_head)
    s = tl.arange(0, SPLIT_BLOCK)
    d = tl.arange(0, DIM_BLOCK)
    s_mask = s < parts
    d_mask = d < DIM
    maxima = tl.load(part_max + pid * parts + s, mask=s_mask, other=_EMPTY)
    sums = tl.load(part_sum + pid * parts + s, mask=s_mask, other=0.0)
    outs = tl.load(part_out + (pid * parts + s)[:, None] * DIM + d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    weights = tl.exp2(maxima - tl.max(maxima, axis=0))
    total = tl.sum(weights * sums, axis=0)
    out = tl.sum(weights[:, None] * outs, axis=0) / tl.where(total > 0, total, 1.0)
    b = pid // Q_HEADS
    h = pid % Q_HEADS
    out_row = out_ptr + b * stride_ob + h * stride_oh
    tl.store(out_row + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _ring_strides(ring_k: torch.Tensor, ring_v: torch.Tensor,
                  k_pages: torch.Tensor) -> tuple[int, int, int]:
    """The (ring, KV head, row) strides the two ring pools share; ValueError where they differ,
    are not in the pages' dtype or lack a unit stride on ``head_dim``."""
    if ring_k.stride() != ring_v.stride() or ring_k.stride(-1) != 1:
        raise ValueError(f"paged_decode: ring: the K and V pools need equal strides with a unit "
                         f"stride on head_dim, got {ring_k.stride()} and {ring_v.stride()}")
    if not ring_k.dtype == ring_v.dtype == k_pages.dtype:
        raise ValueError(f"paged_decode: ring: pools in the pages' dtype {k_pages.dtype} "
                         f"expected, got {ring_k.dtype} and {ring_v.dtype}")
    return ring_k.stride(0), ring_k.stride(1), ring_k.stride(2)


@functools.cache
def _check_layout(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                  block_tables: torch.Tensor) -> None:
    """What the kernel assumes and does not check per slot (a ValueError naming the tensor):
    pools of one shape, ``head_dim`` of the queries', unit strides on ``head_dim`` and on the
    block tables' page column, and query heads a multiple of the KV heads."""
    if k_pages.shape != v_pages.shape or q.shape[-1] != k_pages.shape[-1]:
        raise ValueError(f"paged_decode: k_pages {tuple(k_pages.shape)}, v_pages "
                         f"{tuple(v_pages.shape)} and q {tuple(q.shape)} must agree on "
                         f"[pages, page_size, head_dim] and head_dim")
    strides = {"k_pages": k_pages.stride(-1), "v_pages": v_pages.stride(-1),
               "block_tables": block_tables.stride(-1)}
    if set(strides.values()) != {1}:
        raise ValueError(f"paged_decode: the last dimension must have a unit stride, got "
                         f"{strides}")
    if q.shape[1] % block_tables.shape[1]:
        raise ValueError(f"paged_decode: {q.shape[1]} query heads are not a multiple of "
                         f"{block_tables.shape[1]} KV heads")


def _multiprocessors(device_index: int | None) -> int:
    if device_index is None:  # the interpreter: a CPU tensor
        return 1
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(batch_kv_heads: int, max_length: int, block_n: int,
                       multiprocessors: int = 132) -> int:
    """Split a head's slots only when the (sequence, KV head) programs alone leave the GPU
    short of ``_WAVES`` programs per multiprocessor, each split at least
    ``_MIN_BLOCKS_PER_SPLIT`` blocks of ``block_n`` slots."""
    blocks = math.ceil(max_length / block_n)
    wanted = math.ceil(_WAVES * multiprocessors / max(batch_kv_heads, 1))
    return max(1, min(blocks // _MIN_BLOCKS_PER_SPLIT, wanted, _MAX_SPLITS))


def paged_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    max_length: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    ring: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    faults: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton paged decode; arguments and result as
    :func:`~dmc.inference.kernels.reference.paged_decode_reference`. The page pools need a
    unit stride on ``head_dim`` and the block tables on their page column.

    Args:
        num_splits: programs per (sequence, KV head) over chunks of its slots (split-K);
            ``None`` picks :func:`default_num_splits`.
        max_length: an upper bound on ``lengths`` known to the caller (saves a device sync);
            sets the chunk of slots per split. ``None`` reads ``lengths.max()``.
        block_n, num_warps, num_stages: slots per loop step (a power of two >= 16), warps per
            program and software-pipelining stages of the loop's loads (tuning only); each
            ``None`` is the device's measured setting for ``batch * kv_heads`` heads
            (:func:`~dmc.inference.kernels.tuning.tuning_for`).
        ring: keys and values outside the pages, attended under the same softmax (a DMS or
            delayed-merging window ring, :func:`~dmc.inference.kernels.dms_decode.
            dms_decode_attention`): ``(ring_k, ring_v [n, kv_heads, rows, head_dim]`` pools in
            the pages' dtype with a unit stride on ``head_dim``, ``ring_rows [batch]`` each
            sequence's ring in them, ``ring_count [batch]`` its filled rows ``0 .. count -
            1)``, read in place by one more launch of the split kernel as the last part.
        faults: a fault counter (:func:`~dmc.inference.kernels.faults.fault_counter`) counting
            the slots whose block-table entry is not a page of the pool (skipped, not read);
            None: :func:`~dmc.inference.kernels.faults.unread_counter`.
    """
    batch, q_heads, head_dim = q.shape
    kv_heads = block_tables.shape[1]
    _check_layout(q, k_pages, v_pages, block_tables)
    group = q_heads // kv_heads
    group_block = max(_DOT_MIN, triton.next_power_of_2(group))
    if max_length is None:
        max_length = int(lengths.max()) if lengths.numel() else 0
    if None in (block_n, num_warps, num_stages):
        tuned = tuning_for(q.device).decode_for(batch * kv_heads)
        block_n, num_warps, num_stages = (given or measured for given, measured in zip(
            (block_n, num_warps, num_stages), tuned.launch))
    if num_splits is None:
        num_splits = default_num_splits(batch * kv_heads, max_length, block_n,
                                        _multiprocessors(q.device.index if q.is_cuda else None))
    blocks_per_split = max(1, math.ceil(math.ceil(max_length / block_n) / num_splits))
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    partial = num_splits > 1 or ring is not None
    parts = num_splits + (ring is not None)  # the ring is the last part
    if partial:
        part_max = q.new_empty(batch, q_heads, parts, dtype=torch.float32)
        part_out = q.new_empty(batch, q_heads, parts, head_dim, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
    else:
        part_out, part_max, part_sum = out, None, None
    dim_block = max(_DOT_MIN, triton.next_power_of_2(head_dim))
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if faults is None:
        faults = unread_counter(q.device)
    ring_k, ring_v, ring_rows, ring_count = ring if ring is not None else (None,) * 4
    ring_strides = _ring_strides(ring_k, ring_v, k_pages) if ring is not None else (0, 0, 0)
    launch = dict(
        KV_HEADS=kv_heads, GROUP=group, GROUP_BLOCK=group_block, DIM=head_dim, DIM_BLOCK=dim_block,
        PAGE_SIZE=k_pages.shape[1], PARTIAL=partial,
        UPCAST=interpreted and k_pages.dtype != torch.float32,
        PRECISION="ieee" if interpreted or k_pages.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    for ring_mode in (False, True) if ring is not None else (False,):
        rows_block = block_n if not ring_mode else min(
            block_n, max(_DOT_MIN, triton.next_power_of_2(ring_k.shape[2])))
        _decode_split_kernel[(batch * kv_heads, 1 if ring_mode else num_splits)](
            q, k_pages, v_pages, block_tables, lengths, part_out, part_max, part_sum, faults,
            ring_k, ring_v, ring_rows, ring_count,
            scale * _LOG2E, blocks_per_split, parts, k_pages.shape[0], block_tables.shape[-1],
            q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1),
            v_pages.stride(0), v_pages.stride(1), block_tables.stride(0), block_tables.stride(1),
            lengths.stride(0), lengths.stride(1), out.stride(0), out.stride(1), *ring_strides,
            BLOCK_N=rows_block, RING_MODE=ring_mode, **launch,
        )
    if partial:
        _decode_reduce_kernel[(batch * q_heads,)](
            part_out, part_max, part_sum, out, parts, out.stride(0), out.stride(1),
            Q_HEADS=q_heads, DIM=head_dim, DIM_BLOCK=triton.next_power_of_2(head_dim),
            SPLIT_BLOCK=triton.next_power_of_2(parts),
        )
    return out
