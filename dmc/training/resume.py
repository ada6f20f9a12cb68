"""What a run may continue from: ``checkpoint.init_from`` compatibility, and the config drift
check when a run is resumed.

A resumed run must be the run its checkpoints were trained as. The fields that define it (the
model, data, seed, optimizer, schedule, DMC settings, precision, global batch) must equal the
checkpoint's, or the launch fails listing each difference; ``--allow-config-change`` accepts
them on purpose, and accepted ``optim.*`` / ``schedule.*`` values apply from the resumed step
(the LR schedule is rebuilt from the config at the checkpoint's step count, the optimizer keeps
the config's betas, eps and weight decay). Two stay refused even with the flag
(:data:`FIXED_ON_RESUME`): ``optim.trainable`` (the optimizer state covers another set of
parameters) and a ``schedule.zero_out_steps`` that moves the end of zero-out across the resumed
step of a DMC retrofit (the checkpoint's decision rows would be handed off, or not, against the
new plan). Fields that only change how the run is carried out (logging, save intervals,
output paths, the parallel layout that megatron reshards, the attention backend computing the
same math) may change between launches. The micro-batch size defines the run: the Gumbel noise
is drawn per micro-batch (keyed by its index) and the language-model loss is megatron's mean
over each micro-batch's loss-mask tokens, so another split of the same global batch trains
another way. Every accepted change is appended to ``<run_dir>/config_history.jsonl``.

``checkpoint.init_from`` (a shared zero-out phase) needs the seed, model, schedule, optimizer,
precision, batch shape and micro-batch size, and the fields that decide what zero-out trains:
the method and the channels it scales (``dmc.enabled``, ``dmc.method``, ``dmc.dms_decision``)
and the distillation loss. A DMC retrofit checkpoint past the end of zero-out has trained its
decisions, so every ``dmc.*`` training field (the target CR included; not the backends, which
compute the same math) must match too. The data path may differ (a data folder moved keeps its
runs).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from dmc.megatron.checkpoint import read_state
from dmc.training.config import ConfigError

INIT_FROM_SAME = ("seed", "model", "schedule", "optim", "precision", "data.seq_length",
                  "data.global_batch_size", "data.micro_batch_size", "dmc.enabled",
                  "dmc.method", "dmc.dms_decision", "distill")
MAY_CHANGE_ON_RESUME = ("run_dir", "logging", "checkpoint", "parallel", "data.cache_dir",
                        "dmc.attention_backend", "dmc.accumulate_backend",
                        "dmc.compile_elementwise")
HISTORY = "config_history.jsonl"
FIXED_ON_RESUME = {"optim.trainable": "the checkpoint's optimizer state covers another set of "
                                      "parameters"}


def flat_dict(tree: dict, prefix: str = "") -> dict:
    """``{"model": {"num_layers": 4}}`` -> ``{"model.num_layers": 4}``."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_dict(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def under(key: str, sections) -> bool:
    """Whether dotted ``key`` is one of ``sections`` or inside one."""
    return any(key == s or key.startswith(s + ".") for s in sections)


def check_init_from(path: Path, config: dict, kind: str) -> None:
    """Raises ValueError unless ``path`` (``checkpoint.init_from``) was written by a ``kind``
    run whose :data:`INIT_FROM_SAME` fields equal ``config``'s (a nested dict), so continuing
    from it is the same as having run those steps here."""
    state = read_state(path)
    if state.get("kind") != kind:
        raise ValueError(f"checkpoint.init_from {path} belongs to a {state.get('kind')} run, "
                         f"not {kind}")
    ours, theirs = flat_dict(config), flat_dict(state.get("config", {}))
    same = INIT_FROM_SAME
    zero_out_end = ours["schedule.zero_out_steps"]
    trained_decisions = (kind == "retrofit" and ours["dmc.enabled"]
                         and state.get("step", 0) > zero_out_end)
    if trained_decisions:
        same += ("dmc",)
    wrong = sorted(k for k in ours if under(k, same) and not under(k, MAY_CHANGE_ON_RESUME)
                   and theirs.get(k, ours[k]) != ours[k])
    if wrong:
        past = (f" (at step {state['step']}, past the end of zero-out at step {zero_out_end}: "
                f"it trained its decisions with its dmc settings)" if trained_decisions else "")
        raise ValueError(
            f"checkpoint.init_from {path} was written by a different run{past}: "
            + ", ".join(f"{k} is {ours[k]!r} here but {theirs[k]!r} there" for k in wrong))


