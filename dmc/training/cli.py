"""``dmc pretrain`` and ``dmc retrofit``: training runs from YAML configs plus dotted overrides.

Exit codes: 0 finished (the run or the ``--phase``), 2 bad input (a config that differs from the
checkpoint being resumed included, see :mod:`dmc.training.resume`), ``EXIT_PREEMPTED`` (99)
stopped by SIGUSR1/SIGTERM after saving a checkpoint that the next launch resumes from."""
from __future__ import annotations

import argparse
import json

from dmc.training import launch
from dmc.training.preemption import EXIT_PREEMPTED, StopSignal


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` (repeatable), positional ``KEY=VALUE`` overrides, ``--dry-run``, ``--json``."""
    parser.add_argument("--config", action="append", default=[], metavar="FILE.yaml",
                        help="YAML config; repeat to merge presets (later files win)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. optim.lr=1e-5 data.seq_length=512")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate and print the resolved config, then exit")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="resume even though fields that define the run (model, data, "
                             "seed, optimizer, schedule, dmc) differ from its checkpoint's; "
                             "the change is recorded in <run_dir>/config_history.jsonl")
    parser.add_argument("--nproc", type=int, default=1, metavar="N",
                        help="processes on this node (re-executes under torchrun; data "
                             "parallel size = N / (parallel.tensor x parallel.pipeline))")


def run_training(args: argparse.Namespace) -> int:
    with StopSignal() as stop:  # SIGTERM / SIGUSR1 during start-up: exit 99 too, not 143
        return _run_training(args, stop)


def _run_training(args: argparse.Namespace, stop: StopSignal) -> int:
    from dmc.training.config import dump_config, load_config, to_dict

    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        print(json.dumps(to_dict(cfg), indent=1) if args.json else dump_config(cfg), end="")
        return 0
    if args.nproc < 1:
        raise ValueError(f"--nproc: must be >= 1, got {args.nproc}")
    if args.nproc > 1 and not launch.is_worker():
        launch.relaunch(args.nproc, args)
    from dmc.training.trainer import Trainer

    trainer = Trainer(cfg, args.command, allow_config_change=args.allow_config_change)
    trainer.run(phase=getattr(args, "phase", None), stop=stop)
    if trainer.preempted:
        return EXIT_PREEMPTED
    summary = {"run_dir": cfg.run_dir, "step": trainer.step, **trainer.evaluate()}
    if trainer.rank == 0:
        if args.json:
            print(json.dumps(summary))
        else:
            print(" ".join(f"{k}={v}" for k, v in summary.items() if k != "valid_cr_per_head"))
    return 0


def register(sub) -> None:
    pretrain = sub.add_parser("pretrain", help="train a vanilla base model (tiny demo base)")
    add_run_arguments(pretrain)
    pretrain.set_defaults(handler=run_training)

    retrofit = sub.add_parser("retrofit", help="zero_out -> retrofit -> solidify DMC training")
    add_run_arguments(retrofit)
    retrofit.add_argument("--phase", choices=("zero_out", "retrofit", "solidify"),
                          help="run only this phase (resuming from the run's latest checkpoint)")
    retrofit.set_defaults(handler=run_training)
