"""``dmc bench NAME [ARGS...]``: run a benchmark from the repository's ``benchmarks/`` folder.

Each ``benchmarks/NAME.py`` exposes ``main(argv)``, prints a table and writes JSON (``--out``);
an int it returns is the exit code, anything else (its results, None) means 0. The folder ships
with the source tree (an editable install finds it next to the package; ``DMC_BENCHMARKS`` names
another one).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path


def benchmarks_dir() -> Path:
    return Path(os.environ.get("DMC_BENCHMARKS") or Path(__file__).resolve().parents[2]
                / "benchmarks")


def available() -> list[str]:
    folder = benchmarks_dir()
    return sorted(p.stem for p in folder.glob("*.py")) if folder.is_dir() else []


def run_bench(args: argparse.Namespace) -> int:
    names = available()
    if args.name not in names:
        raise ValueError(f"benchmark {args.name!r} not found in {benchmarks_dir()}; accepted "
                         f"values: {', '.join(names) or '(none: set DMC_BENCHMARKS)'}")
    path = benchmarks_dir() / f"{args.name}.py"
    spec = importlib.util.spec_from_file_location(f"dmc_benchmarks.{args.name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does: a dataclass looks its module up there
    spec.loader.exec_module(module)
    code = module.main(args.args)
    return code if isinstance(code, int) else 0  # a benchmark may return its results


def register(sub) -> None:
    parser = sub.add_parser("bench", help="run a benchmark (decode_throughput, paged_kernel, "
                            "train_step, ...); arguments after NAME go to it")
    parser.add_argument("name", metavar="NAME", help="benchmark file stem in benchmarks/")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    parser.set_defaults(handler=run_bench)
