"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus), reproducible by seed.

:func:`sample_on_device` samples a whole batch at once on the logits' device and leaves the
tokens there (the engine reads them back with the cache's lengths, in one copy per step;
:func:`sample_next` reads them itself). Sampled rows draw by
the Gumbel-max trick with counter-based noise: the noise of vocabulary id ``v`` when a request
generates its ``i``-th token is an integer hash of ``(seed, i, v)``. So what a request samples
depends only on its seed, the index of the token and its own logits: never on which other
requests share its batch, and not on preemption (a restarted request regenerates the same
tokens, since there is no generator state to carry over). :func:`filtered_probs` is the
readable one-row reference of the distribution that :func:`filtered_scores` computes batched.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from dmc.inference.paging import to_device


GREEDY_BELOW = 1e-5  # a temperature under this samples greedily


@dataclass
class SamplingParams:
    """How one request generates.

    max_new_tokens: most tokens to generate (>= 1); the stop token, when hit, is included.
    temperature: 0 = greedy (argmax); > 0 divides the logits before sampling. Below
        :data:`GREEDY_BELOW` it is greedy (set to 0), as in vLLM: the float32 logits divided by
        a smaller one overflow.
    top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability
        reaches ``top_p`` (the most likely token is always kept, so a tiny ``top_p`` is greedy).
    top_k: keep the ``top_k`` most likely tokens first (0 = all).
    stop_tokens: generation ends after any of these ids is generated.
    seed: seed of the request's sampling noise; ``None`` = the engine seed + the request id.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_tokens: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None

    def __post_init__(self):
        for name in ("max_new_tokens", "top_k", "seed"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or int(value) != value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            setattr(self, name, None if value is None else int(value))
        if isinstance(self.stop_tokens, (int, str)) or any(
                isinstance(t, bool) or int(t) != t for t in self.stop_tokens):
            raise ValueError(f"stop_tokens must be a sequence of integer token ids, got "
                             f"{self.stop_tokens!r}")
        self.stop_tokens = tuple(int(t) for t in self.stop_tokens)
        for name in ("temperature", "top_p"):
            if isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                   top_k: int = 0) -> torch.Tensor:
    """Sampling distribution ``[vocab]`` (float32) after temperature, top-k and top-p.

    Args:
        logits: ``[vocab]`` raw logits of one position.
        temperature: > 0.
        top_p, top_k: as in :class:`SamplingParams`.
    """
    if temperature <= 0:
        raise ValueError(f"filtered_probs: temperature must be > 0, got {temperature}")
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly before each
        drop = before >= top_p
        drop[0] = False  # the most likely token always stays
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def _int64(value: int) -> int:
    """``value`` modulo 2^64 as a signed 64-bit integer (how a torch int64 holds its bits)."""
    value &= 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >> 63 else value


GOLDEN = _int64(0x9E3779B97F4A7C15)  # splitmix64's increment, 2^64 / golden ratio
MIX1 = _int64(0xBF58476D1CE4E5B9)
MIX2 = _int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of the 64 bits of int64 ``x`` (torch's ``>>`` copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijective hash of the 64 bits of int64 ``x``, same shape.

    The products wrap modulo 2^64 (two's complement), as the unsigned arithmetic of splitmix64.
    """
    x = (x ^ _shr(x, 30)) * MIX1
    x = (x ^ _shr(x, 27)) * MIX2
    return x ^ _shr(x, 31)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor,
                 vocab_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise (float64), a deterministic function of its three int64 arguments.

    Args:
        seeds: ``[rows, 1]`` each row's request seed.
        positions: ``[rows, 1]`` index of the token being generated in the request (0 = first).
        vocab_ids: ``[rows, vocab]`` the vocabulary id each noise value belongs to.

    Returns ``[rows, vocab]``: the ``(v + 1)``-th output of a splitmix64 stream whose state is a
    hash of ``(seed, position)``, its top 52 bits ``k`` made uniform ``u = (k + 1/2) / 2^52`` in
    (0, 1) (exact in float64, never 0 or 1), then ``-log(-log u)``.
    """
    state = mix64(mix64(seeds) + (positions + 1) * GOLDEN)
    bits = mix64(state + (vocab_ids + 1) * GOLDEN)
    uniform = (_shr(bits, 12).double() + 0.5) / 2.0 ** 52
    return -torch.log(-torch.log(uniform))


def filtered_scores(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, *, filtering: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched :func:`filtered_probs` as log-probabilities up to a per-row constant, sorted.

    Args:
        logits: ``[rows, vocab]`` raw logits.
        temperature: ``[rows]`` (float32, > 0); top_k: ``[rows]`` (int64, 0 = all);
            top_p: ``[rows]`` (float32, in (0, 1]), as in :class:`SamplingParams`.

    Returns ``(scores, ids)``, both ``[rows, vocab]``: each row's tempered logits sorted in
    descending order (float32), ``-inf`` where top-k or top-p drops the token (never the first),
    and the vocabulary id of each entry (int64). ``softmax(scores)`` scattered back to ``ids``
    is :func:`filtered_probs` of the row. ``filtering=False`` (the caller knows that no row
    has top-k or top-p) returns the tempered logits unsorted and ``ids = arange(vocab)``: the
    same pairs of score and id, without the sort.
    """
    if not filtering:
        ids = torch.arange(logits.shape[-1], device=logits.device).expand(logits.shape)
        return logits.float() / temperature[:, None], ids
    scores, ids = torch.sort(logits.float() / temperature[:, None], dim=-1, descending=True)
    vocab = scores.shape[-1]
    keep = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    scores = scores.masked_fill(scores < scores.gather(-1, keep[:, None] - 1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each
    drop = (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False  # the most likely token always stays
    return scores.masked_fill(drop, float("-inf")), ids


def sample_next(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                positions: list[int]) -> tuple[list[int], list[float]]:
    """:func:`sample_on_device`, read to the host: each row's token and its log-probability."""
    host = sample_on_device(logits, params, seeds, positions).cpu()
    return [int(t) for t in host[0].tolist()], host[1].tolist()


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                     positions: list[int]) -> torch.Tensor:
    """One token per row of ``logits [batch, vocab]`` and its log-probability under the model,
    left on the logits' device: ``[2, batch]`` float64 (tokens, then log-probabilities; ids are
    exact in float64), for the caller to read back with whatever else it reads.

    Args:
        logits: ``[batch, vocab]`` raw logits, one row per request, on any device.
        params: each row's :class:`SamplingParams`.
        seeds: each row's request seed (any integer, taken modulo 2^64).
        positions: index of the token each row generates in its request (0 = first).

    Greedy rows take the argmax. Sampled rows use the Gumbel-max trick: with ``g`` i.i.d.
    standard Gumbel, ``argmax(log p + g)`` is distributed as ``p`` (here ``p`` =
    :func:`filtered_probs`, through :func:`filtered_scores`), so sampling is an elementwise add
    and an argmax over the whole batch. The noise (:func:`gumbel_noise`) is counter-based, a
    hash of (seed, position, vocabulary id) computed on the device: a row's token does not
    depend on the other rows, no generator state is kept (a preempted request resamples the same
    tokens) and nothing is read from the device (the per-row settings go to it without a
    stream sync); the log-probability is under the model, before temperature, top-k and top-p.
    """
    device = logits.device
    tokens = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        settings = SamplingColumns.of([params[i] for i in rows], [seeds[i] for i in rows],
                                      [positions[i] for i in rows], device)
        index = to_device(torch.tensor(rows), device)
        tokens[index] = gumbel_pick(logits[index], settings, needs_filter(params))
    return with_logprobs(logits, tokens)


class SamplingColumns(NamedTuple):
    """Per-row sampling settings on the device, ``[rows]`` each: temperature (float32, > 0
    where a row samples), top_k (int64), top_p (float32), seed (int64, modulo 2^64) and the
    index of the token generated (int64)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor

    @classmethod
    def of(cls, params: list[SamplingParams], seeds: list[int], positions: list[int],
           device: torch.device) -> SamplingColumns:
        def column(values, dtype):
            return to_device(torch.tensor(values, dtype=dtype), device)

        return cls(column([p.temperature for p in params], torch.float32),
                   column([p.top_k for p in params], torch.long),
                   column([p.top_p for p in params], torch.float32),
                   column([_int64(s) for s in seeds], torch.long),
                   column(positions, torch.long))


def needs_filter(params: list[SamplingParams]) -> bool:
    """Whether a sampled row has top-k or top-p (else :func:`filtered_scores` skips its sort)."""
    return any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params)


def gumbel_pick(logits: torch.Tensor, settings: SamplingColumns, filtering: bool) -> torch.Tensor:
    """The Gumbel-max draw of every row of ``logits [rows, vocab]`` under ``settings`` (see
    :func:`sample_on_device`): ``[rows]`` token ids. A row's draw depends on its own logits and
    settings only; ``filtering`` False (no row has top-k or top-p) draws the same tokens without
    the sort, on CUDA in one Triton launch (:mod:`dmc.inference.kernels.gumbel`)."""
    if not filtering and logits.is_cuda:
        from dmc.inference.kernels.gumbel import gumbel_argmax

        return gumbel_argmax(logits, settings.temperature, settings.seed, settings.position)
    scores, ids = filtered_scores(logits, settings.temperature, settings.top_k, settings.top_p,
                                  filtering=filtering)
    noise = gumbel_noise(settings.seed[:, None], settings.position[:, None], ids)
    best = torch.argmax(scores.double() + noise, dim=-1, keepdim=True)
    return ids.gather(-1, best)[:, 0]


def sample_static(logits: torch.Tensor, settings: SamplingColumns,
                  filtering: bool) -> torch.Tensor:
    """:func:`sample_on_device` with the same shapes for any mix of greedy and sampled rows
    (what a captured decode step runs): every row is drawn, rows of temperature 0 then take the
    argmax. ``[2, rows]`` float64, equal to :func:`sample_on_device` row for row."""
    sampled = settings.temperature > 0
    drawn = gumbel_pick(logits, settings._replace(
        temperature=torch.where(sampled, settings.temperature, 1.0)), filtering)
    return with_logprobs(logits, torch.where(sampled, drawn, torch.argmax(logits, dim=-1)))


def with_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[2, rows]`` float64: ``tokens [rows]`` and their log-probabilities under ``logits``."""
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, None])[:, 0]
    return torch.stack((tokens.double(), logps.double()))