def config_changes(saved: dict, current: dict) -> dict[str, tuple]:
    """``{key: (saved value, current value)}`` for every field that differs (nested dicts).
    Keys the saved config lacks (fields added by a later dmc) are not changes."""
    old, new = flat_dict(saved), flat_dict(current)
    return {k: (old[k], new.get(k)) for k in sorted(old) if old[k] != new.get(k)}


def fixed_fields(changes: dict[str, tuple], step: int, hands_off: bool) -> dict[str, str]:
    """``{field: why}`` for the ``changes`` (:func:`config_changes`) that a run resumed at
    ``step`` cannot take on, even with ``--allow-config-change``: :data:`FIXED_ON_RESUME`, and
    ``schedule.zero_out_steps`` when the run ``hands_off`` (a DMC retrofit zeroes its decision
    rows at the end of zero-out) and ``step`` lies between the old end and the new one."""
    fixed = {k: FIXED_ON_RESUME[k] for k in changes if k in FIXED_ON_RESUME}
    if hands_off and "schedule.zero_out_steps" in changes:
        old, new = changes["schedule.zero_out_steps"]
        if min(old, new) <= step < max(old, new):
            fixed["schedule.zero_out_steps"] = (
                f"the checkpoint at step {step} was trained with zero-out ending at step {old}, "
                f"so its decision rows {'were' if step >= old else 'were not'} handed off; "
                f"zero-out ending at step {new} would need the opposite")
    return fixed


def check_resume_config(saved: dict, current: dict, checkpoint: Path, run_dir: Path,
                        step: int, allow_change: bool, write: bool = True,
                        hands_off: bool = False) -> dict:
    """Compares the config a run resumes with (``current``) against the one its checkpoint was
    trained with (``saved``). Raises :class:`ConfigError` (exit code 2) listing every changed
    field that defines the run unless ``allow_change``, and every :func:`fixed_fields` one
    (``hands_off``: the run is a DMC retrofit) even then; records accepted changes in
    ``run_dir/config_history.jsonl`` when ``write``. Returns the changes."""
    changes = config_changes(saved, current)
    defining = {k: v for k, v in changes.items() if not under(k, MAY_CHANGE_ON_RESUME)}
    fixed = fixed_fields(defining, step, hands_off)
    if fixed:
        listed = "; ".join(f"{k}: {defining[k][0]!r} in the run, {defining[k][1]!r} now "
                           f"({why})" for k, why in fixed.items())
        raise ConfigError(
            f"the config differs from the one {checkpoint} was trained with in fields a resumed "
            f"run cannot change, even with --allow-config-change: {listed}. Set them back "
            f"or start a new run_dir")
    if defining and not allow_change:
        listed = "; ".join(f"{k}: {a!r} in the run, {b!r} now" for k, (a, b) in defining.items())
        raise ConfigError(
            f"the config differs from the one {checkpoint} was trained with: {listed}. "
            f"Resume with the run's own config ({Path(run_dir) / 'config.yaml'}), start a new "
            f"run_dir, or pass --allow-config-change to continue with the change (recorded in "
            f"{Path(run_dir) / HISTORY})")
    if changes and write:
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "step": step,
                  "checkpoint": str(checkpoint), "allowed_by_flag": bool(defining),
                  "changes": {k: list(v) for k, v in changes.items()}}
        with open(Path(run_dir) / HISTORY, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
    return changes
