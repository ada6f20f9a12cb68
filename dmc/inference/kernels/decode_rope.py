"""Triton RoPE of a decode step's query or key rows, with DMC's or DMS's decision channel where
asked: one launch per tensor and layer (the PyTorch path stays the oracle).

In PyTorch a decode layer rotated its queries in five elementwise ops (``float``, two products,
``roll``, a sum: :func:`dmc.ops.rope.rotate`) and a vanilla layer its keys in five more; a DMC
layer also read the importance from the query's last channel (Sec. 3.2: a mean over the query
group, ``+ c``, a sigmoid, ``+ offset``, the floor of :func:`dmc.ops.decisions.importance`) and
zeroed that channel before and after RoPE (two ``cat`` calls), a DMS layer its eviction logit from
each group's first head (``* scale - c``, ``> 0``) with that channel zeroed the same way: about
fifteen launches of a few microseconds each over ``[batch, heads, dim]`` per layer. Here one
program per (row, KV group) loads the group's heads once, in halves (rotate-half RoPE needs no
shuffle: ``out_lo = x_lo cos - x_hi sin``, ``out_hi = x_hi cos + x_lo sin``).

The decisions are rounded to the input's dtype after each step as PyTorch's elementwise ops
round theirs (float32 arithmetic, result in the tensor's dtype), so a bfloat16 model's omega
and evictions are :func:`dmc.ops.decisions.decision_logits`'s and
:func:`~dmc.ops.decisions.dms_alpha_logit`'s. Import this module only after
``TRITON_INTERPRET`` is settled.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dmc.ops.decisions import OMEGA_MIN

from . import DecisionChannel, EvictionChannel


@triton.jit
def _in_dtype(x, like_ptr):
    """float32 ``x`` rounded to the element type of ``like_ptr`` (as a PyTorch op's result),
    as float32. bfloat16 is rounded to nearest even by hand (finite values): the interpreter's
    cast truncates, the GPU's rounds; both now give PyTorch's bits."""
    if like_ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _rotate_half(lo, hi, cos, sin):
    """Rotate-half RoPE of float32 halves: ``(lo cos - hi sin, hi cos + lo sin)``."""
    return lo * cos - hi * sin, hi * cos + lo * sin


@triton.jit
def _load_group(x_ptr, cos_ptr, sin_ptr, b, g, stride_xb, stride_xh, stride_cb,
                GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr, HALF: tl.constexpr,
                HALF_BLOCK: tl.constexpr):
    """The ``GROUP`` rows of KV group ``g`` of decode row ``b`` as float32 halves ``lo, hi
    [GROUP_BLOCK, HALF_BLOCK]``, with row ``b``'s RoPE tables ``cos, sin [1, HALF_BLOCK]``:
    ``(lo, hi, cos, sin, rows, cols, inside)`` (``inside`` the real entries)."""
    rows = tl.arange(0, GROUP_BLOCK)
    cols = tl.arange(0, HALF_BLOCK)
    inside = (rows < GROUP)[:, None] & (cols < HALF)[None, :]
    x_row = x_ptr + b * stride_xb + (g * GROUP + rows)[:, None] * stride_xh + cols[None, :]
    lo = tl.load(x_row, mask=inside, other=0.0).to(tl.float32)
    hi = tl.load(x_row + HALF, mask=inside, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + b * stride_cb + cols, mask=cols < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + b * stride_cb + HALF + cols, mask=cols < HALF, other=0.0)[None, :]
    return lo, hi, cos, sin, rows, cols, inside


@triton.jit
def _store_group(out_ptr, lo, hi, b, g, rows, cols, inside, GROUP: tl.constexpr,
                 HALF: tl.constexpr):
    """Halves ``lo, hi`` (:func:`_load_group`'s layout) into the rows of KV group ``g`` of row
    ``b`` of the contiguous ``out [batch, groups * GROUP, 2 HALF]``, the grid's second axis
    running over the groups."""
    out_row = (out_ptr + (b * tl.num_programs(1) * GROUP + g * GROUP + rows)[:, None] * (2 * HALF)
               + cols[None, :])
    tl.store(out_row, lo, mask=inside)
    tl.store(out_row + HALF, hi, mask=inside)


@triton.jit
def _dmc_query_rope(lo, hi, cos, sin, inside, cols, c, offset, omega_min, like_ptr,
                    GROUP: tl.constexpr, HALF: tl.constexpr):
    """A DMC decode query's KV group, its rows in float32 halves ``lo, hi [GROUP_BLOCK,
    HALF_BLOCK]`` (``inside`` the real entries): ``(omega, out_lo, out_hi)``, the group's
    importance ``max(sigmoid(mean of q[..., -1] + c) + offset, omega_min)`` (Sec. 3.2, each
    step rounded to ``like_ptr``'s dtype as PyTorch's ops round theirs) and the rows rotated
    with their decision channel (the upper half's last) zeroed before and after."""
    last = (cols == HALF - 1)[None, :] & inside
    mean = _in_dtype(tl.sum(tl.sum(tl.where(last, hi, 0.0), axis=1), axis=0) / GROUP, like_ptr)
    omega = _in_dtype(tl.sigmoid(_in_dtype(mean + c, like_ptr)), like_ptr)
    omega = _in_dtype(tl.maximum(_in_dtype(omega + offset, like_ptr), omega_min), like_ptr)
    out_lo, out_hi = _rotate_half(lo, tl.where(last, 0.0, hi), cos, sin)
    return omega, out_lo, tl.where(last, 0.0, out_hi)


@triton.jit
def _dms_query_rope(lo, hi, cos, sin, inside, cols, rows, c, scale, like_ptr,
                    HALF: tl.constexpr):
    """A DMS decode query's KV group, its rows in float32 halves ``lo, hi [GROUP_BLOCK,
    HALF_BLOCK]`` (``rows`` their index in the group): ``(evict, out_lo, out_hi)``, the
    group's eviction ``[q[..., -1] * scale - c > 0]`` of its first head (each step rounded to
    ``like_ptr``'s dtype) and the rows rotated with that head's channel (the upper half's last)
    zeroed before and after."""
    last = (cols == HALF - 1)[None, :] & inside & (rows == 0)[:, None]
    logit = tl.sum(tl.sum(tl.where(last, hi, 0.0), axis=1), axis=0)
    logit = _in_dtype(_in_dtype(logit * scale, like_ptr) - c, like_ptr)
    out_lo, out_hi = _rotate_half(lo, tl.where(last, 0.0, hi), cos, sin)
    return logit > 0, out_lo, tl.where(last, 0.0, out_hi)


@triton.jit
def _decode_rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, decision_ptr, stride_xb, stride_xh,
                        stride_cb, c, param, omega_min,
                        GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr, HALF: tl.constexpr,
                        HALF_BLOCK: tl.constexpr, MODE: tl.constexpr):
    """MODE 0: RoPE only; 1: DMC (``param`` the importance's offset); 2: DMS (``param`` the
    logit's scale)."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    lo, hi, cos, sin, rows, cols, inside = _load_group(
        x_ptr, cos_ptr, sin_ptr, b, g, stride_xb, stride_xh, stride_cb, GROUP, GROUP_BLOCK, HALF,
        HALF_BLOCK)
    if MODE == 1:  # omega = max(sigmoid(mean + c) + offset, OMEGA_MIN), each step rounded
        omega, out_lo, out_hi = _dmc_query_rope(lo, hi, cos, sin, inside, cols, c, param,
                                                omega_min, x_ptr, GROUP, HALF)
        tl.store(decision_ptr + b * tl.num_programs(1) + g, omega)
    else:
        if MODE == 2:  # evict = [q[..., -1] * scale - c > 0] of the group's first head
            evict, out_lo, out_hi = _dms_query_rope(lo, hi, cos, sin, inside, cols, rows, c,
                                                    param, x_ptr, HALF)
            tl.store(decision_ptr + b * tl.num_programs(1) + g, evict)
        else:
            out_lo, out_hi = _rotate_half(lo, hi, cos, sin)
    _store_group(out_ptr, out_lo, out_hi, b, g, rows, cols, inside, GROUP, HALF)


def step_tables(cos: torch.Tensor, sin: torch.Tensor, batch: int,
                dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's RoPE tables (:func:`~dmc.ops.rope.rope_tables`, ``[batch, 1, dim]``) as
    the kernels read them: ``[batch, dim]`` float32 with a unit stride on ``dim``, equal
    strides."""
    cos, sin = cos.reshape(batch, dim).float(), sin.reshape(batch, dim).float()
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


class QueryOperands(NamedTuple):
    """What a write kernel taking a decode step's queries launches with
    (:func:`query_operands`): the queries, the step's tables, the float32 output of the rotated
    queries, ``(stride_qb, stride_qh, stride_cb)``, query heads per KV head and the decision
    channel; Nones, zeros and a group of 1 without queries."""

    q: torch.Tensor | None
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    out: torch.Tensor | None
    strides: tuple[int, int, int]
    group: int
    channel: DecisionChannel | EvictionChannel | None


def query_operands(query: tuple | None, batch: int, kv_heads: int, dim: int, owner: str,
                   decision: str, given: bool) -> QueryOperands:
    """The operands of ``query=(q [batch, q_heads, dim], cos, sin, channel)`` for ``owner``'s
    write kernel, which then reads ``decision`` from the queries itself; ValueError naming
    ``owner`` where ``decision`` was ``given`` as well or the channel's groups are not the
    kernel's ``kv_heads``."""
    if query is None:
        return QueryOperands(None, None, None, None, (0, 0, 0), 1, None)
    q, cos, sin, channel = query
    if given or channel.kv_heads != kv_heads or q.shape[1] % kv_heads:
        raise ValueError(f"{owner}: query= reads {decision} itself ({decision} None) for "
                         f"{kv_heads} KV heads, got {decision} {given}, {channel.kv_heads} "
                         f"groups of {q.shape[1]} query heads")
    q = q if q.stride(-1) == 1 else q.contiguous()
    cos, sin = step_tables(cos, sin, batch, dim)
    return QueryOperands(q, cos, sin, torch.empty(q.shape, dtype=torch.float32, device=q.device),
                         (q.stride(0), q.stride(1), cos.stride(0)), q.shape[1] // kv_heads,
                         channel)


def decode_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                decision: DecisionChannel | EvictionChannel | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~dmc.ops.rope.rotate` of ``x [batch, heads, dim]`` (any float dtype, unit stride
    on ``dim``) with the tables of :func:`~dmc.ops.rope.rope_tables` (``[batch, 1, dim]``
    float32) -> float32 ``[batch, heads, dim]`` and, per ``decision``, None, DMC's importance
    ``omega [batch, kv_heads]`` float32 (:class:`DecisionChannel`: every head's last channel
    zeroed before and after the rotation, :func:`~dmc.ops.decisions.zero_decision_channel`) or
    DMS's eviction ``[batch, kv_heads]`` bool (:class:`EvictionChannel`: the first head of each
    group's, :func:`~dmc.ops.decisions.zero_dms_channel`)."""
    batch, heads, dim = x.shape
    groups = decision.kv_heads if decision is not None else 1
    if heads % groups or dim % 2:
        raise ValueError(f"decode_rope: {heads} heads of dim {dim} do not split into {groups} "
                         f"groups of rotate-half pairs")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = step_tables(cos, sin, batch, dim)
    out = torch.empty(batch, heads, dim, dtype=torch.float32, device=x.device)
    mode = {type(None): 0, DecisionChannel: 1, EvictionChannel: 2}[type(decision)]
    out_decision = (None if mode == 0 else
                    torch.empty(batch, groups, dtype=torch.float32 if mode == 1 else torch.bool,
                                device=x.device))
    param = (0.0 if mode == 0 else decision.offset if mode == 1 else decision.scale)
    group = heads // groups
    _decode_rope_kernel[(batch, groups)](
        x, cos, sin, out, out_decision, x.stride(0), x.stride(1), cos.stride(0),
        0.0 if decision is None else decision.c, param, OMEGA_MIN,
        GROUP=group, GROUP_BLOCK=triton.next_power_of_2(group), HALF=dim // 2,
        HALF_BLOCK=triton.next_power_of_2(dim // 2), MODE=mode,
    )
    return out, out_decision
