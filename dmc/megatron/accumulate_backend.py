"""``dmc.accumulate_backend``: which implementation of Eq. 9's window-grouped form the training
forward (:mod:`dmc.megatron.attention`) and the engine's prefill
(:class:`dmc.inference.kv_write.DMCKV`) hand to :func:`dmc.ops.partial_accumulate`. Imports
neither megatron-core nor Triton until the kernels are chosen."""
from __future__ import annotations

import os

import torch


def window_kernels(backend: str, keys: torch.Tensor):
    """The ``windowed`` of :func:`dmc.ops.partial_accumulate` for ``dmc.accumulate_backend``
    and ``keys`` (their device and dtype): the fused Triton kernels
    (:mod:`dmc.megatron.window_sum_kernels`) for "triton", and for "auto" on CUDA; None (the
    PyTorch path) for "torch", and for "auto" elsewhere or in float64 (the kernels sum in
    float32, where the PyTorch path keeps float64 in float64)."""
    device = keys.device
    if backend == "torch" or (backend == "auto" and (device.type != "cuda"
                                                     or keys.dtype == torch.float64)):
        return None
    if keys.dtype == torch.float64:
        raise ValueError("dmc.accumulate_backend: 'triton' sums in float32 and takes no float64 "
                         "model; accepted here: auto, torch")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("dmc.accumulate_backend: 'triton' on the CPU needs TRITON_INTERPRET=1 "
                         "in the environment before start; accepted here: auto, torch")
    from dmc.megatron.window_sum_kernels import fused_windowed_accumulate

    return fused_windowed_accumulate
