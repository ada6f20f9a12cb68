"""Partial accumulation of keys and values (Eq. 9 of the DMC paper).

For one head, token i with key k_i, value v_i, merge decision alpha_i and importance w_i:

    z_0 = w_0,  z_i = alpha_i z_{i-1} + w_i
    k~_i = (alpha_i z_{i-1} k~_{i-1} + w_i k_i) / z_i        (same for v)

Unrolled, k~_i = sum_m c_{i,m} k_m / sum_m c_{i,m} with c_{i,m} = w_m prod_{l=m+1..i} alpha_l.
The exact form sums over every m <= i (a scan over the sequence, computed by chunks of
``SCAN_CHUNK`` tokens); the window-grouped form keeps the last ``window`` terms m in
(i - window, i], which is parallel over i (Sec. 3.3, window 12).
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def _check_shapes(k, v, alpha, omega):
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"partial_accumulate: k and v must both be [batch, heads, seq, dim], got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if alpha.shape != k.shape[:3] or omega.shape != k.shape[:3]:
        raise ValueError(
            f"partial_accumulate: alpha and omega must be [batch, heads, seq] = "
            f"{tuple(k.shape[:3])}, got {tuple(alpha.shape)} and {tuple(omega.shape)}"
        )


def partial_accumulate(
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    omega: torch.Tensor,
    window: int | None = None,
    windowed=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted running means of keys and values inside merge segments (Eq. 9).

    Args:
        k, v: ``[batch, heads, seq, dim]`` (pre-RoPE keys).
        alpha: ``[batch, heads, seq]`` merge probabilities in [0, 1]; ``alpha[..., 0]`` is
            ignored (the first token always opens a slot).
        omega: ``[batch, heads, seq]`` importance weights > 0.
        window: ``None`` for the exact scan; ``w >= 1`` keeps the last ``w`` terms (the current
            token included).
        windowed: how the window-grouped form is computed, ``(k, v, alpha, omega, window) ->
            (k_acc, v_acc)`` in float32 or in the dtype of ``k`` (float32 ``alpha`` with
            ``alpha[..., 0]`` zeroed, ``window <= seq``): :func:`windowed_accumulate` (the
            default) or kernels of the same semantics (:mod:`dmc.megatron.window_sum_kernels`
            on CUDA).

    Returns:
        ``(k_acc, v_acc)``, each ``[batch, heads, seq, dim]`` in the dtype of ``k``; the sums are
        carried in float32 (float64 stays float64).
    """
    _check_shapes(k, v, alpha, omega)
    if window is not None and window < 1:
        raise ValueError(f"partial_accumulate: window must be None or >= 1, got {window}")
    work = torch.float64 if k.dtype == torch.float64 else torch.float32
    alpha = alpha.to(work).clone()
    alpha[..., 0] = 0
    omega = omega.to(work)
    seq = k.shape[2]
    if window is None:
        k_acc, v_acc = _exact_scan(k.to(work), v.to(work), alpha, omega, SCAN_CHUNK)
    else:
        k_acc, v_acc = (windowed or windowed_accumulate)(k, v, alpha, omega, min(window, seq))
    return k_acc.to(k.dtype), v_acc.to(v.dtype)


SCAN_CHUNK = 64  # tokens per chunk of the exact scan: [chunk, chunk] decays per chunk


def _exact_scan(k, v, alpha, omega, chunk: int):
    """The exact form of Eq. 9 as a chunked scan (the chunked form of a linear recurrence, as in
    Mamba-2's SSD; Dao and Gu 2024), vectorised over batch, heads and dim: a few dozen ops for
    any length instead of ~10 per token (a GPU ran one kernel launch per op and token).

    With ``x_i = omega_i [k_i, v_i, 1]`` the unnormalised sums follow ``S_i = alpha_i S_{i-1} +
    x_i``; their last channel is ``z_i`` and ``k~_i, v~_i`` are the others over it. Inside a
    chunk of ``C`` tokens starting at ``s``, ``S_i = A_{s,i} S_{s-1} + sum_{m=s..i} D_{i,m}
    x_m`` with ``D_{i,m} = prod_{l=m+1..i} alpha_l`` (a ``[C, C]`` cumulative product per
    chunk, one matmul) and ``A_{s,i} = prod_{l=s..i} alpha_l``; the state carried between
    chunks is a loop over ``seq / C`` chunks. Products, never quotients of them, so hard
    decisions (alpha exactly 0) need no care. Deviation from the paper's sequential form: the
    sums are divided by ``z_i`` at the end, not per step (same value; omega > 0 bounds
    ``z_i`` below by ``omega_i``)."""
    batch, heads, seq, dim = k.shape
    pad = -seq % chunk
    x = torch.cat([k, v, torch.ones_like(k[..., :1])], dim=-1) * omega[..., None]
    x = torch.nn.functional.pad(x, (0, 0, 0, pad))  # padded tokens come after: never read
    alpha = torch.nn.functional.pad(alpha, (0, pad), value=1.0)
    chunks = (seq + pad) // chunk
    x = x.reshape(batch, heads, chunks, chunk, 2 * dim + 1)
    alpha = alpha.reshape(batch, heads, chunks, chunk)
    row = torch.arange(chunk, device=k.device)
    below = row[:, None] > row[None, :]  # [i, m]: i > m
    factors = torch.where(below, alpha[..., :, None], torch.ones_like(alpha[..., :, None]))
    decay = torch.cumprod(factors, dim=-2) * (row[:, None] >= row[None, :])  # D_{i,m}
    local = decay @ x  # [batch, heads, chunks, C, 2 dim + 1]
    from_start = torch.cumprod(alpha, dim=-1)  # A_{s,i}
    state, carried = torch.zeros_like(local[:, :, 0, 0]), []
    for c in range(chunks):
        carried.append(state)
        state = from_start[:, :, c, -1, None] * state + local[:, :, c, -1]
    sums = local + from_start[..., None] * torch.stack(carried, dim=2)[:, :, :, None]
    sums = sums.reshape(batch, heads, chunks * chunk, -1)[:, :, :seq]
    z = sums[..., -1:]
    return sums[..., :dim] / z, sums[..., dim:2 * dim] / z


