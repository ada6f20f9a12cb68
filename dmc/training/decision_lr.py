"""A learning-rate multiplier for DMC's borrowed decision channels (``optim.decision_lr_mult``).

Why: the zero-out phase leaves the decision rows of ``linear_qkv`` at zero, so every token
starts at alpha_logit = k[-1] - c = -5 (Eq. 8 with NVIDIA's c = 5) and the retrofit must move
that logit by about c before any token merges. Adam moves each weight by at most about ``lr``
per step, so the logit moves at most ``lr * sum_i |h_i|`` (``h`` the normalised hidden state,
``sum_i |h_i|`` ~ hidden size) per step. The paper's Llama-2 7B recipe has room for
3e-5 x ~5700 steps per CR unit x 4096 ~ 700 logit units; a CPU-sized retrofit (1e-3 x 200 steps
x 128) has ~26, and its measured CR lags the annealed target (1.6x for a 4x target). Scaling
the decision rows' update (not their gradient, which Adam would normalise away) gives them the
paper's room without raising the LR of the weights that hold the model's knowledge.

Deviation from the paper (which trains every weight at one LR): the default, 1.0, is the paper's
recipe; a run that sets it says so in its config.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from dmc.megatron.attention import decision_rows, dmc_layers


class DecisionUpdateScale:
    """Multiplies the optimizer's update of every DMC layer's :func:`decision_rows` by
    ``mult``: ``w <- w_before + mult * (w_after - w_before)`` around one optimizer step. A DMS
    adapter layer (``dmc.dms_decision: adapter``) decides with its ``decision_proj``, whose
    whole weight is then the decision parameter.

    Works on the optimizer's main copy of the weight (megatron's ``param.main_param`` under
    bf16/fp16, the parameter itself in fp32) and writes the result back to the model's copy.
    """

    def __init__(self, model: torch.nn.Module, mult: float):
        self.mult = mult
        self.targets = []  # (model weight, main weight, row ids)
        for layer in dmc_layers(model):
            adapter = getattr(layer, "decision_proj", None)
            weight = layer.linear_qkv.weight if adapter is None else adapter.weight
            rows = (torch.tensor(decision_rows(layer), dtype=torch.long, device=weight.device)
                    if adapter is None else torch.arange(weight.shape[0], device=weight.device))
            self.targets.append((weight, getattr(weight, "main_param", weight), rows))

    @contextmanager
    def around_step(self, enabled: bool = True):
        """Wrap ``optimizer.step()``; ``enabled=False`` (or ``mult == 1``) leaves it alone."""
        if not enabled or self.mult == 1.0 or not self.targets:
            yield
            return
        before = [main.detach()[rows].clone() for _, main, rows in self.targets]
        yield
        with torch.no_grad():
            for (weight, main, rows), old in zip(self.targets, before):
                new = old + self.mult * (main[rows] - old)
                main[rows] = new
                if main is not weight:
                    weight[rows] = new.to(weight.dtype)


def zero_main_decision_rows_(model: torch.nn.Module) -> None:
    """Zeroes the decision rows in the optimizer's float32 main copies (bf16/fp16 training),
    after :func:`~dmc.megatron.attention.zero_decision_rows_` zeroed the model's: megatron's
    optimizer steps the main copy and copies it over the model's weight, so zeroing the model's
    rows alone would be undone by the next step. A no-op in float32 (no main copies)."""
    with torch.no_grad():
        for layer in dmc_layers(model):
            qkv = layer.linear_qkv
            for param in (qkv.weight, getattr(qkv, "bias", None)):
                main = getattr(param, "main_param", None)
                if main is not None:
                    main[decision_rows(layer)] = 0
