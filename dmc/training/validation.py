"""The checks that :func:`dmc.training.config.load_config` (and through it the sweep planner)
runs on a built :class:`~dmc.training.config.RunConfig`: each field's range, the folders a run
writes into, and the fields that must agree with each other. A bad value raises
:class:`ConfigError` naming the key and the accepted values.
"""
from __future__ import annotations

import os
from pathlib import Path

from dmc.megatron.config import ConfigError

RUN_CHOICES = {
    "precision": ("auto", "fp32", "bf16"),
    "logging.wandb_mode": ("offline", "online", "disabled"),
    "optim.trainable": ("all", "decisions"),
}
POSITIVE = {
    "data.seq_length", "data.micro_batch_size", "data.global_batch_size",
    "parallel.tensor", "parallel.pipeline", "optim.lr", "optim.decision_lr_mult",
    "optim.adam_eps", "dmc.cr_loss_weight", "distill.temperature",
    "logging.log_interval",
    "checkpoint.keep_last",
}
NON_NEGATIVE = {
    "schedule.pretrain_steps", "schedule.zero_out_steps", "schedule.retrofit_steps",
    "schedule.solidify_steps", "checkpoint.save_interval", "logging.eval_interval",
    "logging.eval_iters", "optim.weight_decay", "optim.clip_grad", "optim.warmup_steps",
}
# key: (low, high, closed): low <= value < high, or value <= high where closed
RANGES = {
    "optim.adam_beta1": (0, 1, False), "optim.adam_beta2": (0, 1, False),
    "optim.min_lr_ratio": (0, 1, True), "seed": (0, 2**32, False),  # numpy's seed range
}
FOLDERS = ("run_dir", "checkpoint.dir", "data.cache_dir")  # what a run creates and writes into


def validate(cfg, flat: dict) -> None:
    """Raises ConfigError for the first bad field of ``cfg`` (``flat``: its flattened dict)."""
    for key, choices in RUN_CHOICES.items():
        if flat[key] not in choices:
            raise ConfigError(f"{key}: {flat[key]!r} is not one of {', '.join(choices)}")
    for key in POSITIVE:
        if flat[key] is not None and flat[key] <= 0:
            raise ConfigError(f"{key}: must be > 0, got {flat[key]!r}")
    for key in NON_NEGATIVE:
        if flat[key] < 0:
            raise ConfigError(f"{key}: must be >= 0, got {flat[key]!r}")
    for key, (low, high, closed) in RANGES.items():
        if not (low <= flat[key] <= high if closed else low <= flat[key] < high):
            raise ConfigError(f"{key}: must be in [{low}, {high}{']' if closed else ')'}, got "
                              f"{flat[key]!r}")
    for key in FOLDERS:
        _check_folder(key, flat[key])
    if cfg.dmc.target_cr < 1:
        raise ConfigError(f"dmc.target_cr: must be >= 1, got {cfg.dmc.target_cr}")
    if cfg.dmc.head_cr_cap is not None and cfg.dmc.head_cr_cap < cfg.dmc.target_cr:
        raise ConfigError(f"dmc.head_cr_cap: {cfg.dmc.head_cr_cap} is below dmc.target_cr "
                          f"({cfg.dmc.target_cr}): no head could reach the target; use null "
                          f"or a cap >= the target")
    _validate_training_objective(cfg)
    model = cfg.model
    if cfg.dmc.cr_loss_grad == "decisions" and model.qk_layernorm:
        raise ConfigError("dmc.cr_loss_grad: 'decisions' reads k[..., -1] before a q/k norm, "
                          "which model.qk_layernorm adds; use 'model'")
    if model.params_dtype is not None:
        raise ConfigError(f"model.params_dtype: {model.params_dtype!r}; a run sets it from "
                          f"precision ({', '.join(RUN_CHOICES['precision'])}): leave it null")
    groups = model.kv_heads
    if groups % cfg.parallel.tensor:
        raise ConfigError(
            f"parallel.tensor ({cfg.parallel.tensor}) must divide model.num_query_groups ({groups})"
        )
    if model.num_layers % cfg.parallel.pipeline:
        raise ConfigError(
            f"parallel.pipeline ({cfg.parallel.pipeline}) must divide model.num_layers "
            f"({model.num_layers})"
        )
    if cfg.data.global_batch_size % cfg.data.micro_batch_size:
        raise ConfigError(
            f"data.global_batch_size ({cfg.data.global_batch_size}) must be a multiple of "
            f"data.micro_batch_size ({cfg.data.micro_batch_size})"
        )
    if cfg.data.seq_length > model.max_seq_length:
        raise ConfigError(
            f"data.seq_length ({cfg.data.seq_length}) exceeds model.max_seq_length "
            f"({model.max_seq_length})"
        )
    dmc = cfg.dmc
    if dmc.enabled and dmc.method == "dms" and dmc.dms_window >= cfg.data.seq_length - 1:
        raise ConfigError(
            f"dmc.dms_window ({dmc.dms_window}) must be < data.seq_length - 1 "
            f"({cfg.data.seq_length - 1}): a DMS key leaves the window dms_window tokens after "
            f"its decision, so no eviction would ever reach the LM loss; scale it down with the "
            f"context"
        )
    if dmc.enabled and dmc.merge_delay >= cfg.data.seq_length - 2:
        raise ConfigError(
            f"dmc.merge_delay ({dmc.merge_delay}) must be < data.seq_length - 2 "
            f"({cfg.data.seq_length - 2}): the first merged slot (keys 0 and 1) is seen from "
            f"position merge_delay + 2 on, so no query would see one"
        )


def _check_folder(key: str, path: str | None) -> None:
    """A folder that a run creates and writes into: refused where a file stands at ``path`` or
    at one of its parents, or where the folder exists and is not writable."""
    if path is None:
        return
    existing = next(p for p in (Path(path), *Path(path).parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}: cannot use {path!r}: {existing} is a file; expected a "
                          f"folder (or a path where one can be created)")
    if existing == Path(path) and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot use {path!r}: the folder is not writable")


def _validate_training_objective(cfg) -> None:
    """The ``distill`` section and ``optim.trainable``."""
    weight = cfg.distill.weight
    if not 0 <= weight <= 1:
        raise ConfigError(f"distill.weight: must be in [0, 1] (0 = LM loss only, 1 = KL only), "
                          f"got {weight!r}")
    if weight > 0 and not (cfg.distill.teacher or cfg.checkpoint.load_base):
        raise ConfigError(f"distill.weight is {weight} but there is no teacher: set "
                          f"distill.teacher to a checkpoint folder, or checkpoint.load_base "
                          f"(the default teacher)")
    if cfg.optim.trainable == "decisions" and not cfg.dmc.enabled:
        raise ConfigError("optim.trainable: decisions trains the decision rows of the DMC/DMS "
                          "layers, but dmc.enabled is false (the model has none); use all")
