"""Triton Gumbel-max draw: :func:`dmc.inference.sampling.gumbel_pick` without top-k / top-p, in
one launch, the same tokens (the PyTorch path stays the oracle).

The PyTorch path runs ~20 elementwise ops over ``[rows, vocab]`` int64 and float64 tensors
(splitmix64's hash of ``(seed, position, v)``, the uniform, ``-log(-log u)``, the tempered
logits, their sum, the argmax): at a decode batch of 127 and a 32000-token vocabulary each
op moves ~65 MB, ~0.5 ms of an H100 decode step of ~8 ms by that count (not measured), growing
with the batch. Here one program
per row walks the vocabulary in blocks, hashes in registers (uint64, wrapping as splitmix64's
unsigned arithmetic), forms the same float64 uniform ``(top 52 bits + 1/2) / 2^52`` and noise,
adds the tempered logit (float32 division rounded to nearest, as PyTorch's, then float64), and
keeps the first index of the largest value (``torch.argmax``'s tie rule). Import this module
only after ``TRITON_INTERPRET`` is settled.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dmc.inference.sampling import GOLDEN, MIX1, MIX2

BLOCK_V = 1024  # vocabulary entries per loop step of a row's program

_U64 = (1 << 64) - 1  # sampling's constants hold int64 bits; Triton's uint64 math wants them so
_GOLDEN, _MIX1, _MIX2 = (tl.constexpr(c & _U64) for c in (GOLDEN, MIX1, MIX2))


@triton.jit
def _mix64(x):
    """splitmix64's finalizer on uint64 ``x`` (:func:`dmc.inference.sampling.mix64`)."""
    x = (x ^ (x >> 30)) * _MIX1
    x = (x ^ (x >> 27)) * _MIX2
    return x ^ (x >> 31)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride_row, temperature_ptr, seed_ptr, position_ptr,
                          out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    seed = tl.load(seed_ptr + row).to(tl.uint64, bitcast=True)
    position = tl.load(position_ptr + row).to(tl.uint64, bitcast=True)
    state = _mix64(_mix64(seed) + (position + 1) * _GOLDEN)
    best = tl.full((), float("-inf"), tl.float64)
    best_index = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        inside = ids < vocab
        logits = tl.load(logits_ptr + row * stride_row + ids, mask=inside, other=0.0)
        scores = tl.math.div_rn(logits.to(tl.float32), temperature).to(tl.float64)
        bits = _mix64(state + (ids.to(tl.uint64) + 1) * _GOLDEN)
        uniform = ((bits >> 12).to(tl.float64) + 0.5) / 4503599627370496.0  # 2^52
        values = tl.where(inside, scores - tl.log(-tl.log(uniform)), float("-inf"))
        block_best = tl.max(values, axis=0)
        block_index = tl.argmax(values, axis=0).to(tl.int64) + start
        better = block_best > best  # strictly: an earlier block keeps a tie
        best_index = tl.where(better, block_index, best_index)
        best = tl.where(better, block_best, best)
    tl.store(out_ptr + row, best_index)


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                  position: torch.Tensor) -> torch.Tensor:
    """``argmax(logits / temperature + gumbel_noise(seed, position, v))`` per row: ``logits
    [rows, vocab]`` (any float dtype, unit stride on the vocabulary), ``temperature [rows]``
    float32 > 0, ``seed``, ``position`` ``[rows]`` int64 -> ``[rows]`` int64 token ids."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(rows,)](logits, logits.stride(0), temperature.float().contiguous(),
                                   seed.contiguous(), position.contiguous(), out, vocab,
                                   BLOCK=BLOCK_V)
    return out
