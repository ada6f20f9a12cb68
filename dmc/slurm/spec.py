"""The sweep YAML (``configs/sweeps/*.yaml``) as validated dataclasses.

```yaml
name: llama2-7b-cr                # run folder: <output>/<name>
output: runs/sweeps
recipe: configs/retrofit/cr4.yaml # DMC recipe ({cr} its only placeholder); sets dmc.target_cr
target_crs: [2, 3, 4]
seeds: [1234]
models:
  - preset: configs/models/llama2-7b.yaml
    base_checkpoint: checkpoints/llama2-7b
gqa_factors: [2, 4]               # GQA baselines: num_query_groups = groups / factor
gqa_recipe: configs/retrofit/gqa{factor}.yaml
overrides: [data.path=data/redpajama]   # not the keys of PLANNER_KEYS
slurm: {nodes: 4, gpus_per_node: 8, time: "24:00:00", ...}
```
An unknown key or a bad value raises :class:`SweepError` naming the key and what it accepts.
"""
from __future__ import annotations

import dataclasses
import re
import string
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class SweepError(ValueError):
    """A bad sweep file."""


@dataclass
class ModelEntry:
    """A model preset and the converted base checkpoint a retrofit starts from. ``name``
    (default: the preset's file stem) names the model in job and run names."""

    preset: str
    base_checkpoint: str
    name: str | None = None


@dataclass
class SlurmSpec:
    """Resources of the training jobs (``convert_*`` for the one-GPU GQA conversion jobs).
    ``container_image``/``container_mounts`` turn on pyxis; ``extra_sbatch`` lines are added
    as ``#SBATCH`` options; ``setup`` lines run before ``srun`` (modules, environment)."""

    nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_task: int = 16
    time: str = "04:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    container_image: str | None = None
    container_mounts: str | None = None
    python: str | None = None
    extra_sbatch: list = field(default_factory=list)
    setup: list = field(default_factory=list)
    convert_time: str = "01:00:00"


@dataclass
class SweepSpec:
    name: str
    models: list
    recipe: str = "configs/retrofit/cr2.yaml"
    target_crs: list = field(default_factory=list)
    seeds: list = field(default_factory=lambda: [1234])
    gqa_factors: list = field(default_factory=list)
    gqa_recipe: str = "configs/retrofit/gqa{factor}.yaml"
    overrides: list = field(default_factory=list)
    output: str = "runs/sweeps"
    slurm: SlurmSpec = field(default_factory=SlurmSpec)


TIME = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$")
NAME = re.compile(r"[A-Za-z0-9._-]+")
# Keys the planner sets per job (each chain's run_dir, checkpoints, seed, CR, KV heads): an
# override of one would put every chain on the same value.
PLANNER_KEYS = ("checkpoint.dir", "checkpoint.init_from", "checkpoint.load_base", "run_dir",
                "seed", "dmc.target_cr", "dmc.enabled", "model.num_query_groups")


def _fields(cls, values, where: str) -> dict:
    if not isinstance(values, dict):
        raise SweepError(f"{where}: expected a mapping, got {values!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        prefix = "" if where == "sweep" else where + "."
        raise SweepError(f"unknown key {prefix}{unknown[0]}; accepted keys"
                         f"{'' if where == 'sweep' else ' under ' + where}: {', '.join(names)}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in values]
    if missing:
        raise SweepError(f"{where}: missing required key {missing[0]}")
    return dict(values)


def _typed(key: str, value, kind, allow_none: bool = False):
    if value is None and allow_none:
        return None
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if not ok:
        names = {str: "a string", int: "an integer", float: "a number", list: "a list"}
        raise SweepError(f"{key}: expected {names.get(kind, kind)}, got {value!r}")
    return value


def _positive_list(key: str, values, kind) -> list:
    _typed(key, values, list)
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and
                                                                      not float(v).is_integer()):
            raise SweepError(f"{key}: expected a list of {'integers' if kind is int else 'numbers'}"
                             f", got {v!r}")
        out.append(kind(v))
    if len(set(out)) != len(out):
        raise SweepError(f"{key}: duplicate values in {values!r}")
    return out


def _name(key: str, value: str) -> str:
    """``value`` if it is usable in paths and job names (letters, digits, '.', '_', '-')."""
    if not NAME.fullmatch(value):
        raise SweepError(f"{key}: use letters, digits, '.', '_' and '-' only, got {value!r}")
    return value


def _template(key: str, value: str, placeholder: str) -> str:
    """``value`` if its only ``{...}`` field is ``{placeholder}`` (no format spec)."""
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(value)
                  if name is not None]
    except ValueError as err:
        raise SweepError(f"{key}: {err} in {value!r}; the one placeholder accepted is "
                         f"{{{placeholder}}}") from None
    for name, spec, conv in fields:
        if name != placeholder or spec or conv:
            shown = name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "")
            raise SweepError(f"{key}: unknown placeholder {{{shown}}} in {value!r}; the one "
                             f"placeholder accepted is {{{placeholder}}}")
    return value


