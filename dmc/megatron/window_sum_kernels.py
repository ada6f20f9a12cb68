"""Eq. 9's window-grouped form in Triton: the window weights in one kernel, the sums of keys and
values in another (forward and backward; :func:`fused_windowed_accumulate`).

:class:`dmc.ops.accumulate.WindowedSum` (the PyTorch path, which stays the oracle) writes
``out[i] = sum_o coeff[i, o] x[i - o]`` as ``window`` shifted products over the whole
``[batch, heads, seq, dim]`` tensor: the forward makes a float32 copy of ``x`` and then reads and
writes the float32 output once per offset (about 130 bytes moved per element at window 12), the
backward as much again for ``grad_x`` plus a pass over ``grad`` and ``x`` per offset for
``grad_coeff``, and the keys and values each pay it. On a GPU that is memory traffic, not math:
at the 1B shape of the GPU kit (16 layers, batch 4, seq 2048, 16 heads of 128) about 190 GB per
train step. Here one program holds a block of positions of one (batch, head) and
loops over the offsets in registers, so each input is read from DRAM about once (the shifted
re-reads hit the cache) and each output written once; keys and values share one launch and
their common ``coeff`` (whose gradient sums both). The weights (``[batch, heads, seq]``
vectors, little data) are one launch forward and two backward, where
:class:`~dmc.ops.accumulate.WindowWeights` runs ~4 small ops per offset and recomputes them
under autograd in its backward (~200 launches a layer at window 12).

``x``, ``grad`` in any strides and dtype (bf16 / fp16 / fp32); ``coeff [batch, heads, seq,
window]`` float32, contiguous; sums in float32, outputs and ``grad_x`` in the dtype of ``x``
(the PyTorch path returns float32 sums, which :func:`dmc.ops.partial_accumulate` then casts:
the same rounding, without a float32 output written and read again, and the gradient read in
its own dtype instead of a float32 copy).
Import this module only after ``TRITON_INTERPRET`` is settled (``TRITON_INTERPRET=1`` runs it
on CPU tensors: the tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# elements of one [positions, channels] tile: the forward holds 4 such tiles in registers, the
# backward 12 (both inputs' gradients and accumulators, the shifted tiles), spread over
# NUM_WARPS * 32 threads: 64 and 96 float32 registers a thread with 8 warps (not tuned on a GPU)
FORWARD_TILE, BACKWARD_TILE, NUM_WARPS, MAX_BLOCK_T = 4096, 2048, 8, 64
WEIGHTS_BLOCK_T = 128  # positions of one window-weights program (vectors, not tiles)


@triton.jit
def _block(heads, seq, DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's flat (batch, head) ``bh`` and its ``b``, ``h``, its positions ``rows
    [BLOCK_T]`` and channels ``cols [BLOCK_D]`` with their bounds masks (int64 offsets:
    positions times strides may not fit in 32 bits)."""
    bh = tl.program_id(0).to(tl.int64)
    rows = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    return bh, bh // heads, bh % heads, rows, cols, rows < seq, cols < DIM


@triton.jit
def _tile(ptr, bh_offset, stride_t, stride_d, rows, cols, mask):
    """``[BLOCK_T, BLOCK_D]`` float32 tile of rows ``rows`` (zero where ``mask`` is false)."""
    offsets = bh_offset + rows[:, None] * stride_t + cols[None, :] * stride_d
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _in_dtype_of(x, ptr):
    """float32 ``x`` in the element type of ``ptr``, rounded to nearest even (as on a GPU and
    as torch casts; the interpreter's plain cast to bf16 truncates)."""
    if ptr.dtype.element_ty == tl.float32:
        return x
    else:
        return x.to(ptr.dtype.element_ty, fp_downcast_rounding="rtne")


