"""Overlap of a decode step's host work with the previous step's device work (the idea of vLLM's
async scheduling and SGLang's overlap scheduler), for :class:`~dmc.inference.engine.Engine`
with ``overlap=True``.

Without it a decode step runs its host work (the page reservation, the step's inputs, reading
the sampled tokens back, the bookkeeping of every sequence) while the device waits, then its
device work while the host waits. In the steady state of generation (the same sequences decode
again, nothing waits to join the batch) the next step does not need the host to know what this
one drew: its input tokens are this step's output, still on the device, and its pages can be
reserved for the worst case of both steps (a head gains at most one slot per step). So
:class:`DecodePipeline` launches step n + 1 (through
:class:`~dmc.inference.decode_graphs.DecodeGraphs`, its inputs from step n's output), then
reads step n back: the tokens and the lengths its deferred DMC writes reached come to the host
in one non-blocking copy into pinned memory started when step n's device work was launched
(:class:`Readback`), and the host waits for that copy only, while the device runs step n + 1.

What it takes (and what the eager engine does not need):
- pages one step ahead: the cache keeps up to two decode steps open, the newer of the same
  sequences or some of them
  (:meth:`~dmc.inference.block_allocator.BlockAllocator.reserve_step`), each head holding a
  page for every slot they may add, and settles the older one from the lengths it reached;
- stop tokens learned one step late: a sequence that draws one at step n ends with it (its
  result is that of the eager engine: tokens, log-probabilities and compression as after step
  n), the token step n + 1 drew for it is dropped, and its slot is freed once step n + 1 is
  back;
- sequences that end leave the pipeline going: step n + 2 continues the rows of step n + 1
  that still decode (not those that ended at step n, nor those whose token of step n + 1 is
  their last, ``max_new_tokens``), its inputs gathered on the device from step n + 1's
  (:class:`~dmc.inference.decode_graphs.Continued`), the cache's next step opened for those
  sequences only;
- a drain (:meth:`DecodePipeline.drain`) whenever the next step is not such a continuation:
  every sequence ends, a waiting request could join, another sequence is running (prefill
  work), or the pages for the worst case of two steps are not free (the scheduler then
  preempts as usual). After a drain the engine schedules as without overlap.

Supported: every model under ``cuda_graphs=True`` (so no KV policy): vanilla, GQA, DMC, and DMS
and DMC with delayed merging once their steps are static (every window ring full: the host
counts the ring's tokens when a step opens, not from the device). On the CPU every step runs to
its end when launched and the device lengths are the host's; the bookkeeping is the same, which
the tests compare with the engine without overlap, also with the device copies kept apart as
on a GPU.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

from dmc.inference.block_allocator import CacheFullError
from dmc.inference.decode_graphs import Continued
from dmc.inference.device_span import DeviceSpan
from dmc.inference.sequence import GenerationResult, Sequence


class Readback:
    """A step's results on their way to the host: ``drawn [2, batch]`` (float64 device tokens
    and log-probabilities), ``lengths [batch, layers, kv_heads]`` (the slots of every head
    after the step: device values are copied with ``drawn`` in one transfer; host ones are
    kept as they are) and the kernels' fault counter (:mod:`~dmc.inference.kernels.faults`,
    on the device). On a GPU the copy goes into pinned memory without waiting, and
    :meth:`wait` waits for that copy only (a CUDA event), not for later work."""

    def __init__(self, drawn: torch.Tensor, lengths: torch.Tensor, faults: torch.Tensor):
        self.count = drawn.numel()
        self.shapes = (drawn.shape, lengths.shape)
        self.lengths = None if lengths.device == drawn.device else lengths.clone()
        parts = [drawn.flatten(), faults.double()]
        if self.lengths is None:
            parts.insert(1, lengths.double().flatten())
        flat = torch.cat(parts)
        self.event = None
        if flat.is_cuda:
            self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flat.clone()

    def wait(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(drawn, lengths, faults)`` on the host (lengths int32)."""
        if self.event is not None:
            self.event.synchronize()
        drawn = self.host[:self.count].view(self.shapes[0])
        lengths = (self.lengths if self.lengths is not None
                   else self.host[self.count:-2].view(self.shapes[1]))
        return drawn, lengths.to(torch.int32), self.host[-2:]


class InFlight(NamedTuple):
    """A decode step launched and not read back: its sequences (in batch order), what it drew
    (device, the next step's input), its :class:`Readback`, when its host work began and its
    device span."""

    seqs: list[Sequence]
    drawn: torch.Tensor
    readback: Readback
    started: float
    span: DeviceSpan


