"""Expands a sweep into SLURM jobs linked by ``afterok`` dependencies.

Per (model, seed): one ``zero_out`` job, shared by every target CR (the zero-out phase does
not depend on the CR); per CR: ``retrofit`` (continuing from the shared zero-out checkpoint
through ``checkpoint.init_from``) -> ``solidify``. Per (model, GQA factor): one conversion job
(``dmc baseline gqa``), shared by the seeds; per seed an up-training job. A comparison holds
only at equal training budget: a GQA factor equal to one of the sweep's CRs up-trains with the
schedule of the DMC point at that CR (its zero-out + retrofit + solidify steps) and must share
its batch shape. Each training job's config is validated with
:func:`dmc.training.config.load_config` and its parallel layout against the job's GPUs before
anything is written; point and job names must be unique.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dmc.slurm.spec import SweepError, SweepSpec
from dmc.training.resume import INIT_FROM_SAME, flat_dict, under
from dmc.training.config import ConfigError, load_config, to_dict
from dmc.training.phases import PhasePlan

SCHEDULE_STEPS = ("zero_out_steps", "retrofit_steps", "solidify_steps")
BATCH_SHAPE = ("global_batch_size", "seq_length")


@dataclass
class Job:
    """One sbatch job: ``argv`` is the dmc command line, ``after`` the jobs it waits for."""

    name: str
    argv: list
    after: list
    nodes: int
    gpus_per_node: int
    time: str
    outputs: dict = field(default_factory=dict)


@dataclass
class Point:
    """One sweep point (a DMC CR or a GQA baseline), the jobs that produce it, its result
    checkpoint and its training ``budget`` (:func:`budget`)."""

    name: str
    kind: str
    model: str
    seed: int
    value: float
    run_dir: str
    jobs: list
    result: str
    budget: dict


def _fmt(value: float) -> str:
    """A CR or factor as it appears in names: 6 significant digits (2, 2.5, 1.23457). The exact
    value goes to ``dmc.target_cr``; :func:`plan_sweep` refuses names that collide."""
    return f"{value:g}"


def budget(cfg) -> dict:
    """The training budget of a run: all its steps (zero-out + retrofit or up-training +
    solidify), its batch shape and ``tokens`` = steps x global batch x sequence length."""
    steps = sum(getattr(cfg.schedule, key) for key in SCHEDULE_STEPS)
    shape = {key: getattr(cfg.data, key) for key in BATCH_SHAPE}
    return {"steps": steps, **shape, "tokens": steps * shape["global_batch_size"]
            * shape["seq_length"]}


def last_phase(cfg, job: str) -> str:
    """The last phase of ``cfg``'s retrofit run that has steps: its checkpoint folder
    (``checkpoints/<phase>``) holds the run's result."""
    try:
        ranges = PhasePlan(cfg, "retrofit").ranges
    except ConfigError as err:
        raise SweepError(f"job {job}: {err}") from None
    return [phase for phase, (start, end) in ranges.items() if end > start][-1]


def _check_unique(what: str, names: list) -> None:
    """Raises :class:`SweepError` when two of ``names`` are equal (two chains, one run_dir)."""
    seen = set()
    for name in names:
        if name in seen:
            raise SweepError(
                f"target_crs / models[].name: two sweep {what}s are named {name}; names show a "
                f"CR to 6 significant digits (2 and 2.0000001 both give cr2), so use values that "
                f"differ there")
        seen.add(name)