@triton.jit
def _forward_kernel(k_ptr, v_ptr, coeff_ptr, k_out, v_out, heads, seq,
                    skb, skh, skt, skd, svb, svh, svt, svd,
                    DIM: tl.constexpr, WINDOW: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    bh, b, h, rows, cols, inside, col_ok = _block(heads, seq, DIM, BLOCK_T, BLOCK_D)
    coeff_row = coeff_ptr + (bh * seq + rows) * WINDOW
    k_acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    v_acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for offset in tl.static_range(WINDOW):
        source = rows - offset
        mask = (inside & (source >= 0))[:, None] & col_ok[None, :]
        c = tl.load(coeff_row + offset, mask=inside, other=0.0)[:, None]
        k_acc += c * _tile(k_ptr, b * skb + h * skh, skt, skd, source, cols, mask)
        v_acc += c * _tile(v_ptr, b * svb + h * svh, svt, svd, source, cols, mask)
    out = (bh * seq + rows)[:, None] * DIM + cols[None, :]
    store = inside[:, None] & col_ok[None, :]
    tl.store(k_out + out, _in_dtype_of(k_acc, k_out), mask=store)
    tl.store(v_out + out, _in_dtype_of(v_acc, v_out), mask=store)


@triton.jit
def _backward_kernel(k_ptr, v_ptr, gk_ptr, gv_ptr, coeff_ptr, gk_out, gv_out, gcoeff_out,
                     heads, seq,
                     skb, skh, skt, skd, svb, svh, svt, svd,
                     sgkb, sgkh, sgkt, sgkd, sgvb, sgvh, sgvt, sgvd,
                     DIM: tl.constexpr, WINDOW: tl.constexpr, LAGS: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """``grad_x[j] = sum_o coeff[j + o, o] grad[j + o]`` (keys and values) and
    ``grad_coeff[i, o] = <grad_k[i], k[i - o]> + <grad_v[i], v[i - o]>``, the latter kept in
    registers and stored once (a store inside the loop would hold back every later load: the
    compiler cannot tell that the output does not alias the inputs)."""
    bh, b, h, rows, cols, inside, col_ok = _block(heads, seq, DIM, BLOCK_T, BLOCK_D)
    here = inside[:, None] & col_ok[None, :]
    k_at, v_at = b * skb + h * skh, b * svb + h * svh
    gk_at, gv_at = b * sgkb + h * sgkh, b * sgvb + h * sgvh
    grad_k = _tile(gk_ptr, gk_at, sgkt, sgkd, rows, cols, here)
    grad_v = _tile(gv_ptr, gv_at, sgvt, sgvd, rows, cols, here)
    gk_acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    gv_acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    lags = tl.arange(0, LAGS)
    gcoeff = tl.zeros((BLOCK_T, LAGS), dtype=tl.float32)
    for offset in tl.static_range(WINDOW):
        source = rows - offset
        back = (inside & (source >= 0))[:, None] & col_ok[None, :]
        dot = (tl.sum(grad_k * _tile(k_ptr, k_at, skt, skd, source, cols, back), axis=1)
               + tl.sum(grad_v * _tile(v_ptr, v_at, svt, svd, source, cols, back), axis=1))
        gcoeff = _set_lag(gcoeff, lags, offset, dot)
        target = rows + offset
        ahead = target < seq
        c = tl.load(coeff_ptr + (bh * seq + target) * WINDOW + offset, mask=ahead,
                    other=0.0)[:, None]
        forward = ahead[:, None] & col_ok[None, :]
        gk_acc += c * _tile(gk_ptr, gk_at, sgkt, sgkd, target, cols, forward)
        gv_acc += c * _tile(gv_ptr, gv_at, sgvt, sgvd, target, cols, forward)
    out = (bh * seq + rows)[:, None] * DIM + cols[None, :]
    tl.store(gk_out + out, _in_dtype_of(gk_acc, gk_out), mask=here)
    tl.store(gv_out + out, _in_dtype_of(gv_acc, gv_out), mask=here)
    _store_lags(gcoeff_out, bh * seq + rows, inside, lags, gcoeff, WINDOW)


@triton.jit
def _set_lag(tile, lags, lag: tl.constexpr, values):
    """``tile [BLOCK_T, LAGS]`` with column ``lag`` replaced by ``values [BLOCK_T]``."""
    return tl.where(lags[None, :] == lag, values[:, None], tile)


@triton.jit
def _lag(tile, lags, lag: tl.constexpr):
    """Column ``lag`` of ``tile [BLOCK_T, LAGS]`` (a select and a sum of one value: exact)."""
    return tl.sum(tl.where(lags[None, :] == lag, tile, 0.0), axis=1)


@triton.jit
def _store_lags(ptr, rows, inside, lags, tile, WINDOW: tl.constexpr):
    """``tile [BLOCK_T, LAGS]`` into rows ``rows`` of a ``[..., WINDOW]`` float32 array, one
    store after the loops that computed it."""
    tl.store(ptr + rows[:, None] * WINDOW + lags[None, :], tile,
             mask=inside[:, None] & (lags < WINDOW)[None, :])


@triton.jit
def _weights_kernel(alpha_ptr, omega_ptr, coeff_ptr, seq,
                    WINDOW: tl.constexpr, LAGS: tl.constexpr, BLOCK_T: tl.constexpr):
    """:func:`dmc.ops.accumulate.window_weights`: ``coeff[t, o] = w_o / sum_p w_p`` with
    ``w_o = omega[t - o] prod_{l = t-o+1..t} alpha[l]``, the weights kept in registers."""
    bh, _, _, rows, _, inside, _ = _block(1, seq, 1, BLOCK_T, 1)
    alpha_row, omega_row = alpha_ptr + bh * seq, omega_ptr + bh * seq
    lags = tl.arange(0, LAGS)
    weights = tl.zeros((BLOCK_T, LAGS), tl.float32)
    total = tl.zeros((BLOCK_T,), tl.float32)
    decay = tl.full((BLOCK_T,), 1.0, tl.float32)
    for offset in tl.static_range(WINDOW):
        decay = _longer(alpha_row, rows, seq, offset, decay)
        weight = decay * _omega_at(omega_row, rows, seq, offset)
        total += weight
        weights = _set_lag(weights, lags, offset, weight)
    total = tl.where(inside, total, 1.0)  # past the end: nothing stored, no 0 / 0
    _store_lags(coeff_ptr, bh * seq + rows, inside, lags, weights / total[:, None], WINDOW)


@triton.jit
def _longer(alpha_row, rows, seq, offset: tl.constexpr, decay):
    """The decay of ``offset`` from that of ``offset - 1``: times ``alpha[t - offset + 1]``
    (offset 0: 1, as given)."""
    if offset > 0:
        source = rows - offset + 1
        decay *= tl.load(alpha_row + source, mask=(rows < seq) & (source >= 0), other=0.0)
    return decay


@triton.jit
def _omega_at(omega_row, rows, seq, offset: tl.constexpr):
    """``omega[t - offset]`` of rows ``rows`` (zero before the start)."""
    source = rows - offset
    return tl.load(omega_row + source, mask=(rows < seq) & (source >= 0), other=0.0)


@triton.jit
def _weights_backward_kernel(alpha_ptr, omega_ptr, grad_ptr, alpha_part, omega_part, seq,
                             WINDOW: tl.constexpr, LAGS: tl.constexpr, BLOCK_T: tl.constexpr):
    """Per row ``t``, with ``G = grad[t]``, ``S = sum_o w_o`` and ``H_o = (G_o - sum_p G_p
    coeff_p) / S`` (the gradient of ``w_o``): ``omega_part[t, o] = H_o P_o`` (for ``omega[t -
    o]``) and ``alpha_part[t, j] = P_{j-1} R_j`` (for ``alpha[t - j + 1]``), where ``P_o`` is
    the decay of offset ``o`` and ``R_j = sum_{o >= j} H_o omega[t - o] prod_{i = j+1..o}
    alpha[t - i + 1]``, run backwards as ``R_j = H_j omega[t - j] + alpha[t - j] R_{j+1}``:
    products of the other factors, no division (hard decisions are exactly 0 or 1). The
    decays, importances and parts stay in ``[BLOCK_T, LAGS]`` registers, each part stored
    once."""
    bh, _, _, rows, _, inside, _ = _block(1, seq, 1, BLOCK_T, 1)
    alpha_row, omega_row = alpha_ptr + bh * seq, omega_ptr + bh * seq
    lags = tl.arange(0, LAGS)
    part = (bh * seq + rows) * WINDOW
    grads = tl.load(grad_ptr + part[:, None] + lags[None, :],
                    mask=inside[:, None] & (lags < WINDOW)[None, :], other=0.0)
    decays = tl.zeros((BLOCK_T, LAGS), tl.float32)
    omegas = tl.zeros((BLOCK_T, LAGS), tl.float32)
    total = tl.zeros((BLOCK_T,), tl.float32)
    weighted = tl.zeros((BLOCK_T,), tl.float32)
    decay = tl.full((BLOCK_T,), 1.0, tl.float32)
    for offset in tl.static_range(WINDOW):
        decay = _longer(alpha_row, rows, seq, offset, decay)
        omega = _omega_at(omega_row, rows, seq, offset)
        weight = decay * omega
        total += weight
        weighted += weight * _lag(grads, lags, offset)
        decays = _set_lag(decays, lags, offset, decay)
        omegas = _set_lag(omegas, lags, offset, omega)
    total = tl.where(inside, total, 1.0)  # past the end: nothing stored, no 0 / 0
    mean = weighted / total
    h = (grads - mean[:, None]) / total[:, None]
    _store_lags(omega_part, bh * seq + rows, inside, lags, h * decays, WINDOW)
    alphas = tl.zeros((BLOCK_T, LAGS), tl.float32)
    carried = tl.zeros((BLOCK_T,), tl.float32)
    for j in tl.static_range(WINDOW - 1, 0, -1):
        source = rows - j
        following = tl.load(alpha_row + source, mask=inside & (source >= 0), other=0.0)
        carried = _lag(h, lags, j) * _lag(omegas, lags, j) + following * carried
        alphas = _set_lag(alphas, lags, j, _lag(decays, lags, j - 1) * carried)
    _store_lags(alpha_part, bh * seq + rows, inside, lags, alphas, WINDOW)


@triton.jit
def _gather_kernel(alpha_part, omega_part, grad_alpha, grad_omega, seq,
                   WINDOW: tl.constexpr, BLOCK_T: tl.constexpr):
    """``grad_alpha[s] = sum_j alpha_part[s + j - 1, j]``, ``grad_omega[s] = sum_o
    omega_part[s + o, o]``: each row's parts to the positions they belong to."""
    bh, _, _, rows, _, inside, _ = _block(1, seq, 1, BLOCK_T, 1)
    to_alpha = tl.zeros((BLOCK_T,), tl.float32)
    to_omega = tl.zeros((BLOCK_T,), tl.float32)
    for offset in tl.static_range(WINDOW):
        row = rows + offset
        to_omega += tl.load(omega_part + (bh * seq + row) * WINDOW + offset,
                            mask=row < seq, other=0.0)
        if offset > 0:
            row = rows + offset - 1
            to_alpha += tl.load(alpha_part + (bh * seq + row) * WINDOW + offset,
                                mask=row < seq, other=0.0)
    tl.store(grad_alpha + bh * seq + rows, to_alpha, mask=inside)
    tl.store(grad_omega + bh * seq + rows, to_omega, mask=inside)


def _lags(window: int) -> int:
    """The register tiles' columns for ``window`` offsets (a power of two)."""
    return triton.next_power_of_2(window)


def _launch(batch_heads: int, seq: int, dim: int, tile: int) -> tuple[tuple[int, int], dict]:
    """Grid and meta-parameters: ``tile // BLOCK_D`` positions a program (at most
    ``MAX_BLOCK_T``)."""
    block_d = triton.next_power_of_2(dim)
    block_t = max(1, min(MAX_BLOCK_T, tile // block_d))
    grid = (batch_heads, triton.cdiv(seq, block_t))
    return grid, dict(DIM=dim, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=NUM_WARPS)


class FusedWindowedSum(torch.autograd.Function):
    """``(WindowedSum(k, coeff), WindowedSum(v, coeff))`` (:mod:`dmc.ops.accumulate`) by the
    kernels above, each in its input's dtype; keeps ``k``, ``v`` and ``coeff`` for the
    backward, as the PyTorch path does."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, coeff: torch.Tensor):
        coeff = coeff.float().contiguous()
        batch, heads, seq, dim = k.shape
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        v_out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        grid, meta = _launch(batch * heads, seq, dim, FORWARD_TILE)
        _forward_kernel[grid](k, v, coeff, k_out, v_out, heads, seq, *k.stride(), *v.stride(),
                              WINDOW=coeff.shape[-1], **meta)
        ctx.save_for_backward(k, v, coeff)
        return k_out, v_out

    @staticmethod
    def backward(ctx, grad_k: torch.Tensor, grad_v: torch.Tensor):
        k, v, coeff = ctx.saved_tensors
        batch, heads, seq, dim = k.shape
        grad_k = torch.zeros_like(k) if grad_k is None else grad_k
        grad_v = torch.zeros_like(v) if grad_v is None else grad_v
        gk_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        gv_out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        gcoeff = torch.empty_like(coeff)
        grid, meta = _launch(batch * heads, seq, dim, BACKWARD_TILE)
        _backward_kernel[grid](k, v, grad_k, grad_v, coeff, gk_out, gv_out, gcoeff, heads, seq,
                               *k.stride(), *v.stride(), *grad_k.stride(), *grad_v.stride(),
                               WINDOW=coeff.shape[-1], LAGS=_lags(coeff.shape[-1]), **meta)
        needs = ctx.needs_input_grad
        return (gk_out if needs[0] else None, gv_out if needs[1] else None,
                gcoeff if needs[2] else None)


class FusedWindowWeights(torch.autograd.Function):
    """:class:`dmc.ops.accumulate.WindowWeights` by the kernels above: ``alpha, omega [batch,
    heads, seq]`` -> ``coeff [batch, heads, seq, window]`` float32, one launch forward, two
    backward (where the PyTorch path runs ~4 small ops per offset forward and recomputes them
    under autograd in its backward)."""

    @staticmethod
    def forward(ctx, alpha: torch.Tensor, omega: torch.Tensor, window: int) -> torch.Tensor:
        alpha, omega = alpha.float().contiguous(), omega.float().contiguous()
        batch, heads, seq = alpha.shape
        coeff = alpha.new_empty(batch, heads, seq, window)
        grid = (batch * heads, triton.cdiv(seq, WEIGHTS_BLOCK_T))
        _weights_kernel[grid](alpha, omega, coeff, seq, WINDOW=window, LAGS=_lags(window),
                              BLOCK_T=WEIGHTS_BLOCK_T)
        ctx.save_for_backward(alpha, omega)
        ctx.window = window
        return coeff

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        alpha, omega = ctx.saved_tensors
        batch, heads, seq = alpha.shape
        grad = grad.float().contiguous()
        alpha_part, omega_part = torch.empty_like(grad), torch.empty_like(grad)
        grad_alpha, grad_omega = torch.empty_like(alpha), torch.empty_like(omega)
        grid = (batch * heads, triton.cdiv(seq, WEIGHTS_BLOCK_T))
        meta = dict(WINDOW=ctx.window, BLOCK_T=WEIGHTS_BLOCK_T)
        _weights_backward_kernel[grid](alpha, omega, grad, alpha_part, omega_part, seq,
                                       LAGS=_lags(ctx.window), **meta)
        _gather_kernel[grid](alpha_part, omega_part, grad_alpha, grad_omega, seq, **meta)
        return grad_alpha, grad_omega, None


def fused_windowed_accumulate(k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor,
                              omega: torch.Tensor,
                              window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dmc.ops.accumulate.windowed_accumulate` by the kernels above: the window weights
    of ``alpha, omega [batch, heads, seq]``, then the sums of ``k``, ``v [batch, heads, seq,
    dim]``: ``[batch, heads, seq, dim]`` each in its input's dtype, contiguous."""
    return FusedWindowedSum.apply(k, v, FusedWindowWeights.apply(alpha, omega, window))
