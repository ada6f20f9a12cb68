"""How long the device worked on a step: the split of a decode step's time between the device
and the host (scheduling, page reservation, reading the tokens back, bookkeeping)."""
from __future__ import annotations

import time

import torch


class DeviceSpan:
    """The time between :meth:`begin` and :meth:`end`, marked in the stream on CUDA (events:
    what the device ran between the two marks, including any wait for the host to launch it),
    on the host clock elsewhere (the work runs as it is called). Read :meth:`seconds` after
    the work completed (a step's tokens read back); 0.0 when never begun."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def begin(self) -> None:
        self.marks = [self._mark()]

    def end(self) -> None:
        if self.marks:
            self.marks.append(self._mark())

    def seconds(self) -> float:
        if len(self.marks) != 2:
            return 0.0
        start, stop = self.marks
        return start.elapsed_time(stop) / 1e3 if self.cuda else stop - start

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
