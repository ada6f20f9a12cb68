"""Decode steps replayed from CUDA graphs, one graph per batch size.

A forward of decode tokens only (the steady state of generation) splits into host work and
device work. The host work is the scheduler's plan and :meth:`KVWrite.begin_decode
<dmc.inference.kv_write.KVWrite.begin_decode>`: the sequence rows validated, the pages of the
step reserved. The device work, :meth:`ModelRunner.decode_forward
<dmc.inference.model_runner.ModelRunner.decode_forward>` (embedding, each layer's cache write and
attention, logits) then :func:`~dmc.inference.sampling.sample_static` (every row's token and
log-probability), reads only the cache's tensors and the static tensors of its batch size
(:class:`StepBuffers`: token ids, positions, sequence rows, the slots reserved for vanilla
appends, the sampling settings), and launches the same kernels at every step of that size: the
attention's launch size is fixed by the longest head a block table can hold (a batch with
top-k or top-p has a graph of its own: it sorts the vocabulary). So on CUDA the device work of
a batch size is captured once and replayed: a step costs one graph launch instead of dozens of
kernel launches per layer, each with its Python dispatch. A batch size runs eagerly the first
time, on a side stream (Triton compiles its kernels, libraries initialise outside a capture), is
captured the second time and replayed from then on. Without CUDA (or with ``capture=False``) the
same static path runs eagerly every time: the CPU tests compare it with the ordinary forward
and sampling.

DMS's write branches on which sequences have a token leaving the window ring; once every ring of
the step is full (every sequence holds ``w + 1`` tokens) every row has one, and the step is
static (:meth:`DMSPagedCache.begin_decode <dmc.inference.dms_cache.DMSPagedCache.begin_decode>`);
before that (:meth:`KVWrite.static_ready <dmc.inference.kv_write.KVWrite.static_ready>`), the
step runs eagerly. Not captured: forwards with prefill chunks (their shapes change) and KV
policies (their hooks run on the host): :class:`~dmc.inference.engine.Engine` refuses
``cuda_graphs=True`` with a policy and runs the steps that prefill eagerly.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from dmc.inference.device_span import DeviceSpan
from dmc.inference.model_runner import ModelRunner
from dmc.inference.paging import to_device
from dmc.inference.sampling import SamplingColumns, needs_filter, sample_static


class Continued(NamedTuple):
    """The previous decode step, still on the device, that a step continues (an overlapped
    step, :mod:`dmc.inference.overlap`): ``drawn [2, batch]`` (what it drew: this step's input
    tokens), its batch size (its :class:`StepBuffers` hold its inputs) and ``rows``, the rows of
    that batch that decode again, in order (None: all of them)."""

    drawn: torch.Tensor
    batch: int
    rows: list[int] | None = None


class StepBuffers(NamedTuple):
    """The static inputs of one batch size's captured step: ``ids, positions, rows [batch]``
    (token ids, their positions, the sequences' cache slots), ``pages, offsets [batch,
    num_layers, kv_heads]`` (the slots reserved for vanilla appends; unused under DMC), all
    long, and the sampling settings (``[batch]`` columns), on the cache's device."""

    ids: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    pages: torch.Tensor
    offsets: torch.Tensor
    sampling: SamplingColumns


