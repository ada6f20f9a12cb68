"""The ``dmc`` console script.

Each subcommand lives in its own module, which exposes ``register(subparsers)``: it adds its
parser(s) and sets ``handler`` (``args -> exit code``) as a parser default. Training
subcommands take ``--config FILE.yaml`` (repeatable, merged left to right), dotted overrides
(``optim.lr=1e-5``) anywhere on the line, ``--dry-run`` and ``--json``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import warnings

# megatron-core warns when the optional GPU extras are absent (the fallbacks are used) and about
# its own deprecations (sharded-tensor checkpoint loading): nothing a user of the CLI can act on
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", module=r"(megatron|dmc\.megatron)\.")

COMMAND_MODULES = (
    "dmc.data.cli",                # data prepare
    "dmc.training.cli",            # pretrain, retrofit
    "dmc.inference.generate_cli",  # generate
    "dmc.eval.cli",                # eval ppl
    "dmc.eval.bench",              # bench
    "dmc.baselines.cli",           # baseline gqa
    "dmc.convert.cli",             # convert hf-to-mcore, mcore-to-hf, nvidia-dmc
    "dmc.slurm.cli",               # sweep
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dmc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
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
        return args.handler(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"dmc {args.command}: error: {err}", file=sys.stderr)
        return 2
    except (PermissionError, NotADirectoryError, IsADirectoryError, FileExistsError) as err:
        print(f"dmc {args.command}: error: cannot use {err.filename!r}: {err.strerror} (a "
              f"read-only or misplaced run, data or output folder?)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
