"""The run's ``precision``: the parameters' dtype and, on a CPU, the autocast around the forward.

On a GPU, bf16 is megatron's: bf16 weights with float32 main copies in the optimizer. On a CPU,
megatron's bf16 optimizer cannot run (it wraps CUDA tensors only), so bf16 keeps float32
parameters and runs the forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``.
"""
from __future__ import annotations

import torch

from dmc.megatron.compat import cuda_available
from dmc.training.config import RunConfig


def _bf16_on_cpu(cfg: RunConfig) -> bool:
    return cfg.precision == "bf16" and not cuda_available()


def params_dtype(cfg: RunConfig) -> torch.dtype:
    """The parameters' dtype. bf16 on a CPU keeps float32 parameters and runs the forward
    under :func:`cpu_autocast` (megatron's bf16 optimizer wraps CUDA tensors only)."""
    if cfg.precision == "auto":
        return torch.bfloat16 if cuda_available() else torch.float32
    if _bf16_on_cpu(cfg):
        return torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.precision]


def cpu_autocast(cfg: RunConfig):
    """bf16 on a CPU: matmuls and attention in bfloat16 over float32 parameters and optimizer
    state, the residual stream, norms and loss in float32 (``compat``'s patches; megatron's
    cross entropy upcasts the logits)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=_bf16_on_cpu(cfg))
