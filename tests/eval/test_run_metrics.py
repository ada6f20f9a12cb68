import json

import pytest

from dmc.eval.run_metrics import steps_to_cr


def _write(path, crs):
    path.write_text("".join(json.dumps({"step": i, "phase": "retrofit", "measured_cr": cr,
                                        "target_cr": 4.0}) + "\n" for i, cr in enumerate(crs))
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
