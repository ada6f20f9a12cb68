"""What a training run's metrics file (``<run_dir>/metrics.jsonl``, one JSON object per step with
``step``, ``phase``, ``target_cr``, ``measured_cr``) says about how fast it compressed."""
from __future__ import annotations

import json
from pathlib import Path


def steps_to_cr(metrics: Path | str, target_cr: float, fraction: float = 0.95,
                window: int = 10) -> int | None:
    """The first training step from which the measured CR, averaged over ``window`` consecutive
    logged steps, is at least ``fraction * target_cr``; None when the run never gets there.

    The per-step measured CR is that of one global batch (noisy, and the Gumbel noise of
    training lowers it), hence the running mean and the 5% tolerance. Steps count from the
    start of the run (the zero-out phase included), as the paper and the DMS paper count
    training steps."""
    rows = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "measured_cr" in r and "step" in r]
    crs = [float(r["measured_cr"]) for r in rows]
    for i in range(len(crs) - window + 1):
        if sum(crs[i:i + window]) / window >= fraction * target_cr:
            return int(rows[i]["step"])
    return None


def add_steps_to_cr(rows: list[dict], checkpoints) -> None:
    """Each trained DMC / DMS row of :func:`dmc.eval.compare.run_methods` whose ``path`` is one
    of ``checkpoints`` (``<run>/checkpoints/<phase>`` folders) gets ``steps_to_cr`` of its
    run's ``metrics.jsonl`` at its nominal CR (None when it never got there)."""
    runs = {str(path): Path(path).parents[1] for path in checkpoints}
    for r in rows:
        metrics = runs.get(r["path"], Path("-")) / "metrics.jsonl"
        if r["method"] == "dmc" and metrics.is_file():
            r["steps_to_cr"] = steps_to_cr(metrics, r["nominal_cr"])