def _overrides(values) -> list:
    """The ``KEY=VALUE`` strings of ``overrides``, none of them a :data:`PLANNER_KEYS` key."""
    out = [_typed("overrides item", o, str) for o in _typed("overrides", values, list)]
    for item in out:
        key = item.split("=", 1)[0].strip()
        if key in PLANNER_KEYS:
            raise SweepError(f"overrides: {key} is set by the planner for each job; remove "
                             f"{item!r} (planner keys: {', '.join(PLANNER_KEYS)})")
    return out


def _slurm_time(key: str, value) -> None:
    """Raises :class:`SweepError` unless ``value`` is a SLURM time string such as 24:00:00."""
    if isinstance(value, int) and not isinstance(value, bool):
        raise SweepError(f"{key}: expected a SLURM time such as \"24:00:00\", got the number "
                         f"{value}: quote it (YAML reads an unquoted 24:00:00 as 86400 seconds)")
    if not isinstance(value, str) or not TIME.match(value):
        raise SweepError(f"{key}: expected a SLURM time such as 24:00:00 or 1-12:00:00, got "
                         f"{value!r}")


def _models(values) -> list:
    """``models`` as :class:`ModelEntry` items (at least one)."""
    models = []
    for i, entry in enumerate(_typed("models", values, list)):
        m = _fields(ModelEntry, entry, f"models[{i}]")
        for key in m:
            _typed(f"models[{i}].{key}", m[key], str, allow_none=key == "name")
        if m.get("name") is not None:
            _name(f"models[{i}].name", m["name"])
        models.append(ModelEntry(**m))
    if not models:
        raise SweepError("models: list at least one model preset")
    return models


def parse_sweep(tree: dict) -> SweepSpec:
    values = _fields(SweepSpec, tree, "sweep")
    name = _name("name", _typed("name", values["name"], str))
    models = _models(values["models"])
    slurm = _fields(SlurmSpec, values.get("slurm", {}) or {}, "slurm")
    for f in dataclasses.fields(SlurmSpec):
        if f.name not in slurm:
            continue
        if f.name in ("time", "convert_time"):
            _slurm_time(f"slurm.{f.name}", slurm[f.name])
            continue
        kind = {"nodes": int, "gpus_per_node": int, "cpus_per_task": int,
                "extra_sbatch": list, "setup": list}.get(f.name, str)
        _typed(f"slurm.{f.name}", slurm[f.name], kind, allow_none=f.default is None)
        if kind is int and slurm[f.name] < 1:
            raise SweepError(f"slurm.{f.name}: must be >= 1, got {slurm[f.name]}")
        if kind is list:
            for item in slurm[f.name]:
                _typed(f"slurm.{f.name} item", item, str)
    spec = SweepSpec(
        name=name, models=models,
        recipe=_template("recipe", _typed("recipe", values.get("recipe", SweepSpec.recipe), str),
                         "cr"),
        target_crs=_positive_list("target_crs", values.get("target_crs", []), float),
        seeds=_positive_list("seeds", values.get("seeds", [1234]), int),
        gqa_factors=_positive_list("gqa_factors", values.get("gqa_factors", []), int),
        gqa_recipe=_template("gqa_recipe", _typed("gqa_recipe", values.get(
            "gqa_recipe", SweepSpec.gqa_recipe), str), "factor"),
        overrides=_overrides(values.get("overrides", [])),
        output=_typed("output", values.get("output", SweepSpec.output), str),
        slurm=SlurmSpec(**slurm),
    )
    if not spec.seeds:
        raise SweepError("seeds: list at least one seed, e.g. [1234]")
    if any(cr < 1 for cr in spec.target_crs):
        raise SweepError(f"target_crs: every CR must be >= 1, got {spec.target_crs}")
    if any(f < 2 for f in spec.gqa_factors):
        raise SweepError(f"gqa_factors: every factor must be >= 2, got {spec.gqa_factors}")
    if not spec.target_crs and not spec.gqa_factors:
        raise SweepError("the sweep is empty: give target_crs and/or gqa_factors")
    if "{factor}" not in spec.gqa_recipe:
        raise SweepError(f"gqa_recipe: must contain {{factor}}, got {spec.gqa_recipe!r}")
    return spec


def load_sweep(path) -> SweepSpec:
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"{path}: no such sweep file")
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SweepError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from err
    return parse_sweep(tree if tree is not None else {})
