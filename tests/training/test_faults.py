"""Fault injection: a tiny ``dmc retrofit`` killed with SIGKILL at random moments (start-up, steps,
saves, phase copies), relaunched after each kill, ends with the uninterrupted run's losses and
with every phase and CR checkpoint complete and loadable."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dmc.megatron import checkpoint as ckpt
from dmc.training.config import load_config
from dmc.training.trainer import Trainer

from conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
SCHEDULE = {"schedule.zero_out_steps": 3, "schedule.retrofit_steps": 12,
            "schedule.solidify_steps": 5, "checkpoint.save_interval": 2,
            "checkpoint.keep_last": 1, "logging.log_interval": 1, "dmc.target_cr": 3.0,
            "optim.lr": 1e-2}
KILLS = 20


def _launch(tiny_data, run_dir):
    cmd = [sys.executable, "-m", "dmc.cli", "retrofit",
           *tiny_overrides(tiny_data, run_dir, **SCHEDULE)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["lm_loss"], r["cr_loss"]) for r in records]


def _lines(path):
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _wait_for_progress(proc, metrics, before, timeout=300):
    """Until ``metrics`` has more than ``before`` lines (training runs) or ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while _lines(metrics) <= before and proc.poll() is None:
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.01)


@pytest.mark.slow
def test_twenty_random_kills_lose_nothing(tiny_data, tmp_path):
    straight = _launch(tiny_data, tmp_path / "straight")
    _wait_for_progress(straight, tmp_path / "straight" / "metrics.jsonl", 0)
    started = time.monotonic()
    assert straight.wait(timeout=300) == 0, straight.stderr.read()[-3000:]
    training = time.monotonic() - started  # from the first step to the exit

    run_dir, rng, kills, finished = tmp_path / "killed0", random.Random(0), 0, []
    while kills < KILLS:
        metrics = run_dir / "metrics.jsonl"
        proc = _launch(tiny_data, run_dir)
        if rng.random() < 0.2:  # during start-up (imports, model, data, checkpoint loading)
            time.sleep(rng.uniform(0.5, 3.0))
        else:  # during training: steps, saves, CR checkpoints, phase copies, the final save
            _wait_for_progress(proc, metrics, _lines(metrics))
            time.sleep(rng.uniform(0, training))
        if proc.poll() is not None:  # finished before the kill: go on in a fresh run
            assert proc.returncode == 0, proc.stderr.read()[-3000:]
            finished.append(run_dir)
            run_dir = tmp_path / f"killed{kills}-{len(finished)}"
            continue
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    final = _launch(tiny_data, run_dir)
    assert final.wait(timeout=300) == 0, final.stderr.read()[-3000:]
    finished.append(run_dir)

    want = _losses(tmp_path / "straight")
    assert [s for s, _, _ in want] == list(range(20))
    folders = sorted(p.name for p in (tmp_path / "straight" / "checkpoints").iterdir())
    assert {"zero_out", "retrofit", "solidify", "cr_1.5"} <= set(folders)
    loader = Trainer(load_config([], tiny_overrides(tiny_data, tmp_path / "load", **SCHEDULE)),
                     "retrofit")
    for run in finished:
        got = _losses(run)
        assert [s for s, _, _ in got] == [s for s, _, _ in want], run
        for (step, lm, cr), (_, lm_want, cr_want) in zip(got, want):
            assert (lm, cr) == pytest.approx((lm_want, cr_want), abs=1e-6), (run, step)
        root = run / "checkpoints"
        assert sorted(p.name for p in root.iterdir()) == folders, run
        for name in folders:
            if name != ckpt.LATEST:
                assert ckpt.verify_checkpoint(root / name), (run, name)
                ckpt.load_checkpoint(root / name, loader.module)
