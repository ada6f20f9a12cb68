"""Which tokens the next forward runs: admission, a token budget per step, page reservation and
preemption, all decided before the model runs.

Each step spends at most ``step_tokens`` tokens: one for every decoding sequence, the rest on
whole prefill chunks (a sequence's tokens cut at multiples of ``chunk_size``, as when prefilled
alone) of sequences still prefilling, then of waiting ones admitted in arrival order while
sequence slots and pages allow (a prompt is admitted while others run only if it fits at the
compression ratio measured so far, plus a page per head).

Reservation: a head grows by at most one slot per token (DMC merges or appends; a policy evicts
after the forward, if at all: under the ``"prefill"`` schedule a prompt is held whole until its
last chunk; DMS pages only the tokens leaving its window ring), so ``n`` tokens of a sequence
need at most, per head of length ``L`` gaining at most ``g <= n`` slots,
``ceil((L + g) / page_size) - ceil(L / page_size)`` new pages. Sequences are served oldest first;
when the worst case of one does not fit in the pages left, the youngest running sequence is
preempted (its pages freed, re-queued; it restarts by prefilling its prompt and the tokens it
generated, or under a KV policy (``replay``) by prefilling its prompt and feeding the tokens it
generated back one per decode step: the decode steps and evictions it had); a prefill chunk is
first shortened to what fits, unless a policy evicts after every chunk (``whole_chunks``: where
it evicts would then depend on the pages other sequences hold).
A sequence that does not fit even alone ends with ``finish_reason="cache_full"``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from dmc.inference.paging import pages_for, rows_or_zeros
from dmc.inference.cache import PagedKVCache
from dmc.inference.model_runner import Segment
from dmc.inference.sequence import Sequence


@dataclass
class SeenCompression:
    """Token-head entries written and slots kept by the sequences prefilled so far."""

    entries: int = 0
    slots: int = 0

    @property
    def ratio(self) -> float:
        return self.entries / self.slots if self.slots else 1.0


@dataclass
class StepPlan:
    """What the next forward runs: ``decode`` feeds each sequence's newest token, ``prefill``
    holds ``(sequence, chunk tokens)``; ``failed`` the sequences to end with ``cache_full`` and
    why (taken off the queues, their pages freed)."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)

    def segments(self) -> list[Segment]:
        """The forward's segments: each decode sequence's newest token (or the generated token
        it replays), then each chunk (the last one of a sequence's prefill marked
        ``prompt_end``)."""
        decode = [Segment(s.slot, [token], position, decode=True)
                  for s in self.decode for token, position in [s.decode_input]]
        return decode + [Segment(s.slot, s.tokens[s.cached:s.cached + n], s.cached,
                                 prompt_end=s.cached + n == s.prefill_end)
                         for s, n in self.prefill]

    def one_at_a_time(self) -> list[StepPlan]:
        """The plan as separate forwards: each prefill chunk alone, then the decode tokens."""
        return [StepPlan(prefill=[chunk]) for chunk in self.prefill] + [StepPlan(self.decode)]


