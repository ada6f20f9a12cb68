"""Triton decode write of DMC with delayed merging (``dmc.merge_delay`` = d, ring of ``R = d + 1``
raw tokens; not in the paper), one launch per layer: the semantics of
:meth:`dmc.inference.delayed_cache.DelayedMergeCache.write`'s PyTorch path (which stays the
oracle), where that path runs some fifty small ops per layer (the decision split off the key,
ring indices, gathers of the leaving token, its rotation back, Algorithm 1's write, the new
token's rotation, four indexed stores) that a CUDA graph replays as as many launches.

One program per (sequence, KV head), the step's token at position ``p``:

1. the token's decision given or read from its key (``alpha = [k[-1] - c > 0]``, the channel
   zeroed), its importance given or read from its KV group's queries (which it then rotates, as
   :func:`~.decode_rope.decode_rope` does in a launch of its own);
2. where ``p >= R``, token ``p - R`` leaves ring row ``p mod R``: its key rotated back by
   ``-(p - R)`` (RoPE is orthogonal), it goes through Algorithm 1 with its own decisions
   (:func:`~.dmc_write._write_slot`: appended or merged, the length advanced on the device);
3. token ``p`` (key rotated at ``p``, value, decisions) into ring row ``p mod R``.

The leaving row is read, by every lane that holds a part of it, before any lane overwrites it
with the new token (the barrier of :func:`~.dmc_write._write_slot`, after every load). Import
this module only after ``TRITON_INTERPRET`` is settled (the cache imports it lazily).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dmc.ops.algorithm1 import KeyDecision
from dmc.ops.decisions import OMEGA_MIN

from .decode_rope import _rotate_half, _store_group, query_operands
from .dmc_write import _load_half, _load_token, _write_slot
from .faults import unread_counter
from .tuning import tuning_for


@triton.jit
def _delayed_write_kernel(
    k_pages, v_pages, tables, open_k, open_v, open_omega, open_count, lengths,
    ring_k, ring_v, ring_alpha, ring_omega,
    seq_ptr, pos_ptr, k_ptr, v_ptr, omega_ptr, alpha_ptr, inv_freq_ptr, faults, key_c,
    layer, num_layers, max_pages, num_pages,
    stride_kb, stride_kh, stride_vb, stride_vh,
    q_ptr, cos_ptr, sin_ptr, q_out, stride_qb, stride_qh, stride_cb, omega_c, omega_offset,
    omega_min,
    HEADS: tl.constexpr, DIM: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
    PAGE_SIZE: tl.constexpr, WINDOW: tl.constexpr, ROWS: tl.constexpr, RING: tl.constexpr,
    GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr, QUERY: tl.constexpr,
    KEY_DECIDES: tl.constexpr,
):
    """Loads (the step's token, its queries, the leaving ring row, the head's length), then
    :func:`_write_slot` for the leaving token, then the ring row and the rotated queries."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(seq_ptr + b).to(tl.int64)
    head = (seq * num_layers + layer) * HEADS + h  # flat (seq, layer, head) of the state tensors
    p = tl.load(pos_ptr + b).to(tl.int64)
    ring_row = head * RING + p % RING  # token p - R's row, token p's after this step
    cols = tl.arange(0, HALF_BLOCK)
    col_mask = cols < HALF
    k_row = k_ptr + b * stride_kb + h * stride_kh
    v_row = v_ptr + b * stride_vb + h * stride_vh
    if KEY_DECIDES:  # alpha = [k[-1] - c > 0], the channel zeroed when read
        alpha = (tl.load(k_row + DIM - 1).to(tl.float32) - key_c > 0).to(tl.float32)
    else:
        alpha = tl.load(alpha_ptr + b * HEADS + h).to(tl.float32)
    k_lo, k_hi, v_lo, v_hi, omega, q_lo, q_hi, q_rows, q_cols, q_mask = _load_token(
        k_row, v_row, omega_ptr, q_ptr, cos_ptr, sin_ptr, b, h, stride_qb, stride_qh, stride_cb,
        omega_c, omega_offset, omega_min, cols, col_mask, DIM - 1 if KEY_DECIDES else -1, HEADS,
        HALF, HALF_BLOCK, GROUP, GROUP_BLOCK, QUERY)
    leaving = p >= RING
    out_k_lo = _load_half(ring_k + ring_row * DIM, cols, col_mask, -1)  # token p - R
    out_k_hi = _load_half(ring_k + ring_row * DIM, cols + HALF, col_mask, -1)
    out_v_lo = _load_half(ring_v + ring_row * DIM, cols, col_mask, -1)
    out_v_hi = _load_half(ring_v + ring_row * DIM, cols + HALF, col_mask, -1)
    out_alpha = tl.load(ring_alpha + ring_row)
    out_omega = tl.load(ring_omega + ring_row)
    current = tl.load(lengths + head)
    inv_freq = tl.load(inv_freq_ptr + cols, mask=col_mask, other=0.0)

    token = (p - RING).to(tl.float32)
    back = token * inv_freq  # rotated back: the angle's sine negated
    out_k_lo, out_k_hi = _rotate_half(out_k_lo, out_k_hi, tl.cos(back), -tl.sin(back))
    append = (out_alpha <= 0.5) | (current == 0)  # Algorithm 1's test
    new_length = current + append.to(current.dtype)
    _write_slot(k_pages, v_pages, tables, open_k, open_v, open_omega, open_count, faults, head,
                out_k_lo, out_k_hi, out_v_lo, out_v_hi, out_omega, append, new_length - 1,
                token, inv_freq, cols, col_mask, leaving, max_pages, num_pages, DIM, HALF,
                HALF_BLOCK, PAGE_SIZE, WINDOW, ROWS)
    tl.store(lengths + head, new_length, mask=leaving)
    angle = p.to(tl.float32) * inv_freq
    k_lo, k_hi = _rotate_half(k_lo, k_hi, tl.cos(angle), tl.sin(angle))
    ring_ty = ring_k.dtype.element_ty
    tl.store(ring_k + ring_row * DIM + cols, k_lo.to(ring_ty), mask=col_mask)
    tl.store(ring_k + ring_row * DIM + HALF + cols, k_hi.to(ring_ty), mask=col_mask)
    tl.store(ring_v + ring_row * DIM + cols, v_lo.to(ring_ty), mask=col_mask)
    tl.store(ring_v + ring_row * DIM + HALF + cols, v_hi.to(ring_ty), mask=col_mask)
    tl.store(ring_alpha + ring_row, alpha)
    tl.store(ring_omega + ring_row, omega)
    if QUERY:
        _store_group(q_out, q_lo, q_hi, b, h, q_rows, q_cols, q_mask, GROUP, HALF)


