"""Decode steps replayed from CUDA graphs, one graph per batch size.

A forward of decode tokens only (the steady state of generation) splits into host work and
device work. The host work is the scheduler's plan and :meth:`KVWrite.begin_decode
<dmc.inference.kv_write.KVWrite.begin_decode>`: the sequence rows validated, the pages of the
step reserved. The device work, :meth:`ModelRunner.decode_forward
<dmc.inference.model_runner.ModelRunner.decode_forward>` (embedding, each layer's cache write and
attention, logits), reads only the cache's tensors and the static tensors of its batch size
(:class:`StepBuffers`: token ids, positions, sequence rows, the slots reserved for vanilla
appends), and launches the same kernels at every step of that size: the attention's launch size
is fixed by the longest head a block table can hold. So on CUDA the device work of a batch size
is captured once and replayed: a step costs one graph launch instead of dozens of kernel
launches per layer, each with its Python dispatch. A batch size runs eagerly the first time
(Triton compiles its kernels, lazy initialisations happen outside a capture), is captured the
second time and replayed from then on. Without CUDA (or with ``capture=False``) the same static
path runs eagerly every time: the CPU tests compare it with the ordinary forward.

Not captured: forwards with prefill chunks (their shapes change), KV policies (their hooks run
on the host) and DMS (its decode write branches on the host on the tokens leaving the window):
:class:`~dmc.inference.engine.Engine` refuses ``cuda_graphs=True`` with a policy or a DMS model
and runs the steps that prefill eagerly.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from dmc.inference.model_runner import ModelRunner


class StepBuffers(NamedTuple):
    """The static inputs of one batch size's captured step: ``ids, positions, rows [batch]``
    (token ids, their positions, the sequences' cache slots) and ``pages, offsets [batch,
    num_layers, kv_heads]`` (the slots reserved for vanilla appends; unused under DMC), all
    long on the cache's device."""

    ids: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    pages: torch.Tensor
    offsets: torch.Tensor


class DecodeGraphs:
    """Decode-only forwards of ``runner`` through static buffers, replayed from a CUDA graph
    per batch size when ``capture`` (default: on CUDA), else run eagerly.

    ``captured``: the batch sizes with a graph."""

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
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.warm: set[int] = set()
        self.pool = None

    @property
    def captured(self) -> list[int]:
        return sorted(self.graphs)

    def forward(self, seq_slots: list[int], tokens: list[int],
                positions: list[int]) -> torch.Tensor:
        """Logits ``[batch, vocab]`` of one token per sequence: ``tokens[i]`` at
        ``positions[i]`` of the sequence in cache slot ``seq_slots[i]``. Valid until the next
        call (a graph's output is overwritten by its next replay)."""
        batch = len(seq_slots)
        buffers = self._buffers(batch)
        buffers.ids.copy_(torch.tensor(tokens), non_blocking=True)
        buffers.positions.copy_(torch.tensor(positions), non_blocking=True)
        self.kv.begin_decode(seq_slots, buffers.positions, buffers, self.max_length)
        if not self.capture or batch not in self.warm:
            self.warm.add(batch)
            return self.runner.decode_forward(buffers.ids, buffers.positions)
        if batch not in self.graphs:
            self.graphs[batch] = self._capture(buffers)
        graph, logits = self.graphs[batch]
        graph.replay()
        return logits

    def _buffers(self, batch: int) -> StepBuffers:
        if batch not in self.buffers:
            def zeros(*shape):
                return torch.zeros(shape, dtype=torch.long, device=self.device)

            self.buffers[batch] = StepBuffers(zeros(batch), zeros(batch), zeros(batch),
                                              zeros(batch, *self.shape), zeros(batch, *self.shape))
        return self.buffers[batch]

    def _capture(self, buffers: StepBuffers) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record the device work of this step (capturing runs nothing: the caller replays).
        Every batch size shares one memory pool."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.runner.decode_forward(buffers.ids, buffers.positions)
        return graph, logits