class Scheduler:
    """Queues and the per-step plan of an engine (see the module docstring).

    Args:
        cache: the paged cache (sequence slots and pages are claimed from it).
        max_batch: most sequences holding a cache slot at once.
        chunk_size: most prefill tokens of one sequence per step.
        step_tokens: token budget of a step (decode tokens plus prefill chunks), at least
            ``max_batch + chunk_size``.
        whole_chunks: never shorten a prefill chunk to the pages left (a KV policy evicts
            after every chunk: its choices must not depend on the memory the batch holds).
        replay: a preempted sequence prefills its prompt only, then feeds the tokens it
            generated back one per decode step (:attr:`Sequence.replay`; a KV policy's hooks
            then see them as they did, not as a prompt).
    """

    def __init__(self, cache: PagedKVCache, max_batch: int, chunk_size: int, step_tokens: int,
                 whole_chunks: bool = False, replay: bool = False):
        if step_tokens < max_batch + chunk_size:
            raise ValueError(f"step_tokens ({step_tokens}) must hold max_batch + chunk_size "
                             f"({max_batch + chunk_size}) tokens: every decode token and a chunk")
        self.cache, self.max_batch = cache, max_batch
        self.chunk_size, self.step_tokens = chunk_size, step_tokens
        self.whole_chunks, self.replay = whole_chunks, replay
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.seen = SeenCompression()
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """The next step's plan; pages for its worst case are free when it returns."""
        plan = StepPlan()
        self.running.sort(key=lambda s: s.request_id)
        decoding = [s for s in self.running if s.decoding]
        budget = self.step_tokens - len(decoding)
        needs = worst_new_pages(self.cache, [s.slot for s in decoding], 1)
        if len(decoding) == len(self.running) and sum(needs) <= self.cache.free_pages:
            plan.decode = decoding  # all decode and all fit: what the loop below would find
            self._admit(plan, budget, reserved=sum(needs))
            return plan
        decode_pages = dict(zip(map(id, decoding), needs))
        reserved, i = 0, 0
        while i < len(self.running):
            seq = self.running[i]
            n = 1 if seq.decoding else self._chunk(seq)
            if n > budget and not seq.decoding:
                i += 1
                continue
            free = self.cache.free_pages - reserved
            n = n if seq.decoding else self._largest_fit(seq, n, free)
            need = decode_pages[id(seq)] if seq.decoding else self._worst_pages(seq, n)
            if need <= free:
                reserved += need
                if seq.decoding:
                    plan.decode.append(seq)
                else:
                    plan.prefill.append((seq, n))
                    budget -= n
                i += 1
            elif len(self.running) == 1:
                plan.failed.append((seq, self._too_large(seq)))
                self.cache.free_sequence(seq.slot)
                seq.slot = None
                self.running.remove(seq)
            else:
                self.preempt(self.running[-1])
        self._admit(plan, budget, reserved)
        return plan

    def _admit(self, plan: StepPlan, budget: int, reserved: int) -> None:
        heads = self.cache.num_layers * self.cache.num_kv_heads
        while self.waiting and len(self.running) < self.max_batch and budget > 0:
            seq = self.waiting[0]
            free = self.cache.free_pages - reserved
            if self.running and self._estimate_pages(seq.num_tokens) + heads > free:
                return
            n = self._chunk(seq)
            if n > budget:
                return
            n = self._largest_fit(seq, n, free)
            need = self._worst_pages(seq, n)
            if need > free:
                if self.running:
                    return
                plan.failed.append((self.waiting.pop(0), self._too_large(seq)))
                continue
            self.waiting.pop(0)
            seq.slot = self.cache.add_sequence()
            self.running.append(seq)
            plan.prefill.append((seq, n))
            reserved += need
            budget -= n

    def abort(self, request_id: int) -> Sequence | None:
        """Take request ``request_id`` off the queues (None when it is not there: unknown or
        finished); a running one keeps its slot and pages for the caller to read and free."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    return seq
        return None

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s pages and put it back in the queue (arrival order); it restarts from
        its first token (replaying the tokens it generated under ``replay``)."""
        self.cache.free_sequence(seq.slot)
        seq.slot, seq.cached, seq.decoding, seq.replay = None, 0, False, self.replay
        seq.preemptions += 1
        self.preemptions += 1
        self.running.remove(seq)
        self.waiting.append(seq)
        self.waiting.sort(key=lambda s: s.request_id)

    def advance(self, plan: StepPlan) -> list[tuple[Sequence, int]]:
        """Count the forward of ``plan`` in its sequences' ``cached`` (a prefill that ended in
        :meth:`prefilled`); the sequences that draw a token, with their rows in its logits: the
        decode ones not replaying one, then those whose prefill ended (under ``replay`` one with
        generated tokens to feed back starts decoding instead)."""
        drawing = [(seq, row) for row, seq in enumerate(plan.decode) if not seq.replaying]
        for seq in plan.decode:
            seq.cached += 1
        for row, (seq, n) in enumerate(plan.prefill, start=len(plan.decode)):
            seq.cached += n
            if seq.cached == seq.prefill_end:
                self.prefilled(seq)
                seq.decoding = seq.cached < seq.num_tokens
                if not seq.decoding:
                    drawing.append((seq, row))
        return drawing

    def prefilled(self, seq: Sequence) -> None:
        """Count a sequence whose prefill just ended in the compression seen so far."""
        lengths = self.cache.head_lengths(seq.slot)
        self.seen.entries += seq.cached * lengths.numel()
        self.seen.slots += int(lengths.sum())

    def _chunk(self, seq: Sequence) -> int:
        """The next prefill chunk of ``seq``: up to the next multiple of ``chunk_size`` (so that
        chunks, and a policy's evictions after them, do not depend on the batch) or its end."""
        return min(self.chunk_size - seq.cached % self.chunk_size, seq.prefill_end - seq.cached)

    def _worst_pages(self, seq: Sequence, n: int) -> int:
        """Pages ``n`` more tokens of ``seq`` take at most (each head gains at most
        :meth:`~dmc.inference.cache.PagedKVCache.paged_growth` slots: one per token, or for DMS
        one per token leaving the window ring)."""
        return worst_new_pages(self.cache, [seq.slot], n)[0]

    def _largest_fit(self, seq: Sequence, n: int, free: int) -> int:
        """The longest chunk of at most ``n`` tokens whose worst case fits in ``free`` pages (1
        when none does); ``n`` itself under ``whole_chunks``."""
        if self.whole_chunks:
            return n
        low, high = 1, n
        while low < high:
            middle = (low + high + 1) // 2
            if self._worst_pages(seq, middle) <= free:
                low = middle
            else:
                high = middle - 1
        return low

    def _estimate_pages(self, tokens: int) -> int:
        """Pages a prompt of ``tokens`` is expected to take, at the CR seen so far."""
        per_head = math.ceil(tokens / self.seen.ratio / self.cache.page_size)
        return per_head * self.cache.num_layers * self.cache.num_kv_heads

    def _too_large(self, seq: Sequence) -> str:
        pool = f"({self.cache.num_pages} pages of {self.cache.page_size} slots)"
        if seq.decoding:
            return (f"request {seq.request_id} alone needs more than the whole pool {pool} "
                    f"after {seq.cached + 1} tokens")
        if self.whole_chunks:
            return (f"request {seq.request_id}: its prefill chunk of {self._chunk(seq)} tokens "
                    f"after {seq.cached} does not fit in the whole pool {pool} (the KV policy "
                    f"evicts after whole chunks: lower chunk_size or add pages)")
        return (f"request {seq.request_id}: {seq.prefill_end} tokens do not fit in the whole "
                f"pool {pool}")


def worst_new_pages(cache: PagedKVCache, seq_slots: list, tokens: int) -> list[int]:
    """Pages each of ``seq_slots`` (``None``: no slot yet, nothing cached) takes at most for
    ``tokens`` more tokens, every head growing by ``cache.paged_growth``; one batched
    computation (a whole decode batch is reserved with it)."""
    cache.settle()
    held = rows_or_zeros(cache.allocator.lengths, seq_slots)
    grown = held + cache.paged_growth(seq_slots, tokens)  # long
    new = pages_for(grown, cache.page_size) - pages_for(held, cache.page_size)
    return new.sum((1, 2)).tolist()
