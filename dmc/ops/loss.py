"""The compression-ratio loss and its schedule (Eq. 10; Sec. 4 "Training schedule" and App. F
of the paper)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

PRIORS = ("global", "local")


def compression_loss_from_sums(
    kept: torch.Tensor, count: float | int, target_cr: float, num_groups: int | None = None
) -> torch.Tensor:
    """Eq. 10 from kept-slot sums, the hinge applied per sequence and per hinge group:
    ``mean_b sum_g max(0, kept[b, g] - count / CR) / (num_groups * count)``.

    A hinge group is the whole model for the paper's global prior (``kept [batch, 1]``,
    ``count = n_l n_h n``) and one layer for App. G's local prior (``kept [batch, layers]``,
    ``count = n_h n``, ``num_groups = n_l``).

    Args:
        kept: ``[batch]`` or ``[batch, groups]``, ``sum(1 - alpha)`` of each sequence within each
            group (differentiable).
        count: decisions per sequence in one group.
        target_cr: the current target compression ratio (>= 1).
        num_groups: groups of the whole model (default: ``kept.shape[1]``); pass it when
            ``kept`` holds only some of them (a pipeline stage's layers), so the partial losses
            of all stages add up to the model's loss.

    Returns:
        A scalar tensor: the mean over the batch.
    """
    if target_cr < 1:
        raise ValueError(f"compression_loss: target_cr must be >= 1, got {target_cr}")
    kept = kept.reshape(kept.shape[0], -1)
    groups = kept.shape[1] if num_groups is None else num_groups
    hinge = torch.clamp(kept - count / target_cr, min=0)
    return hinge.sum(dim=1).mean() / (groups * count)


def head_cap_loss_from_sums(
    kept: torch.Tensor, count: float | int, head_cr_cap: float, num_groups: int
) -> torch.Tensor:
    """The per-head CR cap (not in the paper): ``mean_b sum_h max(0, count / cap - kept[b, h])
    / (num_groups * count)``, the mirror image of Eq. 10's hinge, which penalises each KV head
    of each sequence that keeps fewer than ``count / cap`` slots.

    Why: Eq. 10's global prior lets a head compress without limit, and measured on our 4x
    retrofits half the heads end at 250-512x: a DMC head that always merges is a running
    average of its whole context. The cap bounds how far any one head may compress while the
    global hinge still sets the model's CR. Same normalisation as
    :func:`compression_loss_from_sums`, so the two add up under one weight.

    Args:
        kept: ``[batch, heads]``, ``sum(1 - alpha)`` of each sequence for each head (any subset
            of the model's heads: a layer's, a tensor-parallel rank's).
        count: decisions per sequence per head (tokens).
        head_cr_cap: the largest CR a head may reach without penalty (> 1).
        num_groups: KV heads of the whole model, so partial losses add up to the model's.
    """
    if head_cr_cap <= 1:
        raise ValueError(f"head_cap_loss: head_cr_cap must be > 1, got {head_cr_cap}")
    hinge = torch.clamp(count / head_cr_cap - kept, min=0)
    return hinge.sum(dim=1).mean() / (num_groups * count)


def head_balance_loss(alpha: torch.Tensor, head_mean: torch.Tensor,
                      num_groups: int) -> torch.Tensor:
    """DMC-C's balance term (App. E, Eq. 13): ``mean_b sum_{h,t} |alpha[b, h, t] -
    head_mean[b, t]| / (num_groups * seq)``, which pulls every head's decision at each token
    towards the mean decision of its layer's heads, so that the heads of a layer compress alike.

    Deviation: Eq. 13 as printed subtracts the *sum* over the layer's heads,
    ``|alpha_lht - sum_h alpha_lht|``, which is smallest when every alpha is 0 (no merging at
    all) and so contradicts the text ("force all heads in a given layer to maintain a similar
    compression ratio"); we subtract the mean. Normalised like :func:`compression_loss_from_sums`
    (per sequence and decision), so the terms add up under one weight.

    Args:
        alpha: ``[batch, heads, seq]`` decisions of some of one layer's KV heads (a
            tensor-parallel rank's share, or all of them).
        head_mean: ``[batch, seq]`` the mean decision over all of that layer's KV heads.
        num_groups: KV heads of the whole model (``n_l n_h``), so partial losses add up to the
            model's.
    """
    deviation = (alpha - head_mean[:, None, :]).abs()
    return deviation.sum(dim=(1, 2)).mean() / (num_groups * alpha.shape[2])


def compression_loss(alpha: torch.Tensor, target_cr: float, prior: str = "global",
                     head_cr_cap: float | None = None,
                     head_balance_weight: float = 0.0) -> torch.Tensor:
    """Eq. 10 per sequence, averaged over the batch (plus :func:`head_cap_loss_from_sums`
    when ``head_cr_cap`` is set, and ``head_balance_weight`` times DMC-C's
    :func:`head_balance_loss` of every layer).

    ``prior="global"`` (the paper's default): the hinge on each sequence's kept slots summed over
    all layers, heads and tokens, which lets DMC compress some layers and heads more than others
    (the paper's Fig. 6). ``prior="local"`` (App. G, "Local Prior"): one hinge per layer, so every
    layer must reach the CR on its own.

    Args:
        alpha: merge probabilities ``[batch, layers, heads, seq]``.
        target_cr: the current target compression ratio (>= 1).
        prior: "global" or "local".
        head_cr_cap: None (the paper) or the per-head CR cap.
        head_balance_weight: 0 (DMC) or the weight of DMC-C's Eq. 13 (App. E).

    Returns:
        A scalar tensor (float32, float64 stays float64).
    """
    if prior not in PRIORS:
        raise ValueError(
            f"compression_loss: prior must be one of {', '.join(PRIORS)}, got {prior!r}"
        )
    work = torch.float64 if alpha.dtype == torch.float64 else torch.float32
    _, layers, heads, seq = alpha.shape
    kept_per_head = (1 - alpha.to(work)).sum(dim=3)  # [batch, layers, heads]
    kept = kept_per_head.sum(dim=2)  # [batch, layers]
    if prior == "global":
        loss = compression_loss_from_sums(kept.sum(dim=1), layers * heads * seq, target_cr)
    else:
        loss = compression_loss_from_sums(kept, heads * seq, target_cr)
    if head_cr_cap is not None:
        loss = loss + head_cap_loss_from_sums(kept_per_head.flatten(1), seq, head_cr_cap,
                                              layers * heads)
    if head_balance_weight:
        alpha = alpha.to(work)
        for layer in range(layers):
            loss = loss + head_balance_weight * head_balance_loss(
                alpha[:, layer], alpha[:, layer].mean(dim=1), layers * heads)
    return loss


@dataclass(frozen=True)
class CRSchedule:
    """Target CR annealed linearly from ``start_cr`` (1x) to ``target_cr`` over ``steps``
    steps counted from ``start_step``, constant afterwards (Sec. 4 "Training schedule", App. F;
    a model is usable at every intermediate CR along the way)."""

    target_cr: float
    steps: int
    start_step: int = 0
    start_cr: float = 1.0

    def __post_init__(self):
        if self.target_cr < 1 or self.start_cr < 1:
            raise ValueError(
                f"CRSchedule: target_cr and start_cr must be >= 1, got {self.target_cr}, "
                f"{self.start_cr}"
            )
        if self.steps < 0:
            raise ValueError(f"CRSchedule: steps must be >= 0, got {self.steps}")

    def __call__(self, step: int) -> float:
        """The target CR at ``step`` (a global training step)."""
        if self.steps == 0:
            return self.target_cr if step >= self.start_step else self.start_cr
        progress = min(max((step - self.start_step) / self.steps, 0.0), 1.0)
        return self.start_cr + (self.target_cr - self.start_cr) * progress
