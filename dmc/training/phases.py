"""Where a global step falls in the DMC schedule (Sec. 3.3 of the paper and NVIDIA's recipe).

A retrofit run's steps are laid end to end: ``zero_out`` [0, Z) scales the decision channels by
1 - t/Z then zeroes their weight rows; ``retrofit`` [Z, Z+R) anneals the target CR linearly from
1 to CR at constant LR; ``solidify`` [Z+R, Z+R+S) holds the CR while the LR decays (cosine) to
``min_lr_ratio``. A pretrain run (tiny demo base only) is plain ``vanilla`` training. A retrofit
run with ``dmc.enabled: false`` (the GQA baseline's up-training, Table 1 of the paper) trains
vanilla attention for the same steps: ``uptrain`` [0, Z+R) at constant LR, then ``solidify``.
"""
from __future__ import annotations

from dataclasses import dataclass

from dmc.ops import CRSchedule
from dmc.training.config import ConfigError, RunConfig

RETROFIT_PHASES = ("zero_out", "retrofit", "solidify")


@dataclass(frozen=True)
class StepPlan:
    phase: str
    mode: str
    target_cr: float
    zero_out_scale: float


class PhasePlan:
    """Step ranges of a run kind (``pretrain`` or ``retrofit``); ``dmc`` tells whether the
    run trains DMC decisions (a retrofit with ``dmc.enabled``)."""

    def __init__(self, cfg: RunConfig, kind: str):
        if kind not in ("pretrain", "retrofit"):
            raise ValueError(f"run kind must be pretrain or retrofit, got {kind!r}")
        s = cfg.schedule
        self.kind = kind
        self.dmc = kind == "retrofit" and cfg.dmc.enabled
        if kind == "pretrain":
            self.ranges = {"pretrain": (0, s.pretrain_steps)}
        elif not self.dmc:
            z = s.zero_out_steps + s.retrofit_steps
            self.ranges = {"uptrain": (0, z), "solidify": (z, z + s.solidify_steps)}
        else:
            z, r = s.zero_out_steps, s.retrofit_steps
            self.ranges = {
                "zero_out": (0, z),
                "retrofit": (z, z + r),
                "solidify": (z + r, z + r + s.solidify_steps),
            }
        self.total_steps = max(end for _, end in self.ranges.values())
        if not self.total_steps:
            fields = ("schedule.pretrain_steps" if kind == "pretrain" else
                      "schedule.zero_out_steps + retrofit_steps + solidify_steps")
            raise ConfigError(f"the {kind} run has no steps: {fields} is 0; set it >= 1")
        start, end = self.ranges.get("retrofit", (0, 0))
        self.cr_schedule = CRSchedule(cfg.dmc.target_cr, end - start, start_step=start)

    def phase_of(self, step: int) -> str:
        for name, (start, end) in self.ranges.items():
            if start <= step < end:
                return name
        raise ValueError(f"step {step} is outside the run (0..{self.total_steps - 1})")

    def target_cr(self, step: int) -> float:
        """CR after ``step`` (0-based): the last retrofit step reaches the target."""
        if not self.dmc or step < self.ranges["retrofit"][0]:
            return 1.0
        return self.cr_schedule(step + 1)

    def at(self, step: int) -> StepPlan:
        phase = self.phase_of(step)
        if not self.dmc:
            return StepPlan(phase, "vanilla", 1.0, 1.0)
        if phase == "zero_out":
            start, end = self.ranges["zero_out"]
            return StepPlan(phase, "zero_out", 1.0, 1.0 - (step - start) / (end - start))
        return StepPlan(phase, "train", self.target_cr(step), 0.0)

    def phase_end(self, phase: str) -> int:
        if phase not in self.ranges:
            raise ValueError(f"phase must be one of {', '.join(self.ranges)}, got {phase!r}")
        return self.ranges[phase][1]
