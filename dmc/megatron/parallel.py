"""torch.distributed + megatron model-parallel set-up that works with and without CUDA."""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dmc.megatron.compat import apply_cpu_compat, cuda_available, model_parallel_manual_seed
from dmc.megatron.pipeline_sum import init_pipeline_scalar_groups


def torchrun_command(nproc: int) -> list[str]:
    """``python -m torch.distributed.run`` for ``nproc`` processes on this machine.
    ``--standalone``: its rendezvous store binds a free port itself and the workers share it, so
    no port is picked beforehand that another process could take in between."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(nproc)]


def init_process_group() -> None:
    """Initialises torch.distributed from the torchrun/SLURM-style environment (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or, when absent, as a single local process (an
    in-process ``HashStore``: no port). nccl on CUDA, gloo otherwise."""
    if dist.is_initialized():
        return
    backend = "nccl" if cuda_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if cuda_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
        return
    # one local process: an in-process store, no port (a port picked free and bound later can
    # be taken in between by a process started at the same time, e.g. compare's workers)
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def initialize_parallel(
    tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 1234
) -> None:
    """CPU compat (when CUDA is absent), process group, megatron's model-parallel groups and
    its tracked RNG states. Data parallelism is what remains of the world size."""
    apply_cpu_compat()
    init_process_group()
    world = dist.get_world_size()
    if world % (tensor_parallel * pipeline_parallel):
        raise ValueError(
            f"parallel: world size {world} is not divisible by tensor_parallel * "
            f"pipeline_parallel = {tensor_parallel} * {pipeline_parallel}"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
    )
    init_pipeline_scalar_groups()
    model_parallel_manual_seed(seed)


def destroy_parallel() -> None:
    """Tears down megatron's groups and the process group (tests run several set-ups)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