def delayed_write(k_pages, v_pages, block_tables, lengths, open_k, open_v, open_omega,
                  open_count, ring_k, ring_v, ring_alpha, ring_omega, inv_freq, window,
                  layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, omega: torch.Tensor | None, alpha, faults=None,
                  num_warps: int | None = None, query=None) -> torch.Tensor | None:
    """The decode write of one layer (module docstring), in place.

    Args:
        k_pages, v_pages, block_tables, lengths, open_k, open_v, open_omega, open_count,
            inv_freq, window: the cache's pools and Algorithm 1 state (as
            :func:`~.dmc_write.dmc_write`; ``lengths [rows, layers, kv_heads]`` int32 on the
            device, advanced where a leaving token opens a slot).
        ring_k, ring_v: ``[rows, layers, kv_heads, R, head_dim]`` the raw tokens (keys rotated
            at their positions); ring_alpha, ring_omega: ``[rows, layers, kv_heads, R]``
            float32, their decisions.
        layer: the layer; rows: ``[batch]`` the sequences' cache rows (device ints).
        positions: ``[batch]`` the tokens' positions p (device ints).
        k, v: ``[batch, kv_heads, head_dim]`` the step's pre-RoPE keys and values (unit
            stride on the last dimension).
        omega: ``[batch, kv_heads]`` the importance, or None with ``query``.
        alpha: ``[batch, kv_heads]`` the hard decisions (1 = merge), or a
            :class:`~dmc.ops.algorithm1.KeyDecision`: read from the keys' last channel, which
            is zeroed (``alpha = [k[..., -1] - c > 0]``).
        faults: a fault counter (:func:`~.faults.fault_counter`; None: one nobody reads).
        num_warps: warps per program; None: the device's measured setting for the DMC write.
        query: ``(q [batch, q_heads, head_dim], cos, sin, channel)`` as
            :func:`~.dmc_write.dmc_write` takes it: the importance read from the queries and
            the queries rotated (returned, float32); None: ``omega`` given, returns None.
    """
    batch, heads = k.shape[:2]
    head_dim = k_pages.shape[-1]
    window = window or 0
    key_c = alpha.c if isinstance(alpha, KeyDecision) else None
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    query = query_operands(query, batch, heads, head_dim, "delayed_write", "omega",
                           omega is not None)
    _delayed_write_kernel[(batch, heads)](
        k_pages, v_pages, block_tables, open_k, open_v, open_omega, open_count, lengths,
        ring_k, ring_v, ring_alpha, ring_omega, rows, positions, k, v,
        None if omega is None else omega.float().contiguous(),
        None if key_c is not None else alpha.float().contiguous(), inv_freq,
        unread_counter(k_pages.device) if faults is None else faults,
        0.0 if key_c is None else key_c,
        layer, block_tables.shape[1], block_tables.shape[-1], k_pages.shape[0],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        query.q, query.cos, query.sin, query.out, *query.strides,
        0.0 if query.channel is None else query.channel.c,
        0.0 if query.channel is None else query.channel.offset, OMEGA_MIN,
        HEADS=heads, DIM=head_dim, HALF=head_dim // 2,
        HALF_BLOCK=triton.next_power_of_2(head_dim // 2), PAGE_SIZE=k_pages.shape[1],
        WINDOW=window, ROWS=triton.next_power_of_2(max(window, 1)), RING=ring_k.shape[3],
        GROUP=query.group, GROUP_BLOCK=triton.next_power_of_2(query.group),
        QUERY=query.q is not None, KEY_DECIDES=key_c is not None,
        num_warps=num_warps or tuning_for(k_pages.device).write_warps,
    )
    return query.out
