"""Resuming a tiny retrofit after faults: a kill inside the phase copy, a damaged latest
checkpoint, a config that changed between launches."""
import json
import shutil

import pytest

from dmc.megatron import checkpoint as ckpt
from dmc.training.config import ConfigError, load_config
from dmc.training.trainer import Trainer

from conftest import tiny_overrides

SCHEDULE = {"schedule.zero_out_steps": 2, "schedule.retrofit_steps": 4,
            "schedule.solidify_steps": 2, "checkpoint.save_interval": 2,
            "checkpoint.keep_last": 1, "logging.log_interval": 1}


def _cfg(tiny_data, run_dir, **extra):
    return load_config([], tiny_overrides(tiny_data, run_dir, **{**SCHEDULE, **extra}))


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory):
    return [r.lm_loss for r in Trainer(_cfg(tiny_data, tmp_path_factory.mktemp("a")),
                                       "retrofit").run()]


def test_a_kill_inside_the_phase_copy_is_repaired_on_resume(tiny_data, tmp_path, monkeypatch,
                                                            straight):
    real_copytree = shutil.copytree

    def killed_midway(src, dst, **kw):
        if src.name == "step_0000006":  # the copy into checkpoints/retrofit
            (dst / "partial").mkdir(parents=True)
            raise KeyboardInterrupt("killed during the phase copy")
        return real_copytree(src, dst, **kw)

    monkeypatch.setattr(shutil, "copytree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        Trainer(_cfg(tiny_data, tmp_path), "retrofit").run()
    root = tmp_path / "checkpoints"
    assert not (root / "retrofit").exists() and ckpt.is_complete(root / "step_0000006")
    monkeypatch.setattr(shutil, "copytree", real_copytree)
    resumed = Trainer(_cfg(tiny_data, tmp_path), "retrofit")
    assert resumed.step == 6 and ckpt.verify_checkpoint(root / "retrofit")
    tail = resumed.run()
    assert [r.lm_loss for r in tail] == straight[6:]
    for phase in ("zero_out", "retrofit", "solidify"):
        fresh = Trainer(_cfg(tiny_data, tmp_path / "load", **{"schedule.zero_out_steps": 0}),
                        "retrofit")
        ckpt.load_checkpoint(root / phase, fresh.module)
    assert not list(root.glob("*.tmp"))


def test_damaged_latest_falls_back_and_resumes_exactly(tiny_data, tmp_path, straight):
    Trainer(_cfg(tiny_data, tmp_path), "retrofit").run(stop_after=5)
    root = tmp_path / "checkpoints"
    assert (root / ckpt.LATEST).read_text() == "step_0000004"
    shard = next(p for p in sorted((root / "step_0000004").rglob("*.distcp")))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4096] = bytes(4096)
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"step_0000004/.*\.distcp: contents changed"):
        Trainer(_cfg(tiny_data, tmp_path, **{"checkpoint.fallback": False}), "retrofit")
    with pytest.warns(UserWarning, match=r"step_0000004.*resuming from .*(zero_out|cr_)"):
        resumed = Trainer(_cfg(tiny_data, tmp_path), "retrofit")
    start = resumed.step
    assert 2 <= start <= 4
    assert [r.lm_loss for r in resumed.run()] == straight[start:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(8))  # step 4, logged before the kill, once


def test_config_drift_is_refused_allowed_with_the_flag_and_recorded(tiny_data, tmp_path):
    Trainer(_cfg(tiny_data, tmp_path), "retrofit").run(stop_after=2)
    with pytest.raises(ConfigError) as err:
        Trainer(_cfg(tiny_data, tmp_path, **{"dmc.target_cr": 4.0, "seed": 7,
                                             "optim.lr": 1e-3}), "retrofit")
    for text in ("dmc.target_cr: 2.0 in the run, 4.0 now", "seed: 1234 in the run, 7 now",
                 "optim.lr", "--allow-config-change"):
        assert text in str(err.value)
    with pytest.raises(ConfigError, match="data.micro_batch_size: 2 in the run, 1 now"):
        Trainer(_cfg(tiny_data, tmp_path, **{"data.micro_batch_size": 1}), "retrofit")
    history = tmp_path / "config_history.jsonl"
    assert not history.exists()
    assert "target_cr: 2.0" in (tmp_path / "config.yaml").read_text()

    Trainer(_cfg(tiny_data, tmp_path, **{"logging.log_interval": 5}), "retrofit")
    allowed = Trainer(_cfg(tiny_data, tmp_path, **{"dmc.target_cr": 4.0}), "retrofit",
                      allow_config_change=True)
    assert allowed.step == 2
    records = [json.loads(line) for line in history.read_text().splitlines()]
    assert records[0]["changes"] == {"logging.log_interval": [1, 5]}
    assert not records[0]["allowed_by_flag"]
    assert records[1]["changes"] == {"dmc.target_cr": [2.0, 4.0]} and records[1]["allowed_by_flag"]
    assert "target_cr: 4.0" in (tmp_path / "config.yaml").read_text()


@pytest.mark.parametrize("field,value", [("dmc.method", "dms"), ("dmc.enabled", False),
                                         ("distill.weight", 0.5), ("seed", 7),
                                         ("precision", "bf16"), ("data.micro_batch_size", 1)])
def test_init_from_refuses_a_run_whose_zero_out_trained_otherwise(monkeypatch, field, value):
    """A shared zero-out phase (checkpoint.init_from) is refused from a run of another method,
    a control, a distillation run or another seed; the target CR may differ."""
    from dmc.training import resume

    theirs = {"seed": 1234, "precision": "auto", "data": {"micro_batch_size": 2},
              "dmc": {"enabled": True, "method": "dmc", "target_cr": 2.0},
              "distill": {"weight": 0.0}}
    monkeypatch.setattr(resume, "read_state", lambda path: {"kind": "retrofit",
                                                            "config": theirs})
    ours = json.loads(json.dumps(theirs))
    ours["dmc"]["target_cr"] = 4.0
    resume.check_init_from("zero_out", ours, "retrofit")
    section, _, key = field.rpartition(".")
    (ours[section] if section else ours)[key] = value
    with pytest.raises(ValueError, match=f"{field} is {value!r} here"):
        resume.check_init_from("zero_out", ours, "retrofit")
