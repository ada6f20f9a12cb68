"""The compression-ratio loss and its schedule (Eq. 10 and Sec. 3.3 of the paper)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def compression_loss_from_sums(
    kept: torch.Tensor, count: float | int | torch.Tensor, target_cr: float
) -> torch.Tensor:
    """One-sided CR loss from the number of kept slots ``kept = sum(1 - alpha)`` over ``count``
    decisions: ``max(0, kept - count / CR) / count`` (Eq. 10)."""
    if target_cr < 1:
        raise ValueError(f"compression_loss: target_cr must be >= 1, got {target_cr}")
    return torch.clamp(kept - count / target_cr, min=0) / count


def compression_loss(alpha: torch.Tensor, target_cr: float) -> torch.Tensor:
    """``max(0, mean(1 - alpha) - 1 / CR)`` over every element of ``alpha`` (Eq. 10).

    Summing over layers, heads and tokens of the whole model before the hinge lets DMC compress
    some layers and heads more than others (the paper's Fig. 6).

    Args:
        alpha: merge probabilities of any shape, e.g. ``[layers, batch, heads, seq]``.
        target_cr: the current target compression ratio (>= 1).

    Returns:
        A scalar tensor (float32, float64 stays float64).
    """
    work = torch.float64 if alpha.dtype == torch.float64 else torch.float32
    kept = (1 - alpha.to(work)).sum()
    return compression_loss_from_sums(kept, alpha.numel(), target_cr)


@dataclass(frozen=True)
class CRSchedule:
    """Target CR annealed linearly from ``start_cr`` (1x) to ``target_cr`` over ``steps``
    steps counted from ``start_step``, constant afterwards (Sec. 3.3: a model is usable at every
    intermediate CR along the way)."""

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
