"""``--nproc N``: one-node multi-process runs by re-executing the command under torchrun.

``dmc retrofit --nproc 4 ...`` becomes ``python -m torch.distributed.run --nproc_per_node 4
--master_addr 127.0.0.1 --master_port <free> -m dmc.cli retrofit ...``: each worker sees the
RANK / WORLD_SIZE / MASTER_* variables that :func:`dmc.megatron.parallel.init_process_group`
reads. Data parallelism is what remains of N after ``parallel.tensor x parallel.pipeline``.
On many nodes use ``slurm/retrofit.sbatch`` (one ``srun`` task per GPU) instead.
"""
from __future__ import annotations

import argparse
import os
import sys


def is_worker() -> bool:
    """True inside a process started by torchrun or srun (the rank is already set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def dmc_argv(args: argparse.Namespace) -> list[str]:
    """The command line of a parsed ``dmc pretrain/retrofit`` invocation, without ``--nproc``."""
    argv = [args.command]
    for path in args.config:
        argv += ["--config", path]
    if getattr(args, "phase", None):
        argv += ["--phase", args.phase]
    if args.json:
        argv.append("--json")
    if getattr(args, "allow_config_change", False):
        argv.append("--allow-config-change")
    return argv + list(args.overrides)


def torchrun_argv(nproc: int, args: argparse.Namespace) -> list[str]:
    from dmc.megatron.parallel import torchrun_command

    return [*torchrun_command(nproc), "-m", "dmc.cli", *dmc_argv(args)]


def relaunch(nproc: int, args: argparse.Namespace):
    """Replaces this process with torchrun running the same command on ``nproc`` workers."""
    argv = torchrun_argv(nproc, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
