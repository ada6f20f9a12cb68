"""Resuming a tiny retrofit after faults: a kill inside the phase copy, a damaged latest
checkpoint, a config that changed between launches, a checkpoint folder that moved."""
import json
import math
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
              "schedule": {"zero_out_steps": 2},
              "dmc": {"enabled": True, "method": "dmc", "target_cr": 2.0},
              "distill": {"weight": 0.0}}
    monkeypatch.setattr(resume, "read_state", lambda path: {"kind": "retrofit", "step": 2,
                                                            "config": theirs})
    ours = json.loads(json.dumps(theirs))
    ours["dmc"]["target_cr"] = 4.0
    resume.check_init_from("zero_out", ours, "retrofit")
    section, _, key = field.rpartition(".")
    (ours[section] if section else ours)[key] = value
    with pytest.raises(ValueError, match=f"{field} is {value!r} here"):
        resume.check_init_from("zero_out", ours, "retrofit")


@pytest.mark.parametrize("changes", [{"dmc.target_cr": 6.0, "dmc.c": 3.0, "dmc.tau": 0.5},
                                     {"dmc.window": 8, "dmc.prior": "local", "dmc.hard": True},
                                     {"dmc.cr_loss_weight": 10.0, "dmc.merge_delay": 2}])
def test_init_from_past_zero_out_needs_every_dmc_training_field(monkeypatch, changes):
    """A checkpoint past the end of zero-out trained its decisions with its DMC settings: each
    differing dmc field is named; the backends may differ. At the hand-off step (the shared
    zero-out folder) these may differ."""
    from dmc.training import resume
    from dmc.training.config import to_dict

    theirs = to_dict(load_config([], ["schedule.zero_out_steps=2"]))
    state = {"kind": "retrofit", "step": 3, "config": theirs}
    monkeypatch.setattr(resume, "read_state", lambda path: state)
    ours = json.loads(json.dumps(theirs))
    ours["dmc"]["attention_backend"] = "dense"
    resume.check_init_from("step_3", ours, "retrofit")
    for key, value in changes.items():
        ours["dmc"][key.split(".")[1]] = value
    with pytest.raises(ValueError, match="past the end of zero-out at step 2") as err:
        resume.check_init_from("step_3", ours, "retrofit")
    for key, value in changes.items():
        assert f"{key} is {value!r} here but {theirs['dmc'][key.split('.')[1]]!r} there" \
            in str(err.value)
    state["step"] = 2
    resume.check_init_from("zero_out", ours, "retrofit")


def _solidify_lr(lr, floor, solidify_start, solidify_steps, step):
    """The LR a retrofit uses at ``step``: ``lr`` until solidify, then cosine to ``floor``."""
    k = max(step - solidify_start, 0)
    return floor + 0.5 * (math.cos(math.pi * k / solidify_steps) + 1) * (lr - floor)


def test_accepted_optimizer_and_schedule_changes_apply_from_the_resumed_step(tiny_data,
                                                                             tmp_path):
    """--allow-config-change with a new LR, LR floor, solidify length, betas, eps and weight
    decay: every step after the resume uses the new schedule's LR and Adam uses the new
    hyperparameters, not the checkpoint's."""
    Trainer(_cfg(tiny_data, tmp_path), "retrofit").run(stop_after=2)
    new = {"optim.lr": 1e-3, "optim.min_lr_ratio": 0.5, "schedule.solidify_steps": 4,
           "optim.adam_beta1": 0.8, "optim.adam_beta2": 0.5, "optim.adam_eps": 1e-3,
           "optim.weight_decay": 0.05}
    resumed = Trainer(_cfg(tiny_data, tmp_path, **new), "retrofit", allow_config_change=True)
    assert resumed.step == 2
    steps = resumed.run()
    assert [r.step for r in steps] == list(range(2, 10))
    for r in steps:
        assert r.lr == pytest.approx(_solidify_lr(1e-3, 5e-4, 6, 4, r.step), rel=1e-9), r.step
    for group in resumed.optimizer.param_groups:
        assert tuple(group["betas"]) == (0.8, 0.5) and group["eps"] == 1e-3
        assert group["weight_decay"] == 0.05 * group["wd_mult"]
        assert (group["max_lr"], group["min_lr"]) == (1e-3, 5e-4)


@pytest.mark.parametrize("field,old,new,step", [
    ("optim.trainable", "all", "decisions", 2),
    ("schedule.zero_out_steps", 2, 4, 2),
    ("schedule.zero_out_steps", 4, 2, 3),
])
def test_changes_a_resume_cannot_honour_are_refused_even_with_the_flag(tmp_path, field, old,
                                                                       new, step):
    """The optimizer state of another parameter set; zero-out moved across the resumed step
    of a DMC retrofit (the hand-off would be missed or come twice). Zero-out moved with the
    resumed step before both ends, or after both, is accepted."""
    from dmc.training.resume import check_resume_config

    section, key = field.split(".")
    saved, current = {section: {key: old}}, {section: {key: new}}
    with pytest.raises(ConfigError, match=f"even with --allow-config-change: {field}: "):
        check_resume_config(saved, current, tmp_path, tmp_path, step, True, write=False,
                            hands_off=True)
    if section == "schedule":
        for fine in (min(old, new) - 1, max(old, new)):
            check_resume_config(saved, current, tmp_path, tmp_path, fine, True, write=False,
                                hands_off=True)
        check_resume_config(saved, current, tmp_path, tmp_path, step, True, write=False)


def test_a_checkpoint_dir_moved_away_from_the_runs_checkpoints_is_refused(tiny_data, tmp_path):
    """checkpoint.dir changed to an empty folder: the run would restart at step 0 and drop
    its metrics; refused naming checkpoint.dir. Once the checkpoints are moved there, the run
    resumes from them."""
    Trainer(_cfg(tiny_data, tmp_path), "retrofit").run(stop_after=3)
    metrics = (tmp_path / "metrics.jsonl").read_text()
    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(ConfigError, match=f"checkpoint.dir: {elsewhere} holds no checkpoint"):
        Trainer(_cfg(tiny_data, tmp_path, **{"checkpoint.dir": elsewhere}), "retrofit")
    assert (tmp_path / "metrics.jsonl").read_text() == metrics
    elsewhere.rmdir()
    shutil.move(tmp_path / "checkpoints", elsewhere)
    moved = Trainer(_cfg(tiny_data, tmp_path, **{"checkpoint.dir": elsewhere}), "retrofit")
    assert moved.step == 2


def test_a_kill_right_after_a_cr_checkpoint_is_renamed_keeps_its_heatmap(tiny_data, tmp_path,
                                                                        monkeypatch):
    """The CR heatmap is written into the checkpoint before its rename (and is listed in its
    manifest), so a kill just after the rename leaves it complete."""
    real = ckpt._replace_folder

    def killed_after(src, dst):
        real(src, dst)
        if dst.name.startswith("cr_"):
            raise KeyboardInterrupt("killed right after the rename")

    monkeypatch.setattr(ckpt, "_replace_folder", killed_after)
    with pytest.raises(KeyboardInterrupt):
        Trainer(_cfg(tiny_data, tmp_path), "retrofit").run()
    (folder,) = (tmp_path / "checkpoints").glob("cr_*")
    assert (folder / "cr_heatmap.png").stat().st_size > 1000
    assert "cr_heatmap.png" in json.loads((folder / ckpt.MANIFEST).read_text())["files"]