class DecodePipeline:
    """Decode steps launched one ahead of their read-back (see the module docstring).

    ``engine``: the :class:`~dmc.inference.engine.Engine` whose graphs, cache, scheduler and
    bookkeeping (``stats``, ``_take_tokens``, ``_note_usage``) it drives."""

    def __init__(self, engine):
        if engine.graphs is None:
            raise ValueError("Engine: overlap=True needs cuda_graphs=True (the steps it launches "
                             "ahead are a batch size's static step); accepted: overlap=False")
        self.engine = engine
        self.flight: InFlight | None = None
        self.ended: list[Sequence] = []  # ended at the step read back, in the step in flight
        self.last_done = 0.0

    @property
    def busy(self) -> bool:
        """Whether a step is in flight or ended sequences wait for it to free their slots."""
        return self.flight is not None or bool(self.ended)

    def launch(self, seqs: list[Sequence], started: float, pending: InFlight | None = None):
        """Launch a decode step of ``seqs`` (their newest token, or what ``pending`` drew for
        them: all of its sequences or some, in its order) and leave it in flight; its
        read-back copy starts now."""
        span = DeviceSpan(self.engine.device)
        continued = None
        if pending is not None:
            rows = None
            if len(seqs) != len(pending.seqs):
                where = {id(seq): row for row, seq in enumerate(pending.seqs)}
                rows = [where[id(seq)] for seq in seqs]
            continued = Continued(pending.drawn, len(pending.seqs), rows)
        drawn = self.engine.graphs.decode(seqs, span, continued)
        span.end()
        allocator = self.engine.cache.allocator
        lengths = allocator.step_lengths()
        if lengths is None:  # the host lengths are exact: vanilla, or the CPU
            lengths = allocator.lengths[self.engine.kv.step.seqs.host]
        self.flight = InFlight(seqs, drawn, Readback(drawn, lengths, allocator.faults), started,
                               span)
        for seq in seqs:
            seq.cached += 1

    def advance(self, finished: list[GenerationResult]) -> bool:
        """Launch the next step of the sequences in flight that go on (:meth:`_next_batch`),
        then read the one in flight back (appending the requests that ended to ``finished``):
        True. When there is no such step or its pages are not free, :meth:`drain` instead:
        False (the engine schedules then)."""
        flight = self.flight
        seqs = None if flight is None else self._next_batch(flight.seqs)
        if seqs:
            try:
                self.launch(seqs, time.perf_counter(), pending=flight)
            except CacheFullError:
                pass
            else:
                self.engine.stats.continued_steps += 1
                self._read_back(flight, finished)
                if not self.engine.scheduler.has_unfinished():  # all ended: nothing to wait for
                    self.drain(finished)
                return True
        self.drain(finished)
        return False

    def drain(self, finished: list[GenerationResult]) -> None:
        """Read the step in flight back and free the slots of the sequences that ended."""
        if self.flight is not None:
            flight, self.flight = self.flight, None
            self._read_back(flight, finished)

    def _next_batch(self, seqs: list[Sequence]) -> list[Sequence] | None:
        """The sequences of the step in flight, ``seqs``, that the next step decodes: those
        still running (not ended at the step read back) that want a token past the one in
        flight, in order; None when the scheduler has to plan the next step instead (another
        sequence is running, a waiting request could join, or none goes on)."""
        scheduler = self.engine.scheduler
        ended = {id(seq) for seq in self.ended}
        live = [seq for seq in seqs if id(seq) not in ended]
        if len(scheduler.running) != len(live):
            return None
        going_on = [s for s in live if len(s.generated) + 2 <= s.params.max_new_tokens]
        if not going_on or (scheduler.waiting and len(going_on) < scheduler.max_batch):
            return None
        return going_on

    def _read_back(self, flight: InFlight, finished: list[GenerationResult]) -> None:
        """Wait for ``flight``'s copy, check the fault counter read with it, settle its step,
        take its tokens (dropping those of sequences that ended at the previous step), free the
        slots of the sequences no step in flight writes any more and record its time."""
        drawn, lengths, faults = flight.readback.wait()
        cache = self.engine.cache
        cache.allocator.check_faults(faults)
        if cache.allocator.steps:
            cache.settle(reached=lengths)
        ended_ids = {id(seq) for seq in self.ended}
        live = [row for row, seq in enumerate(flight.seqs) if id(seq) not in ended_ids]
        seqs = [flight.seqs[row] for row in live]
        done = time.perf_counter()
        self.engine.stats.add_decode(done - max(flight.started, self.last_done),
                                     flight.span.seconds(), len(flight.seqs))
        self.engine._note_usage()
        self.last_done = done
        index = torch.tensor(live, dtype=torch.long)
        ended = self.engine._take_tokens(seqs, drawn[:, index], finished, lengths[index])
        writing = set() if self.flight is None else {id(seq) for seq in self.flight.seqs}
        for seq in self.ended + ended:
            if id(seq) not in writing:
                cache.free_sequence(seq.slot)
        self.ended = [seq for seq in ended if id(seq) in writing]