def windowed_accumulate(k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor,
                        omega: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Window-grouped form of Eq. 9 for keys and values: the weights (:class:`WindowWeights`),
    then :class:`WindowedSum` of each (``window`` shifted terms, each parallel over the
    sequence)."""
    coeff = WindowWeights.apply(alpha, omega, window)
    return WindowedSum.apply(k, coeff), WindowedSum.apply(v, coeff)


def window_weights(alpha: torch.Tensor, omega: torch.Tensor, window: int) -> torch.Tensor:
    """``[batch, heads, seq, window]`` weights of the window-grouped Eq. 9, divided by z_i:
    term ``o`` (offset from the current token) has ``omega_{i-o} * prod_{l=i-o+1..i} alpha_l``;
    terms before the sequence start are zero. (A ``cumprod`` over an unfolded window reads
    shorter but its backward, which must handle alpha = 0, ran 2-3x slower on the CPU.)"""
    decay = torch.ones_like(alpha)
    coeffs = []
    for offset in range(window):
        if offset > 0:
            decay = decay * _shift(alpha, offset - 1)
        coeffs.append(decay * _shift(omega, offset))
    coeff = torch.stack(coeffs, dim=-1)
    return coeff / coeff.sum(-1, keepdim=True)


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """``out[..., i] = x[..., i - by]`` along the last dimension, zero-filled at the start."""
    if by == 0:
        return x
    return torch.nn.functional.pad(x[..., :x.shape[-1] - by], (by, 0))


class WindowWeights(torch.autograd.Function):
    """:func:`window_weights` that keeps only ``alpha`` and ``omega`` for the backward and
    recomputes the products there: autograd would keep about ``2 * window`` tensors of
    ``[batch, heads, seq]`` per layer (at head_dim 32, as much as the keys themselves)."""

    @staticmethod
    def forward(ctx, alpha: torch.Tensor, omega: torch.Tensor, window: int) -> torch.Tensor:
        ctx.save_for_backward(alpha, omega)
        ctx.window = window
        return window_weights(alpha, omega, window)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        alpha, omega = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            coeff = window_weights(alpha, omega, ctx.window)
        # window 1 leaves alpha out of the weights (each is omega_i / omega_i): no gradient
        return *torch.autograd.grad(coeff, (alpha, omega), grad, allow_unused=True), None


class WindowedSum(torch.autograd.Function):
    """``out[..., i, :] = sum_o coeff[..., i, o] * x[..., i - o, :]`` over the offsets ``o`` of
    ``coeff [batch, heads, seq, window]`` (``x [batch, heads, seq, dim]``, zero before the
    start): the window-grouped Eq. 9 with ``coeff`` its weights divided by z_i (or, with raw
    weights, its numerators). Written out as ``window`` shifted
    products, autograd would keep every shifted copy of ``x`` for the backward, ``window`` times
    the keys' and values' memory per layer (the DMC train step's peak memory was 2.4x vanilla's
    on an H200, 1B shape, seq 2048); this keeps ``x`` and ``coeff`` only and shifts again in the
    backward. The sums run in the dtype of ``coeff`` (float32 for bf16 keys and values, which
    are kept as they come: half the bytes of a float32 copy)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, coeff)
        x = x.to(coeff.dtype)
        out = x * coeff[..., :1]
        for offset in range(1, coeff.shape[-1]):
            out[..., offset:, :].addcmul_(coeff[..., offset:, offset, None], x[..., :-offset, :])
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x_in, coeff = ctx.saved_tensors
        x, grad = x_in.to(coeff.dtype), grad.to(coeff.dtype)
        grad_x = grad_coeff = None
        if ctx.needs_input_grad[0]:
            grad_x = grad * coeff[..., :1]
            for offset in range(1, coeff.shape[-1]):
                grad_x[..., :-offset, :].addcmul_(coeff[..., offset:, offset, None],
                                                  grad[..., offset:, :])
            grad_x = grad_x.to(x_in.dtype)
        if ctx.needs_input_grad[1]:
            grad_coeff = torch.zeros_like(coeff)
            grad_coeff[..., 0] = torch.linalg.vecdot(grad, x)
            for offset in range(1, coeff.shape[-1]):
                grad_coeff[..., offset:, offset] = torch.linalg.vecdot(grad[..., offset:, :],
                                                                       x[..., :-offset, :])
        return grad_x, grad_coeff
