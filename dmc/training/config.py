"""Typed run configuration: dataclasses loaded from YAML files plus dotted overrides.

``load_config(["configs/models/tiny.yaml", "configs/retrofit/cr2.yaml"], ["optim.lr=1e-4"])``
merges the files left to right, applies the overrides, and validates every field
(:mod:`dmc.training.validation`): an unknown key or a bad value raises :class:`ConfigError`
naming the key and the accepted values.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dmc.megatron.config import (
    DMC_CHOICES,
    METHODS,
    ConfigError,
    DMCConfig,
    ModelConfig,
    check_type,
)
from dmc.training.validation import RUN_CHOICES, validate

__all__ = ["ConfigError", "DMCSection", "DistillConfig", "ModelConfig", "RunConfig",
           "dump_config", "flatten", "load_config", "parse_override", "to_dict"]


@dataclass
class DataConfig:
    """A folder written by ``dmc data prepare`` and the batch shape. ``cache_dir``: where
    megatron writes its sample-index cache (null = ``cache/`` inside ``path``; set it when the
    data folder is read-only)."""

    path: str = "data/shakespeare"
    seq_length: int = 256
    micro_batch_size: int = 8
    global_batch_size: int = 8
    cache_dir: str | None = None


@dataclass
class OptimConfig:
    """AdamW as in the paper's Llama-2 recipe; ``min_lr_ratio`` is the solidify floor.
    ``decision_lr_mult``: the DMC decision rows' update is multiplied by it during the retrofit
    and solidify phases (:mod:`dmc.training.decision_lr`; 1.0 = the paper).
    ``trainable``: ``all`` trains every weight (the paper); ``decisions`` trains only the rows
    of ``linear_qkv`` that produce the borrowed decision channels of the DMC/DMS layers
    (adapter-only, Model-Optimizer's DMS default); every other weight stays bit-identical
    (:mod:`dmc.training.adapter`)."""

    lr: float = 3e-5
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-5
    clip_grad: float = 1.0
    warmup_steps: int = 0
    decision_lr_mult: float = 1.0
    trainable: str = "all"


@dataclass
class DistillConfig:
    """Logit distillation from the frozen original model (:mod:`dmc.training.distill`):
    loss = (1 - weight) * LM + weight * temperature^2 * KL(p_teacher || p_student) per token,
    p = softmax(logits / temperature), both terms token means over the loss mask (forward KL;
    the T^2 keeps the gradient's scale independent of T, 1 at the default T = 1).
    ``weight``: in [0, 1]; 0 = no distillation (no teacher is built). ``teacher``: a checkpoint
    folder (null = ``checkpoint.load_base``, the model being retrofitted); its architecture is
    read from the checkpoint (a GQA student's teacher is the MHA base), it runs vanilla
    attention, frozen and in eval mode, with the run's tensor/pipeline split, and is never
    saved in the run's checkpoints."""

    weight: float = 0.0
    teacher: str | None = None
    temperature: float = 1.0


@dataclass
class ScheduleConfig:
    """Steps per phase. ``pretrain`` (tiny demo base only) has its own run; a retrofit runs
    zero_out -> retrofit (target CR annealed 1 -> CR, constant LR) -> solidify (CR fixed,
    cosine LR to ``min_lr_ratio``)."""

    pretrain_steps: int = 0
    zero_out_steps: int = 250
    retrofit_steps: int = 6000
    solidify_steps: int = 2000


@dataclass
class DMCSection(DMCConfig):
    """The model's DMC settings (:class:`dmc.megatron.config.DMCConfig`, Sec. 4 of the paper)
    plus how a run trains them. ``enabled: false`` makes ``dmc retrofit`` a vanilla-attention
    up-training with the same steps and LR schedule (the GQA baseline); ``target_cr``: the CR
    that phase 1 anneals to; ``cr_loss_weight``: the CR loss's weight against the LM loss
    (Eq. 11 and NVIDIA's code: 1; a small model whose few heads each matter more to the LM loss
    may need more to follow the annealed target within a short budget; say so where you set it)."""

    enabled: bool = True
    target_cr: float = 2.0
    cr_loss_weight: float = 1.0

    def model_settings(self) -> DMCConfig:
        """The :class:`DMCConfig` part (what the model and its checkpoints hold)."""
        return DMCConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(DMCConfig)})


@dataclass
class CheckpointConfig:
    """``dir`` null = ``<run_dir>/checkpoints``; ``load_base`` = a base checkpoint folder
    (e.g. a pretrain run or a converted HF model) that a fresh run starts from (weights only: a
    retrofit's base, or the previous stage of a pretraining at a longer context); ``init_from`` =
    a checkpoint of another run with the same model and schedule (e.g. a shared ``zero_out``
    phase) that a fresh run continues from: weights, optimizer state, LR schedule and step. A
    run's own ``latest`` checkpoint takes precedence over both. ``fallback``: when ``latest``
    fails verification on resume, continue from the newest checkpoint that verifies (with a
    warning) instead of stopping."""

    dir: str | None = None
    save_interval: int = 500
    save_at_cr_crossings: bool = True
    load_base: str | None = None
    init_from: str | None = None
    keep_last: int = 2
    fallback: bool = True


@dataclass
class LoggingConfig:
    log_interval: int = 1
    eval_interval: int = 0
    eval_iters: int = 4
    progress_bar: bool = True
    wandb: bool = False
    wandb_project: str = "dmc"
    wandb_mode: str = "offline"
    heatmap: bool = True


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1


@dataclass
class RunConfig:
    """Everything one ``dmc pretrain`` / ``dmc retrofit`` run needs."""

    run_dir: str = "runs/default"
    seed: int = 1234
    precision: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    dmc: DMCSection = field(default_factory=DMCSection)
    distill: DistillConfig = field(default_factory=DistillConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


# every field with a fixed set of values; the model and dmc sections check theirs when built
CHOICES = dict(RUN_CHOICES, **{f"dmc.{name}": c for name, c in DMC_CHOICES.items()},
               **{"dmc.method": METHODS})


def _build(cls, values: dict, prefix: str = ""):
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(map(str, set(values) - set(fields)))  # YAML keys may be numbers
    if unknown:
        raise ConfigError(
            f"unknown key {prefix}{unknown[0]}; accepted keys under "
            f"{prefix.rstrip('.') or 'the top level'}: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in values.items():
        key = prefix + name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, key + ".")
        else:
            kwargs[name] = check_type(key, value, hint)
    return cls(**kwargs)


def flatten(cfg) -> dict:
    """``{"model.num_layers": 4, ...}`` for a config dataclass."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update({f"{f.name}.{k}": v for k, v in flatten(value).items()})
        else:
            out[f.name] = value
    return out


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _set_dotted(tree: dict, key: str, value) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _merge(base: dict, update: dict) -> dict:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def parse_override(text: str) -> tuple[str, object]:
    """``"optim.lr=1e-5"`` -> ``("optim.lr", 1e-05)`` (values parsed as YAML scalars)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. optim.lr=1e-5")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: the value is not a YAML scalar "
                          f"({str(err).splitlines()[0]})") from None
    if isinstance(value, str) and raw.strip().lower() in {"none", "null", "~"}:
        value = None
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    return key.strip(), value


def load_config(paths=(), overrides=(), base: dict | None = None) -> RunConfig:
    """Merges YAML files (left to right) and dotted overrides into a validated RunConfig."""
    tree = dict(base or {})
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise ConfigError(f"--config {path}: not valid YAML ({' '.join(str(err).split())})"
                              ) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {path}: expected a YAML mapping at the top level")
        _merge(tree, loaded)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    cfg = _build(RunConfig, tree)
    validate(cfg, flatten(cfg))
    return cfg


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
