"""The ``dmc`` console script.

Every training subcommand takes ``--config FILE.yaml`` (repeatable, merged left to right),
dotted overrides (``optim.lr=1e-5``), ``--dry-run`` and ``--json``.
"""
from __future__ import annotations

import argparse
import json
import sys


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", action="append", default=[], metavar="FILE.yaml",
                        help="YAML config; repeat to merge presets (later files win)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. optim.lr=1e-5 data.seq_length=512")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate and print the resolved config, then exit")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _run_training(args, kind: str) -> int:
    from dmc.training.config import dump_config, load_config, to_dict

    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        print(json.dumps(to_dict(cfg), indent=1) if args.json else dump_config(cfg), end="")
        return 0
    from dmc.training.trainer import Trainer

    trainer = Trainer(cfg, kind)
    trainer.run(phase=getattr(args, "phase", None))
    summary = {"run_dir": cfg.run_dir, "step": trainer.step, **trainer.evaluate()}
    if trainer.rank == 0:
        if args.json:
            print(json.dumps(summary))
        else:
            print(" ".join(f"{k}={v}" for k, v in summary.items() if k != "valid_cr_per_head"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from dmc.data.prepare import add_prepare_arguments

    parser = argparse.ArgumentParser(prog="dmc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="corpus -> tokenizer -> megatron indexed dataset")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    add_prepare_arguments(data_sub.add_parser("prepare", help="prepare a training corpus"))

    pretrain = sub.add_parser("pretrain", help="train a vanilla base model (tiny demo base)")
    _add_run_arguments(pretrain)

    retrofit = sub.add_parser("retrofit", help="zero_out -> retrofit -> solidify DMC training")
    _add_run_arguments(retrofit)
    retrofit.add_argument("--phase", choices=("zero_out", "retrofit", "solidify"),
                          help="run only this phase (resuming from the run's latest checkpoint)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [e for e in extra if "=" in e and not e.startswith("-")]
    unknown = [e for e in extra if e not in overrides]
    if unknown or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or overrides)}")
    if overrides:
        args.overrides = args.overrides + overrides
    try:
        if args.command == "data":
            from dmc.data.prepare import run_prepare

            return run_prepare(args)
        return _run_training(args, args.command)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"dmc {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
