"""Triton DMC append/merge write (Algorithm 1, Eq. 9); semantics in
:func:`dmc.inference.kernels.reference.dmc_write_reference`.

One program per (sequence, KV head). Head dimensions are handled as two halves so rotate-half
RoPE needs no register shuffle: ``out_lo = m_lo cos - m_hi sin``, ``out_hi = m_hi cos + m_lo sin``.
Import this module only after ``TRITON_INTERPRET`` is settled (the dispatcher imports it lazily).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dmc.ops.algorithm1 import KeyDecision
from dmc.ops.decisions import OMEGA_MIN

from .decode_rope import (
    _dmc_query_rope,
    _load_group,
    _rotate_half,
    _store_group,
    query_operands,
)
from .faults import unread_counter
from .tuning import tuning_for


@triton.jit
def _load_half(row_ptr, cols, col_mask, zero_col):
    """``row[cols]`` as float32, column ``zero_col`` zeroed (-1: none)."""
    x = tl.load(row_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    return tl.where(cols == zero_col, 0.0, x)


@triton.jit
def _ring_half(buf_ptr, rows, reads, cols, col_mask, DIM: tl.constexpr):
    """The rows ``reads`` of the ring ``buf [WINDOW, DIM]`` over columns ``cols``, float32, the
    others 0 without being read (stale rows' values never propagate)."""
    return tl.load(buf_ptr + rows[:, None] * DIM + cols[None, :],
                   mask=reads[:, None] & col_mask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _window_mean(buf, x, rows, ring, weights, total, append):
    """The weighted mean of the ring's rows ``buf`` (0 outside the slot's tokens) with ``x`` in
    row ``ring`` (float32); ``x`` itself where the token opens a slot."""
    buf = tl.where(rows[:, None] == ring, x[None, :], buf)
    mean = tl.sum(weights[:, None] * buf, axis=0) / total
    return tl.where(append, x, mean)


@triton.jit
def _load_token(k_row, v_row, omega_ptr, q_ptr, cos_ptr, sin_ptr, b, h, stride_qb, stride_qh,
                stride_cb, omega_c, omega_offset, omega_min, cols, col_mask, key_col,
                HEADS: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
                GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr, QUERY: tl.constexpr):
    """A decode write's token of row ``b``, KV head ``h``: its key's and value's float32 halves
    (column ``key_col`` of the key zeroed, -1: none) and importance, given (``omega_ptr``) or,
    with ``QUERY``, read from its KV group's queries, which are rotated by the step's tables
    (:func:`~.decode_rope._dmc_query_rope`): ``(k_lo, k_hi, v_lo, v_hi, omega, q_lo, q_hi,
    q_rows, q_cols, q_mask)``, the last five for :func:`~.decode_rope._store_group` (the key's
    halves in their place without ``QUERY``)."""
    k_lo = _load_half(k_row, cols, col_mask, key_col)
    k_hi = _load_half(k_row, cols + HALF, col_mask, key_col)
    v_lo = _load_half(v_row, cols, col_mask, -1)
    v_hi = _load_half(v_row, cols + HALF, col_mask, -1)
    if QUERY:
        q_lo, q_hi, q_cos, q_sin, q_rows, q_cols, q_mask = _load_group(
            q_ptr, cos_ptr, sin_ptr, b, h, stride_qb, stride_qh, stride_cb, GROUP, GROUP_BLOCK,
            HALF, HALF_BLOCK)
        omega, q_lo, q_hi = _dmc_query_rope(q_lo, q_hi, q_cos, q_sin, q_mask, q_cols, omega_c,
                                            omega_offset, omega_min, q_ptr, GROUP, HALF)
    else:
        omega = tl.load(omega_ptr + b * HEADS + h).to(tl.float32)
        q_lo, q_hi, q_rows, q_cols, q_mask = k_lo, k_hi, cols, cols, col_mask
    return k_lo, k_hi, v_lo, v_hi, omega, q_lo, q_hi, q_rows, q_cols, q_mask


@triton.jit
def _write_slot(
    k_pages, v_pages, tables, open_k, open_v, open_omega, open_count, faults, head, k_lo, k_hi,
    v_lo, v_hi, omega, append, slot, position, inv_freq, cols, col_mask, active, max_pages,
    num_pages, DIM: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
    PAGE_SIZE: tl.constexpr, WINDOW: tl.constexpr, ROWS: tl.constexpr,
):
    """Algorithm 1's write (lines 4-12, Eq. 9 with hard alpha) of one token into the flat
    (sequence, layer, KV head) ``head``: its pre-RoPE halves ``k_lo, k_hi, v_lo, v_hi``
    (float32), importance ``omega``, ``append`` (opens slot ``slot``, else merges into it) and
    ``position``; where ``active`` is false nothing is stored.

    Every load first, then the arithmetic, then every store: a store ahead of a load keeps
    the load from being issued before it (the compiler cannot tell that they do not alias),
    and each address here is read before it is written, as Algorithm 1 orders them. A barrier
    between the two makes that hold across lanes too: with several warps a scalar (the token
    count), an element two lanes hold or a value another lane loaded for a layout conversion
    (the caller's loads included: the ring row delayed merging overwrites) is stored by one
    lane while another may not have read it yet (one warp, the H100's tuning: free).

    Of the ring only the rows of the open slot's earlier tokens are read (none where the token
    opens a slot): at CR 4 about a quarter of the ring's bytes, which were most of the write's
    traffic when every row was loaded and the unfilled ones selected away."""
    open_tokens = tl.load(open_count + head)
    column = slot // PAGE_SIZE
    page = tl.load(tables + head * max_pages + column, mask=column < max_pages,
                   other=-1).to(tl.int64)
    if WINDOW == 0:
        mean_k = open_k + head * DIM
        mean_v = open_v + head * DIM
        old_z = tl.load(open_omega + head)
        old_k_lo = tl.load(mean_k + cols, mask=col_mask, other=0.0)
        old_k_hi = tl.load(mean_k + HALF + cols, mask=col_mask, other=0.0)
        old_v_lo = tl.load(mean_v + cols, mask=col_mask, other=0.0)
        old_v_hi = tl.load(mean_v + HALF + cols, mask=col_mask, other=0.0)
    count = tl.where(append, 0, open_tokens)
    if WINDOW != 0:
        rows = tl.arange(0, ROWS)
        ring = count % WINDOW
        filled = rows < tl.minimum(count + 1, WINDOW)  # the rows of the slot's tokens
        reads = filled & (rows != ring)  # the slot's earlier tokens: none where it opens
        old = tl.load(open_omega + head * WINDOW + rows, mask=reads, other=0.0)
        buf_k = open_k + head * WINDOW * DIM
        buf_v = open_v + head * WINDOW * DIM
        ring_k_lo = _ring_half(buf_k, rows, reads, cols, col_mask, DIM)
        ring_k_hi = _ring_half(buf_k, rows, reads, cols + HALF, col_mask, DIM)
        ring_v_lo = _ring_half(buf_v, rows, reads, cols, col_mask, DIM)
        ring_v_hi = _ring_half(buf_v, rows, reads, cols + HALF, col_mask, DIM)

    if WINDOW == 0:  # the running mean (z m + omega x) / z_new of each half
        z = tl.where(append, 0.0, old_z)
        z_new = z + omega
        mean_k_lo = tl.where(append, k_lo, (z * old_k_lo + omega * k_lo) / z_new)
        mean_k_hi = tl.where(append, k_hi, (z * old_k_hi + omega * k_hi) / z_new)
        mean_v_lo = tl.where(append, v_lo, (z * old_v_lo + omega * v_lo) / z_new)
        mean_v_hi = tl.where(append, v_hi, (z * old_v_hi + omega * v_hi) / z_new)
    else:
        weights = tl.where(rows == ring, omega, old)  # 0 outside the slot's tokens
        total = tl.sum(weights, axis=0)
        mean_k_lo = _window_mean(ring_k_lo, k_lo, rows, ring, weights, total, append)
        mean_k_hi = _window_mean(ring_k_hi, k_hi, rows, ring, weights, total, append)
        mean_v_lo = _window_mean(ring_v_lo, v_lo, rows, ring, weights, total, append)
        mean_v_hi = _window_mean(ring_v_hi, v_hi, rows, ring, weights, total, append)
    angle = position * inv_freq
    cos = tl.cos(angle)
    sin = tl.sin(angle)

    stored = col_mask & ((tl.zeros([HALF_BLOCK], dtype=tl.int32) + active.to(tl.int32)) != 0)
    tl.debug_barrier()  # every lane's loads done before any lane stores (see the docstring)
    tl.store(open_count + head, count + 1, mask=active)
    if WINDOW == 0:
        tl.store(open_omega + head, z_new, mask=active)
        tl.store(mean_k + cols, mean_k_lo, mask=stored)
        tl.store(mean_k + HALF + cols, mean_k_hi, mask=stored)
        tl.store(mean_v + cols, mean_v_lo, mask=stored)
        tl.store(mean_v + HALF + cols, mean_v_hi, mask=stored)
    else:  # the token into its ring row, in the ring's dtype (float32 or the token's own)
        tl.store(open_omega + head * WINDOW + ring, omega, mask=active)
        ring_ty = buf_k.dtype.element_ty
        tl.store(buf_k + ring * DIM + cols, k_lo.to(ring_ty), mask=stored)
        tl.store(buf_k + ring * DIM + HALF + cols, k_hi.to(ring_ty), mask=stored)
        tl.store(buf_v + ring * DIM + cols, v_lo.to(ring_ty), mask=stored)
        tl.store(buf_v + ring * DIM + HALF + cols, v_hi.to(ring_ty), mask=stored)
    outside = ((page < 0) | (page >= num_pages)) & active  # not a page of the pool: counted
    tl.atomic_add(faults, 1, mask=outside)
    tl.atomic_max(faults + 1, head, mask=outside)
    pages = page + tl.zeros([HALF_BLOCK], dtype=tl.int64)  # a vector (the interpreter's masks)
    store = stored & (pages >= 0) & (pages < num_pages)
    dst = (page * PAGE_SIZE + slot % PAGE_SIZE) * DIM
    out_ty = k_pages.dtype.element_ty
    rotated_lo, rotated_hi = _rotate_half(mean_k_lo, mean_k_hi, cos, sin)
    tl.store(k_pages + dst + cols, rotated_lo.to(out_ty), mask=store)
    tl.store(k_pages + dst + HALF + cols, rotated_hi.to(out_ty), mask=store)
    tl.store(v_pages + dst + cols, mean_v_lo.to(out_ty), mask=store)
    tl.store(v_pages + dst + HALF + cols, mean_v_hi.to(out_ty), mask=store)


@triton.jit
def _dmc_write_kernel(
    k_pages, v_pages, tables, open_k, open_v, open_omega, open_count,
    seq_ptr, slot_ptr, append_ptr, k_ptr, v_ptr, omega_ptr, pos_ptr, inv_freq_ptr, faults,
    lengths_ptr, alpha_ptr, key_c,
    layer, num_layers, max_pages, num_pages,
    stride_kb, stride_kh, stride_vb, stride_vh,
    q_ptr, cos_ptr, sin_ptr, q_out, stride_qb, stride_qh, stride_cb, omega_c, omega_offset,
    omega_min,
    HEADS: tl.constexpr, DIM: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
    PAGE_SIZE: tl.constexpr, WINDOW: tl.constexpr, ROWS: tl.constexpr, DECIDE: tl.constexpr,
    KEY_DECIDES: tl.constexpr, GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr,
    QUERY: tl.constexpr,
):
    """The token's loads and Algorithm 1's decision, then :func:`_write_slot`.

    ``QUERY``: the program also rotates its KV group's decode queries (``q_ptr``, by the
    step's tables ``cos_ptr, sin_ptr``, into ``q_out``) and reads the token's importance from
    their decision channel, as :func:`~.decode_rope.decode_rope` does in its own launch."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(seq_ptr + b).to(tl.int64)
    head = (seq * num_layers + layer) * HEADS + h  # flat (seq, layer, head) of the state tensors
    bh = b * HEADS + h
    k_row = k_ptr + b * stride_kb + h * stride_kh
    v_row = v_ptr + b * stride_vb + h * stride_vh
    key_col = DIM - 1 if KEY_DECIDES else -1  # the key's decision channel, zeroed when read
    cols = tl.arange(0, HALF_BLOCK)
    col_mask = cols < HALF
    k_lo, k_hi, v_lo, v_hi, omega, q_lo, q_hi, q_rows, q_cols, q_mask = _load_token(
        k_row, v_row, omega_ptr, q_ptr, cos_ptr, sin_ptr, b, h, stride_qb, stride_qh, stride_cb,
        omega_c, omega_offset, omega_min, cols, col_mask, key_col, HEADS, HALF, HALF_BLOCK,
        GROUP, GROUP_BLOCK, QUERY)
    position = tl.load(pos_ptr + b).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + cols, mask=col_mask, other=0.0)
    if DECIDE:  # Algorithm 1's test on the device: append if alpha <= 0.5 or the head is empty
        current = tl.load(lengths_ptr + head)
        if KEY_DECIDES:  # alpha = [k[-1] - c > 0] (hard_decisions)
            append = (tl.load(k_row + DIM - 1).to(tl.float32) - key_c > 0) == 0
        else:
            append = tl.load(alpha_ptr + bh).to(tl.float32) <= 0.5
        append = append | (current == 0)
        new_length = current + append.to(current.dtype)
        slot = new_length - 1
    else:
        append = tl.load(append_ptr + bh) != 0
        slot = tl.load(slot_ptr + bh)
    _write_slot(k_pages, v_pages, tables, open_k, open_v, open_omega, open_count, faults, head,
                k_lo, k_hi, v_lo, v_hi, omega, append, slot, position, inv_freq, cols, col_mask,
                tl.full([], 1, tl.int1), max_pages, num_pages, DIM, HALF, HALF_BLOCK, PAGE_SIZE,
                WINDOW, ROWS)
    if QUERY:
        _store_group(q_out, q_lo, q_hi, b, h, q_rows, q_cols, q_mask, GROUP, HALF)
    if DECIDE:
        tl.store(lengths_ptr + head, new_length)


def dmc_write(k_pages, v_pages, block_tables, open_k, open_v, open_omega, open_count, inv_freq,
              window, layer, seq_slots, slots, append, k, v, omega, positions,
              faults=None, decide=None, num_warps: int | None = None,
              query=None) -> torch.Tensor | None:
    """Triton :func:`~dmc.inference.kernels.reference.dmc_write_reference` (same arguments).

    Pages, block tables and open-slot state must be contiguous (as the cache builds them); ``k``,
    ``v`` ``[batch, kv_heads, head_dim]`` need a unit stride on the last dimension. A slot whose
    block-table entry is not a page of the pool is not written; ``faults`` (a
    :func:`~dmc.inference.kernels.faults.fault_counter`; None: one nobody reads) counts it and
    locates one. ``decide``: ``(lengths [seqs, layers, kv_heads] int32, alpha [batch, kv_heads])``
    on the device, to take Algorithm 1's decision in the kernel (append where ``alpha <= 0.5``
    or the head is empty; ``slots`` and ``append`` then None) and advance ``lengths``: the
    deferred write of a decode step, one launch where the decision took a dozen small ops;
    ``alpha`` a :class:`~dmc.ops.algorithm1.KeyDecision`: ``k`` still holds the decision
    channel, which the kernel reads (``alpha = [k[..., -1] - c > 0]``) and zeroes.
    ``num_warps``: warps per (sequence, KV head) program (tuning only; ``benchmarks/
    write_kernel.py`` times each); ``None``: the device's measured setting
    (:func:`~dmc.inference.kernels.tuning.tuning_for`). ``query``: ``(q [batch, q_heads, dim],
    cos, sin, channel)``, a decode step's queries (unit stride on ``dim``), its RoPE tables
    (:func:`~dmc.ops.rope.rope_tables`, ``[batch, 1, dim]`` float32) and a
    :class:`~dmc.inference.kernels.DecisionChannel`: the importance is read from the queries
    in the same launch (``omega`` then None) and the queries rotated as
    :func:`~.decode_rope.decode_rope` rotates them, which this returns (float32); None
    otherwise.
    """
    lengths, alpha = decide if decide is not None else (None, None)
    num_warps = num_warps or tuning_for(k_pages.device).write_warps
    key_c = alpha.c if isinstance(alpha, KeyDecision) else None
    if key_c is not None:
        alpha = None
    elif alpha is not None:
        alpha = (alpha.view(torch.uint8) if alpha.dtype == torch.bool else alpha).contiguous()
    batch, heads = k.shape[:2]
    head_dim = k_pages.shape[-1]
    half = head_dim // 2
    window = window or 0
    if faults is None:
        faults = unread_counter(k_pages.device)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    query = query_operands(query, batch, heads, head_dim, "dmc_write", "omega",
                           omega is not None)
    _dmc_write_kernel[(batch, heads)](
        k_pages, v_pages, block_tables, open_k, open_v, open_omega, open_count,
        seq_slots, *((None, None) if decide is not None else
                     (slots.to(torch.int32).contiguous(), append.to(torch.int32).contiguous())),
        k, v, None if omega is None else omega.contiguous(), positions, inv_freq, faults,
        lengths, alpha, 0.0 if key_c is None else key_c, layer, block_tables.shape[1],
        block_tables.shape[-1], k_pages.shape[0],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        query.q, query.cos, query.sin, query.out, *query.strides,
        0.0 if query.channel is None else query.channel.c,
        0.0 if query.channel is None else query.channel.offset, OMEGA_MIN,
        HEADS=heads, DIM=head_dim, HALF=half, HALF_BLOCK=triton.next_power_of_2(half),
        PAGE_SIZE=k_pages.shape[1], WINDOW=window, ROWS=triton.next_power_of_2(max(window, 1)),
        DECIDE=decide is not None, KEY_DECIDES=key_c is not None, GROUP=query.group,
        GROUP_BLOCK=triton.next_power_of_2(query.group), QUERY=query.q is not None,
        num_warps=num_warps,
    )
    return query.out
