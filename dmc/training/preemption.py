"""Clean stops on SIGUSR1 / SIGTERM (SLURM's time-limit warning and preemption).

The handler only records the signal. The training loop calls :meth:`StopSignal.requested` after
each step; every rank takes part in one all-reduce (MAX), so all ranks agree to stop at the same
step even when the signal reached only some of them, and none is left waiting in a collective.
The loop then saves a regular checkpoint (atomic, ``latest`` updated) and returns; ``dmc
pretrain`` / ``dmc retrofit`` exit with :data:`EXIT_PREEMPTED` so a launcher can tell "saved,
not finished" from success (0) and failure. ``slurm/retrofit.sbatch`` requeues the job on that
code, and the requeued job resumes from ``latest``.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 99
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopSignal:
    """Context manager that installs flag-setting handlers for ``signals`` and restores the
    previous handlers on exit. ``received`` holds the name of the first signal seen locally."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: str | None = None
        self._previous = {}

    def _handle(self, signum, _frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def __enter__(self) -> "StopSignal":
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def requested(self) -> bool:
        """True on every rank when any rank has received a stop signal (a collective call:
        every rank must call it at the same point)."""
        flag = torch.tensor([1.0 if self.received else 0.0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
