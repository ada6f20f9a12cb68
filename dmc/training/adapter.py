"""Adapter-only training (``optim.trainable: decisions``, Model-Optimizer's DMS default): only
the rows of ``linear_qkv`` that produce the borrowed decision channels are trained
(:func:`dmc.megatron.attention.decision_rows`, DMC's or DMS's per layer), or, for DMS's
adapter decisions (``dmc.dms_decision: adapter``), the layer's whole ``decision_proj`` (NVIDIA
Model-Optimizer trains its ``dms_proj_alpha`` / ``dms_proj_alpha_norm`` in that mode; here the
norm is folded into ``decision_proj``, :mod:`dmc.megatron.dms_attention`) and nothing of
``linear_qkv``.

Every other parameter gets ``requires_grad=False`` before DDP and the optimizer are built, so
neither holds it. ``linear_qkv`` itself must stay trainable, so around each optimizer step
(:meth:`DecisionRowsOnly.around_step`) the gradient of its other rows is zeroed (the gradient
norm, clipping and Adam's moments see the decision rows only) and the rows are restored
afterwards, in the model's weight and in the optimizer's float32 main copy (bf16/fp16), since
AdamW's decoupled weight decay would otherwise shrink them. They stay bit-identical.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from dmc.megatron.attention import decision_rows, dmc_layers


class DecisionRowsOnly:
    """Freezes every parameter of ``model`` except the decision rows of its DMC/DMS layers'
    ``linear_qkv`` (weight and bias if any) and DMS adapters' ``decision_proj``; call before
    wrapping the model in DDP."""

    def __init__(self, model: torch.nn.Module):
        layers = dmc_layers(model)
        if not layers:
            raise ValueError("optim.trainable: decisions needs DMC/DMS attention layers (a "
                             "retrofit with dmc.enabled); this model has none")
        self.targets = []  # (parameter, bool mask of its frozen rows)
        trainable = set()
        for layer in layers:
            adapter = getattr(layer, "decision_proj", None)
            if adapter is not None:
                trainable.update(id(param) for param in adapter.parameters())
                continue
            qkv = layer.linear_qkv
            for param in (qkv.weight, getattr(qkv, "bias", None)):
                if isinstance(param, torch.Tensor) and param.numel():
                    frozen = torch.ones(param.shape[0], dtype=torch.bool, device=param.device)
                    frozen[decision_rows(layer)] = False
                    self.targets.append((param, frozen))
        trainable.update(id(param) for param, _ in self.targets)
        for param in model.parameters():
            if id(param) not in trainable:
                param.requires_grad_(False)

    @contextmanager
    def around_step(self):
        """Wrap ``optimizer.step()`` (after the backward): zeroes the frozen rows' gradients
        first and restores their values afterwards."""
        saved = []
        with torch.no_grad():
            for param, frozen in self.targets:
                grad = getattr(param, "main_grad", None)  # DDP's buffer, what the step reads
                if grad is not None:
                    grad[frozen] = 0
                main = getattr(param, "main_param", param)
                saved.append((param, main, frozen, param[frozen].clone(), main[frozen].clone()))
        yield
        with torch.no_grad():
            for param, main, frozen, value, main_value in saved:
                main[frozen] = main_value
                param[frozen] = value
