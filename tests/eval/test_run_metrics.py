import json

import pytest

from dmc.eval.run_metrics import steps_to_cr


def _write(path, crs, steps=None):
    steps = range(len(crs)) if steps is None else steps
    path.write_text("".join(json.dumps({"step": step, "phase": "retrofit", "measured_cr": cr,
                                        "target_cr": 4.0}) + "\n" for step, cr in zip(steps, crs))
                    + json.dumps({"run_dir": "x", "valid_ppl": 1.0}) + "\n")
    return path


def _slow_reference(crs, target, fraction, window):
    for start in range(len(crs)):
        chunk = crs[start:start + window]
        if len(chunk) == window and sum(chunk) / window >= fraction * target:
            return start
    return None


@pytest.mark.parametrize("seed", range(5))
def test_steps_to_cr_is_the_first_window_at_the_target(tmp_path, seed):
    import random

    rng = random.Random(seed)
    crs = [1 + 3.5 * i / 80 + rng.uniform(-0.4, 0.4) for i in range(100)]
    got = steps_to_cr(_write(tmp_path / "m.jsonl", crs), 4.0, 0.95, 10)
    assert got == _slow_reference(crs, 4.0, 0.95, 10)
    assert got is not None and 50 < got < 100


def test_a_run_that_never_gets_there_is_none(tmp_path):
    assert steps_to_cr(_write(tmp_path / "m.jsonl", [1.0, 2.0, 3.0] * 10), 4.0) is None
    # one lucky batch is not enough: the mean over the window must reach the target
    assert steps_to_cr(_write(tmp_path / "n.jsonl", [1.0] * 20 + [8.0] + [1.0] * 20), 4.0) is None


def test_add_steps_to_cr_marks_the_trained_rows_only(tmp_path):
    from dmc.eval.run_metrics import add_steps_to_cr

    run = tmp_path / "dmc4-abc"
    run.mkdir()
    _write(run / "metrics.jsonl", [1.0] * 5 + [4.0] * 20)
    final = run / "checkpoints" / "solidify"
    rows = [{"method": "dmc", "path": str(final), "nominal_cr": 4.0},
            {"method": "dmc", "path": str(tmp_path / "other"), "nominal_cr": 4.0},
            {"method": "policy", "path": None, "nominal_cr": 4.0}]
    add_steps_to_cr(rows, [final])
    assert rows[0]["steps_to_cr"] == 5
    assert "steps_to_cr" not in rows[1] and "steps_to_cr" not in rows[2]


@pytest.mark.parametrize("seed", range(3))
def test_steps_to_cr_reports_the_logged_step_not_the_row(tmp_path, seed):
    """A resumed run logged every 10 steps from step 500: the answer is the logged ``step`` of
    the window's first row (the slow reference's row mapped through the log), not its index."""
    import random

    rng = random.Random(seed)
    crs = [1 + 3.5 * i / 80 + rng.uniform(-0.4, 0.4) for i in range(100)]
    steps = [500 + 10 * i for i in range(100)]
    got = steps_to_cr(_write(tmp_path / "m.jsonl", crs, steps), 4.0, 0.95, 10)
    start = _slow_reference(crs, 4.0, 0.95, 10)
    assert start is not None and got == steps[start]


def test_a_run_exactly_at_the_target_counts_from_its_first_step(tmp_path):
    """The window's mean need only reach (>=) fraction * target: a run whose CR is exactly the
    target, fraction 1.0, is there from its first logged step."""
    path = _write(tmp_path / "m.jsonl", [4.0] * 12, [30 + 2 * i for i in range(12)])
    assert steps_to_cr(path, 4.0, fraction=1.0, window=10) == 30