def _check_layout(cfg, nodes: int, gpus: int, job: str) -> None:
    world = nodes * gpus
    per_replica = cfg.parallel.tensor * cfg.parallel.pipeline
    if world % per_replica:
        raise SweepError(
            f"job {job}: slurm.nodes x slurm.gpus_per_node = {world} GPUs is not a multiple of "
            f"parallel.tensor x parallel.pipeline = {per_replica}")
    step = cfg.data.micro_batch_size * (world // per_replica)
    if cfg.data.global_batch_size % step:
        raise SweepError(
            f"job {job}: data.global_batch_size ({cfg.data.global_batch_size}) must be a "
            f"multiple of data.micro_batch_size x data-parallel size ({step}) on {world} GPUs")


class _Planner:
    def __init__(self, spec: SweepSpec, root: Path):
        self.spec, self.root = spec, root
        self.jobs: list[Job] = []
        self.points: list[Point] = []
        self.zero_out: dict = {}
        self.dmc_configs: dict = {}  # (model name, CR) -> (recipe, config) of its DMC points

    def config(self, files, overrides, job):
        try:
            cfg = load_config(files, overrides)
        except ConfigError as err:
            raise SweepError(f"job {job}: {err}") from None
        s = self.spec.slurm
        _check_layout(cfg, s.nodes, s.gpus_per_node, job)
        return cfg

    def train_job(self, name, files, keys, after, outputs, phase=None) -> Job:
        self.config(files, keys, name)
        argv = ["retrofit", *[x for f in files for x in ("--config", f)],
                *(["--phase", phase] if phase else []), *keys]
        s = self.spec.slurm
        job = Job(name, argv, after, s.nodes, s.gpus_per_node, s.time, outputs)
        self.jobs.append(job)
        return job

    def zero_out_job(self, model, name, seed, files, keys, cfg):
        """The zero_out job that ``cfg`` can continue from: one per distinct (seed, model,
        schedule, optimizer, batch shape), i.e. what ``checkpoint.init_from`` requires equal."""
        flat = flat_dict(to_dict(cfg))
        key = (name, seed, json.dumps({k: v for k, v in flat.items() if under(k, INIT_FROM_SAME)},
                                     sort_keys=True))
        if key not in self.zero_out:
            twins = sum(k[:2] == (name, seed) for k in self.zero_out)
            job = f"{name}-s{seed}-zero_out" + (f"-{twins + 1}" if twins else "")
            zo_dir = self.root / "runs" / job
            self.zero_out[key] = self.train_job(
                job, files, [*keys, f"run_dir={zo_dir}",
                             f"checkpoint.load_base={model.base_checkpoint}"], [],
                {"run_dir": str(zo_dir), "checkpoint": str(zo_dir / "checkpoints/zero_out")},
                phase="zero_out")
        return self.zero_out[key]

    def dmc_chains(self, model, name, seed):
        spec = self.spec
        for cr in spec.target_crs:
            point = f"{name}-cr{_fmt(cr)}-s{seed}"
            files = [model.preset, spec.recipe.format(cr=_fmt(cr))]
            if not Path(files[1]).is_file():
                raise SweepError(f"recipe: {files[1]} (target CR {_fmt(cr)}) does not exist")
            keys = [*spec.overrides, f"seed={seed}", f"dmc.target_cr={cr!r}"]
            cfg = self.config(files, keys, point)
            self.dmc_configs[name, cr] = (files[1], cfg)
            run_dir = self.root / "runs" / point
            chain = []
            if cfg.schedule.zero_out_steps:
                chain.append(self.zero_out_job(model, name, seed, files, keys, cfg))
                keys.append(f"checkpoint.init_from={chain[0].outputs['checkpoint']}")
            else:
                keys.append(f"checkpoint.load_base={model.base_checkpoint}")
            keys.append(f"run_dir={run_dir}")
            for phase, steps in (("retrofit", cfg.schedule.retrofit_steps),
                                 ("solidify", cfg.schedule.solidify_steps)):
                if steps:
                    after = [chain[-1].name] if chain else []
                    chain.append(self.train_job(
                        f"{point}-{phase}", files, keys, after,
                        {"run_dir": str(run_dir),
                         "checkpoint": str(run_dir / "checkpoints" / phase)}, phase=phase))
            if not chain:
                raise SweepError(f"recipe {files[1]}: the schedule has no steps")
            self.points.append(Point(point, "dmc", name, seed, cr, str(run_dir),
                                     [j.name for j in chain], chain[-1].outputs["checkpoint"],
                                     budget(cfg)))

    def equal_budget(self, name, factor, seed, point, recipe, cfg) -> None:
        """Raises :class:`SweepError` when GQA ``point`` (config ``cfg``) and the DMC point at
        CR = ``factor`` train on batches of another shape (their budgets would differ)."""
        dmc_recipe, dmc_cfg = self.dmc_configs[name, float(factor)]
        for key in BATCH_SHAPE:
            ours, theirs = getattr(cfg.data, key), getattr(dmc_cfg.data, key)
            if ours != theirs:
                raise SweepError(
                    f"{point} ({recipe}) and {name}-cr{_fmt(factor)}-s{seed} ({dmc_recipe}): "
                    f"data.{key} is {ours} vs {theirs}; an equal training budget needs the same "
                    f"batch shape: make data.{key} equal in the two recipes")

    def gqa_schedule(self, name, factor) -> list:
        """Overrides giving a GQA factor's up-training the schedule of the DMC point at
        CR = ``factor`` (none without such a point: the GQA recipe's schedule stands)."""
        twin = self.dmc_configs.get((name, float(factor)))
        if twin is None:
            return []
        return [f"schedule.{key}={getattr(twin[1].schedule, key)}" for key in SCHEDULE_STEPS]

    def gqa_chains(self, model, name):
        spec = self.spec
        base = self.config([model.preset], spec.overrides, f"{name}-gqa")
        groups = base.model.num_query_groups or base.model.num_attention_heads
        for factor in spec.gqa_factors:
            recipe = spec.gqa_recipe.format(factor=factor)
            if not Path(recipe).is_file():
                raise SweepError(f"gqa_recipe: {recipe} (GQA factor {factor}) does not exist")
            if groups % factor:
                raise SweepError(f"gqa_factors: {factor} does not divide the {groups} KV heads "
                                 f"of {model.preset}")
            converted = self.root / "gqa" / f"{name}-gqa{factor}"
            convert = Job(f"{name}-gqa{factor}-convert",
                          ["baseline", "gqa", "--checkpoint", model.base_checkpoint,
                           "--num-query-groups", str(groups // factor), "--output",
                           str(converted)],
                          [], 1, 1, spec.slurm.convert_time, {"checkpoint": str(converted)})
            self.jobs.append(convert)
            schedule = self.gqa_schedule(name, factor)
            for seed in spec.seeds:
                point = f"{name}-gqa{factor}-s{seed}"
                run_dir = self.root / "runs" / point
                files = [model.preset, recipe]
                keys = [*spec.overrides, *schedule, f"seed={seed}",
                        f"model.num_query_groups={groups // factor}",
                        f"checkpoint.load_base={converted}", f"run_dir={run_dir}"]
                cfg = self.config(files, keys, point)
                if schedule:
                    self.equal_budget(name, factor, seed, point, recipe, cfg)
                result = run_dir / "checkpoints" / last_phase(cfg, point)
                up = self.train_job(f"{point}-uptrain", files, keys, [convert.name],
                                    {"run_dir": str(run_dir), "checkpoint": str(result)})
                self.points.append(Point(point, "gqa", name, seed, factor, str(run_dir),
                                         [convert.name, up.name], str(result), budget(cfg)))


def plan_sweep(spec: SweepSpec, root: Path) -> tuple[list[Job], list[Point]]:
    """The jobs (in submission order: every job after those it depends on) and the points."""
    planner = _Planner(spec, Path(root))
    names = set()
    for model in spec.models:
        if not Path(model.preset).is_file():
            raise SweepError(f"models: preset {model.preset} does not exist")
        name = model.name or Path(model.preset).stem
        if name in names:
            raise SweepError(f"models: two entries are named {name}; set models[].name")
        names.add(name)
        if spec.target_crs:
            for seed in spec.seeds:
                planner.dmc_chains(model, name, seed)
        if spec.gqa_factors:
            planner.gqa_chains(model, name)
    _check_unique("point", [p.name for p in planner.points])
    _check_unique("job", [j.name for j in planner.jobs])
    return planner.jobs, planner.points
