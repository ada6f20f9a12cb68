"""Request and sequence state of :class:`~dmc.inference.engine.Engine`, and what it returns."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch

from dmc.inference.sampling import SamplingParams


@dataclass
class CompressionStats:
    """Measured compression of the cache of one sequence (or of several, summed).

    tokens: tokens written into every (layer, KV head), summed over sequences.
    slots: ``[layers, kv_heads]`` slots kept, summed over sequences.
    CR = tokens / slots (per head), ``tokens * heads / sum(slots)`` per layer and overall:
    against the model's own KV heads, so a GQA model that keeps every token reads 1.0 (its
    saving against the heads of the model it was pooled from is ``slots_cr`` in
    :func:`dmc.eval.compare.evaluate_method`'s result).
    """

    tokens: int
    slots: torch.Tensor

    @property
    def overall(self) -> float:
        return _ratio(self.tokens * self.slots.numel(), int(self.slots.sum()))

    @property
    def per_layer(self) -> list[float]:
        heads = self.slots.shape[1]
        return [_ratio(self.tokens * heads, int(s)) for s in self.slots.sum(1)]

    @property
    def per_head(self) -> list[list[float]]:
        return [[_ratio(self.tokens, int(s)) for s in row] for row in self.slots]

    def __add__(self, other: CompressionStats) -> CompressionStats:
        return CompressionStats(self.tokens + other.tokens, self.slots + other.slots)

    @staticmethod
    def combine(stats: Iterable[CompressionStats]) -> CompressionStats:
        stats = list(stats)
        if not stats:
            raise ValueError("CompressionStats.combine needs at least one entry")
        total = stats[0]
        for s in stats[1:]:
            total = total + s
        return total

    def to_dict(self) -> dict:
        return {
            "cr": self.overall,
            "tokens": self.tokens,
            "slots": int(self.slots.sum()),
            "per_layer": self.per_layer,
            "per_head": self.per_head,
        }


def _ratio(tokens: int, slots: int) -> float:
    return tokens / slots if slots else 1.0


@dataclass
class GenerationResult:
    """A finished request.

    tokens: generated ids (the stop token included when one ended the request).
    finish_reason: ``"stop"`` (a stop token), ``"length"`` (``max_new_tokens``),
        ``"cache_full"`` (the request alone outgrew the whole page pool: ``tokens`` holds what
        it generated before, ``error`` says why; the other requests are not affected) or
        ``"abort"`` (:meth:`Engine.abort`: ``tokens`` holds what it generated before).
    logprobs: log-probability of each generated token under the model (before temperature,
        top-k, top-p).
    compression: the cache at the end (prompt + generated tokens but the last, which was never
        fed back).
    kv_pages, kv_bytes: pages (and their K+V bytes) the sequence held at the end.
    preemptions: how many times it was preempted and restarted.
    time_to_first_token: seconds from :meth:`Engine.add_request` to its first sampled token.
    """

    request_id: int
    prompt: list[int]
    tokens: list[int]
    finish_reason: str
    logprobs: list[float]
    compression: CompressionStats
    kv_pages: int
    kv_bytes: int
    preemptions: int = 0
    error: str | None = None
    time_to_first_token: float | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["compression"] = self.compression.to_dict()
        return out


@dataclass
class ScoreResult:
    """Teacher-forced scoring of one token sequence (see :meth:`Engine.score`).

    token_logprobs: ``[n - 1]`` float64, ``log p(tokens[i + 1] | tokens[: i + 1])``.
    logits: ``[n, vocab]`` float32 when asked for, else None.
    compression: the cache after all ``n`` tokens (with a policy: the slots it holds on the
        device, so CR is the measured one; OmniKV without offload keeps every slot resident, so
        its CR is 1, see :mod:`dmc.policies.omnikv`).
    cache_bytes: what the cache held for the sequence after all ``n`` tokens on the device (see
        :meth:`Engine.sequence_bytes`; ``total``) and, apart, ``host``: what a policy offloaded
        to host memory (:func:`dmc.inference.scoring.held_bytes`).
    """

    token_logprobs: torch.Tensor
    logits: torch.Tensor | None
    compression: CompressionStats
    cache_bytes: dict = field(default_factory=dict)


@dataclass
class Sequence:
    """A request's state while it is queued, prefilling or decoding.

    ``slot`` is its cache sequence slot while it holds one (None while waiting); ``cached`` the
    tokens of :attr:`tokens` already written to the cache; ``decoding`` once its prefill is done
    and a token was sampled (each step then feeds its newest token). A preempted sequence starts
    over: its prompt and the tokens it generated are prefilled again, or with ``replay`` (set
    by the scheduler under a KV policy) its prompt is prefilled and the tokens it generated are
    fed back one per decode step, drawing nothing, before it draws again. ``arrived`` and
    ``first_token`` are ``time.perf_counter()`` readings (queued, first token sampled). ``seed``
    keys its sampling noise (see :func:`dmc.inference.sampling.sample_next`).
    """

    request_id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int | None = None
    cached: int = 0
    decoding: bool = False
    preemptions: int = 0
    replay: bool = False
    arrived: float = 0.0
    first_token: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def num_tokens(self) -> int:
        """``len(self.tokens)`` without building the list (read every decode step)."""
        return len(self.prompt) + len(self.generated)

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]

    @property
    def prefill_end(self) -> int:
        """Tokens prefilled before it decodes: its prompt under ``replay``, else all of them."""
        return len(self.prompt) if self.replay else self.num_tokens

    @property
    def replaying(self) -> bool:
        """Whether its next decode step feeds back a token it generated before a preemption
        (whose successor is known: the step draws nothing)."""
        return self.replay and self.cached < self.num_tokens - 1

    @property
    def decode_input(self) -> tuple[int, int]:
        """The token its next decode step feeds and that token's position: the first one not
        cached while :attr:`replaying`, else the newest."""
        if self.replaying:
            return self.generated[self.cached - len(self.prompt)], self.cached
        return self.last_token, self.num_tokens - 1

    @staticmethod
    def check_prompt(prompt: list[int], params: SamplingParams, max_seq_len: int,
                     vocab: int) -> None:
        """ValueError unless ``prompt`` holds ids in ``[0, vocab)`` and, with
        ``params.max_new_tokens``, fits in ``max_seq_len`` tokens."""
        if not prompt:
            raise ValueError("add_request: the prompt must hold at least one token")
        longest = len(prompt) + params.max_new_tokens - 1
        if longest > max_seq_len:
            raise ValueError(
                f"add_request: prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens})"
                f" - 1 = {longest} tokens exceed max_seq_len = {max_seq_len}"
            )
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"add_request: token ids must be in [0, {vocab})")

    def result(self, reason: str, compression: CompressionStats, pages: int, page_bytes: int,
               error: str | None = None) -> GenerationResult:
        """Its :class:`GenerationResult` (``pages`` held at the end, of ``page_bytes`` each)."""
        ttft = None if self.first_token is None else self.first_token - self.arrived
        return GenerationResult(self.request_id, self.prompt, list(self.generated), reason,
                                list(self.logprobs), compression, pages, pages * page_bytes,
                                self.preemptions, error, ttft)


@dataclass
class EngineStats:
    """Counters since the last :meth:`Engine.reset_stats`. Seconds of forwards (with their
    sampling and the read of the tokens) holding a prefill chunk go to ``prefill_seconds``;
    ``decode_*`` count forwards of decode tokens only. ``decode_device_seconds``: of
    ``decode_seconds``, the device's (:class:`~dmc.inference.device_span.DeviceSpan`) from the
    launch of the forward to the end of sampling; the rest is host work. With
    ``cuda_graphs=True`` the launch comes after the step's host work (page reservation, the
    static inputs); an eager forward does that work inside itself, where it counts as the
    device's. Under ``overlap=True`` a decode step's seconds run from the end of the previous
    one (or its own start) to its read-back: the steady step time, host work overlapped, and
    ``decode_tokens`` counts the token a step drew for a sequence that had stopped the step
    before (computed, then dropped; ``generated_tokens`` counts only the tokens kept);
    ``continued_steps``: the decode steps launched from the previous step's output without a
    drain (:meth:`~dmc.inference.overlap.DecodePipeline.advance`)."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_device_seconds: float = 0.0
    generated_tokens: int = 0
    continued_steps: int = 0
    preemptions: int = 0
    peak_running: int = 0
    peak_pages: int = 0

    def add_decode(self, seconds: float, device_seconds: float, tokens: int) -> None:
        """Count a forward of ``tokens`` decode tokens."""
        self.decode_seconds += seconds
        self.decode_device_seconds += device_seconds
        self.decode_steps += 1
        self.decode_tokens += tokens

    def to_dict(self) -> dict:
        return asdict(self)
