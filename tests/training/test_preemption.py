"""SIGUSR1/SIGTERM stop a run after a checkpoint; the restarted run reproduces the losses of an
uninterrupted one."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dmc.megatron import checkpoint as ckpt
from dmc.training.config import load_config
from dmc.training.preemption import EXIT_PREEMPTED, StopSignal
from dmc.training.trainer import Trainer

from conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
SCHEDULE = {"schedule.zero_out_steps": 2, "schedule.retrofit_steps": 30,
            "schedule.solidify_steps": 8, "checkpoint.save_interval": 0,
            "logging.heatmap": False}


def _overrides(tiny_data, run_dir):
    return tiny_overrides(tiny_data, run_dir, **SCHEDULE)


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory):
    """Losses of the uninterrupted 40-step run."""
    run_dir = tmp_path_factory.mktemp("straight")
    results = Trainer(load_config([], _overrides(tiny_data, run_dir)), "retrofit").run()
    return [(r.step, r.lm_loss, r.cr_loss) for r in results]


def _assert_same(got, want):
    assert [s for s, _, _ in got] == [s for s, _, _ in want]
    for (step, lm, cr), (_, lm_want, cr_want) in zip(got, want):
        assert lm == pytest.approx(lm_want, abs=1e-6), step
        assert cr == pytest.approx(cr_want, abs=1e-6), step


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["usr1", "term"])
def test_signal_saves_checkpoint_and_resume_is_exact(tiny_data, tmp_path, straight, sig):
    cfg = load_config([], _overrides(tiny_data, tmp_path))
    trainer = Trainer(cfg, "retrofit")
    train_step = trainer.train_step

    def step_then_signal(step):
        result = train_step(step)
        if step == 4:  # arrives mid-run, as SLURM's warning would
            os.kill(os.getpid(), sig)
        return result

    trainer.train_step = step_then_signal
    first = trainer.run()
    assert trainer.preempted == sig.name
    assert [r.step for r in first] == list(range(5))
    assert ckpt.latest_checkpoint(tmp_path / "checkpoints").name == "step_0000005"
    assert signal.getsignal(sig) is signal.SIG_DFL  # handlers restored after the run

    resumed = Trainer(cfg, "retrofit")
    assert resumed.step == 5
    rest = resumed.run()
    assert resumed.preempted is None
    _assert_same([(r.step, r.lm_loss, r.cr_loss) for r in first + rest], straight)


def test_cli_exits_preempted_on_sigusr1_and_restart_finishes(tiny_data, tmp_path, straight):
    """The real path: ``dmc retrofit`` in its own process, SIGUSR1 from outside mid-run."""
    cmd = [sys.executable, "-m", "dmc.cli", "retrofit", *_overrides(tiny_data, tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 4):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "SIGUSR1 received: checkpoint saved" in err
    stopped = ckpt.read_state(ckpt.latest_checkpoint(tmp_path / "checkpoints"))["step"]
    assert 4 <= stopped < 40
    assert len(metrics.read_text().splitlines()) == stopped

    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {tmp_path / 'checkpoints' / f'step_{stopped:07d}'}" in again.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    got = [(r["step"], r["lm_loss"], r["cr_loss"]) for r in records]
    _assert_same(got, straight)


def test_a_signal_during_start_up_stops_before_the_first_step(tiny_data, tmp_path):
    """The CLI installs the handler before building the trainer: a SIGTERM that arrives while
    the model and data are built stops the run (exit 99) instead of killing it (143)."""
    cfg = load_config([], _overrides(tiny_data, tmp_path))
    with StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        trainer = Trainer(cfg, "retrofit")
        assert trainer.run(stop=stop) == []
    assert trainer.preempted == "SIGTERM" and trainer.step == 0
    assert ckpt.latest_checkpoint(tmp_path / "checkpoints") is None
