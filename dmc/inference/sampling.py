"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus), reproducible by seed.

Each request draws from its own ``torch.Generator`` (CPU), so what a request samples depends
only on its seed and its own logits, never on which other requests share its batch, or on
preemption (a restarted request keeps its tokens and its generator state).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How one request generates.

    max_new_tokens: most tokens to generate (>= 1); the stop token, when hit, is included.
    temperature: 0 = greedy (argmax); > 0 divides the logits before sampling.
    top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability
        reaches ``top_p`` (the most likely token is always kept, so a tiny ``top_p`` is greedy).
    top_k: keep the ``top_k`` most likely tokens first (0 = all).
    stop_tokens: generation ends after any of these ids is generated.
    seed: seed of the request's generator; ``None`` = the engine seed + the request id.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_tokens: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None

    def __post_init__(self):
        self.stop_tokens = tuple(int(t) for t in self.stop_tokens)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
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


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None = None) -> int:
    """One token id from ``logits [vocab]`` under ``params`` (argmax when greedy).

    Sampling runs on the CPU with ``generator`` (a CPU generator) so results do not depend on
    the device.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    probs = filtered_probs(logits.detach().cpu(), params.temperature, params.top_p, params.top_k)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``."""
    return torch.Generator().manual_seed(int(seed))


def sample_next(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> tuple[list[int], list[float]]:
    """One token per row of ``logits [batch, vocab]`` (greedy rows by argmax, others by
    :func:`sample_token` with their generator) and its log-probability under the model (before
    temperature, top-k, top-p)."""
    greedy = torch.argmax(logits, dim=-1).tolist()
    chosen = [greedy[i] if p.greedy else sample_token(logits[i], p, generators[i])
              for i, p in enumerate(params)]
    picked = torch.tensor(chosen, device=logits.device)[:, None]
    return chosen, torch.log_softmax(logits.float(), dim=-1).gather(-1, picked)[:, 0].tolist()