class DecodeGraphs:
    """Decode-only forwards of ``runner`` through static buffers, replayed from a CUDA graph
    per batch size when ``capture`` (default: on CUDA), else run eagerly.

    ``captured``: the ``(batch size, filtering)`` pairs with a graph."""

    def __init__(self, runner: ModelRunner, capture: bool | None = None):
        self.runner, self.kv = runner, runner.kv
        cache = self.kv.cache
        self.device = cache.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("DecodeGraphs: capture=True needs a model on a CUDA device")
        self.max_length = cache.max_pages_per_head * cache.page_size
        self.shape = (cache.num_layers, cache.num_kv_heads)
        self.buffers: dict[int, StepBuffers] = {}
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.warm: set[tuple] = set()
        self.pool = None

    @property
    def captured(self) -> list[tuple[int, bool]]:
        return sorted(self.graphs)

    def decode(self, seqs: list, span: DeviceSpan | None = None,
               pending: Continued | None = None) -> torch.Tensor:
        """One token for each sequence (:class:`~dmc.inference.sequence.Sequence`, holding a
        cache slot, its newest token not cached yet): ``[2, batch]`` float64 on the device, the
        sampled tokens and their log-probabilities (see
        :func:`~dmc.inference.sampling.sample_on_device`). Valid until the next call (a graph's
        output is overwritten by its next replay). ``span`` begins when the device work is
        launched, after the host work (the caller ends it). ``pending``: the previous step of
        these sequences (all of its rows or some), still on the device, its tokens not taken by
        them yet (an overlapped step, :mod:`dmc.inference.overlap`): what it drew is this
        step's input, and the inputs it read advance on the device (positions and the sampled
        token's index one on; gathered from its buffers when only some of its rows go on)
        instead of being filled from the host."""
        batch, filtering = len(seqs), needs_filter([s.params for s in seqs])
        key = (batch, filtering)
        buffers = self._buffers(batch)
        if pending is not None and pending.rows is not None:
            self._gather(buffers, pending)
        elif pending is not None:
            buffers.ids.copy_(pending.drawn[0])
            buffers.positions.add_(1)
            buffers.sampling.position.add_(1)
        else:
            buffers.ids.copy_(torch.tensor([s.last_token for s in seqs]), non_blocking=True)
            buffers.positions.copy_(torch.tensor([s.num_tokens - 1 for s in seqs]),
                                    non_blocking=True)
            settings = SamplingColumns.of([s.params for s in seqs], [s.seed for s in seqs],
                                          [len(s.generated) for s in seqs], torch.device("cpu"))
            for static, given in zip(buffers.sampling, settings):
                static.copy_(given, non_blocking=True)
        self.kv.begin_decode([s.slot for s in seqs], buffers.positions, buffers,
                             self.max_length, overlap=pending is not None)
        if span is not None:
            span.begin()
        if not self.capture:
            return self._device_work(buffers, filtering)
        if key not in self.warm:
            self.warm.add(key)
            return self._warm_up(buffers, filtering)
        if key not in self.graphs:
            self.graphs[key] = self._capture(buffers, filtering)
        graph, drawn = self.graphs[key]
        graph.replay()
        return drawn

    def _gather(self, buffers: StepBuffers, pending: Continued) -> None:
        """Fill ``buffers`` from the rows ``pending.rows`` of the previous step's inputs and
        output, one on (device gathers; the row indices go over in one non-blocking copy)."""
        previous = self.buffers[pending.batch]
        rows = to_device(torch.tensor(pending.rows, dtype=torch.long), self.device)
        buffers.ids.copy_(pending.drawn[0][rows])
        torch.add(previous.positions[rows], 1, out=buffers.positions)
        for static, earlier in zip(buffers.sampling, previous.sampling):
            static.copy_(earlier[rows])
        buffers.sampling.position.add_(1)

    def _device_work(self, buffers: StepBuffers, filtering: bool) -> torch.Tensor:
        logits = self.runner.decode_forward(buffers.ids, buffers.positions)
        return sample_static(logits, buffers.sampling, filtering)

    def _buffers(self, batch: int) -> StepBuffers:
        if batch not in self.buffers:
            def zeros(*shape):
                return torch.zeros(shape, dtype=torch.long, device=self.device)

            real = torch.zeros(batch, device=self.device)
            sampling = SamplingColumns(real, zeros(batch), real.clone(), zeros(batch),
                                       zeros(batch))
            self.buffers[batch] = StepBuffers(zeros(batch), zeros(batch), zeros(batch),
                                              zeros(batch, *self.shape), zeros(batch, *self.shape),
                                              sampling)
        return self.buffers[batch]

    def _warm_up(self, buffers: StepBuffers, filtering: bool) -> torch.Tensor:
        """The first step of a batch size, eager, on a side stream (as PyTorch's CUDA-graph
        notes ask: libraries initialise their per-stream state outside a capture)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            drawn = self._device_work(buffers, filtering)
        current.wait_stream(side)
        drawn.record_stream(current)
        return drawn

    def _capture(self, buffers: StepBuffers,
                 filtering: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record the device work of this step (capturing runs nothing: the caller replays).
        Every batch size shares one memory pool."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            drawn = self._device_work(buffers, filtering)
        return graph, drawn
