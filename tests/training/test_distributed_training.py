"""Two gloo processes (``dmc retrofit --nproc 2``) at DP=2, TP=2 and PP=2 reproduce the
single-process tiny retrofit step by step (LM loss, CR loss, measured CR), and a checkpoint
written at TP=2 resumes at TP=1 (model and optimizer state resharded). DP=2 and PP=2 are
slow-marked (the fast suite keeps TP=2 here, and PP=2 / TP=2 of one DMC layer step in
tests/megatron/test_distributed.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
RETROFIT = {"schedule.zero_out_steps": 1, "schedule.retrofit_steps": 3,
            "schedule.solidify_steps": 1, "checkpoint.save_interval": 3,
            "checkpoint.keep_last": 5, "logging.heatmap": False}
LAYOUTS = {"dp2": [], "tp2": ["parallel.tensor=2"], "pp2": ["parallel.pipeline=2"]}

pytestmark = pytest.mark.distributed


def _dmc(*argv):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "dmc.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _metrics(run_dir):
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]
    return {r["step"]: r for r in records}


@pytest.fixture(scope="module")
def retrofit_args(tiny_data, tmp_path_factory):
    """Overrides of a 5-step retrofit (all three phases) from a 3-step pretrained base, so
    every layout starts from the same weights."""
    base = tmp_path_factory.mktemp("base")
    _dmc("pretrain", *tiny_overrides(tiny_data, base, **{"schedule.pretrain_steps": 3}))
    return lambda run_dir: tiny_overrides(
        tiny_data, run_dir, **RETROFIT, **{"checkpoint.load_base": base / "checkpoints/pretrain"})


@pytest.fixture(scope="module")
def reference(retrofit_args, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    _dmc("retrofit", *retrofit_args(run_dir))
    return _metrics(run_dir)


@pytest.fixture(scope="module")
def layout_runs(retrofit_args, tmp_path_factory):
    """Run folders of the two-process layouts, run on first use."""
    runs = {}

    def get(name):
        if name not in runs:
            runs[name] = tmp_path_factory.mktemp(name)
            _dmc("retrofit", "--nproc", "2", *retrofit_args(runs[name]), *LAYOUTS[name])
        return runs[name]

    return get


def _assert_matches(got, want, steps):
    for step in steps:
        for key in ("lm_loss", "cr_loss", "measured_cr", "target_cr"):
            assert got[step][key] == pytest.approx(want[step][key], abs=1e-5), (step, key)


@pytest.mark.parametrize("layout", [pytest.param("dp2", marks=pytest.mark.slow), "tp2",
                                    pytest.param("pp2", marks=pytest.mark.slow)])
def test_two_processes_match_single_process(layout, layout_runs, reference):
    assert [r["phase"] for r in reference.values()] == [
        "zero_out", "retrofit", "retrofit", "retrofit", "solidify"]
    assert max(r["cr_loss"] for r in reference.values()) > 0.05  # the hinge is active
    assert max(r["measured_cr"] for r in reference.values()) > 1.2
    run_dir = layout_runs(layout)
    _assert_matches(_metrics(run_dir), reference, range(5))
    state = json.loads((run_dir / "checkpoints/solidify/state.json").read_text())
    assert (state["tp"], state["pp"]) == {"dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}[layout]


def test_tp2_checkpoint_resumes_at_tp1(layout_runs, retrofit_args, reference, tmp_path):
    source = layout_runs("tp2") / "checkpoints/step_0000003"
    proc = _dmc("retrofit", *retrofit_args(tmp_path), f"checkpoint.init_from={source}")
    assert "written at TP=2 PP=1, resharded to TP=1 PP=1" in proc.stderr
    got = _metrics(tmp_path)
    assert sorted(got) == [3, 4]
    _assert_matches(got, reference, [3, 4])  # step 4 follows an Adam step on loaded moments
