"""Teacher-forced scoring through an engine's compressed cache (:meth:`Engine.score_batch`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dmc.inference.model_runner import Segment
from dmc.inference.sequence import CompressionStats, ScoreResult

if TYPE_CHECKING:
    from dmc.inference.engine import Engine


class Scorer:
    """One sequence of :meth:`Engine.score_batch`: its tokens, and the log-probabilities (and
    logits) gathered from prefill chunks and decode steps."""

    def __init__(self, tokens: list[int], prefilled: int | None, max_seq_len: int,
                 device: torch.device, keep_logits: bool):
        if len(tokens) < 1 or len(tokens) > max_seq_len:
            raise ValueError(f"score: need 1..{max_seq_len} tokens, got {len(tokens)}")
        self.prefilled = len(tokens) if prefilled is None else int(prefilled)
        if not 1 <= self.prefilled <= len(tokens):
            raise ValueError(f"score: prefill_tokens must be None or in [1, {len(tokens)}], got "
                             f"{prefilled!r}")
        self.tokens = tokens
        self.target = torch.tensor(tokens[1:] + [0], device=device)
        self.keep_logits = keep_logits
        self.logprobs: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []

    def consume(self, start: int, logits: torch.Tensor) -> None:
        """``logits [n, vocab]`` of the positions ``start .. start + n - 1``."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        picked = logp.gather(-1, self.target[start:start + logits.shape[0], None])[:, 0]
        self.logprobs.append(picked.double().cpu())
        if self.keep_logits:
            self.logits.append(logits.float().cpu())

    def result(self, compression: CompressionStats, cache_bytes: dict) -> ScoreResult:
        return ScoreResult(torch.cat(self.logprobs)[:-1],
                           torch.cat(self.logits) if self.keep_logits else None,
                           compression, cache_bytes)


def held_bytes(engine: Engine, slot: int) -> dict:
    """:meth:`Engine.sequence_bytes` (device memory, summed in ``total``) plus ``host``: the bytes a
    policy offloaded to host memory for the sequence (OmniKV's context bank), not in ``total``."""
    out = engine.sequence_bytes(slot)
    host = getattr(engine.policy, "host_bytes", None)  # a PolicyRunner; NoPolicy offloads nothing
    out["host"] = host(slot) if host is not None else 0
    return out


@torch.inference_mode()
def score_batch(engine: Engine, sequences, return_logits: bool = False,
                prefill_tokens=None) -> list[ScoreResult]:
    """Teacher forcing of ``sequences`` (token id lists) through ``engine``'s real compressed
    cache (:meth:`Engine.score_batch`): each sequence's first ``prefill_tokens`` tokens (None: all)
    are prefilled alone in ``chunk_size`` chunks, then the others are decoded as one batch (a
    sequence leaves it when its tokens run out), so that a policy compresses as in generation
    (after the prefilled tokens under its ``"prefill"`` schedule, after every chunk and token
    under ``"streaming"``). No preemption: :class:`CacheFullError` when they do not fit."""
    sequences = [[int(t) for t in seq] for seq in sequences]
    if not 1 <= len(sequences) <= engine.max_batch:
        raise ValueError(f"score_batch: need 1..{engine.max_batch} (max_batch) sequences, "
                         f"got {len(sequences)}")
    if prefill_tokens is None or isinstance(prefill_tokens, int):
        prefill_tokens = [prefill_tokens] * len(sequences)
    if len(prefill_tokens) != len(sequences):
        raise ValueError(f"score_batch: {len(sequences)} sequences but "
                         f"{len(prefill_tokens)} prefill_tokens")
    scorers = [Scorer(tokens, prefilled, engine.max_seq_len, engine.device, return_logits)
               for tokens, prefilled in zip(sequences, prefill_tokens)]
    slots = []
    try:
        for scorer in scorers:
            slots.append(engine.cache.add_sequence())
            for start in range(0, scorer.prefilled, engine.chunk_size):
                chunk = scorer.tokens[start:min(start + engine.chunk_size, scorer.prefilled)]
                segment = Segment(slots[-1], chunk, start, all_logits=True,
                                  prompt_end=start + len(chunk) == scorer.prefilled)
                logits = engine.runner.forward([segment])
                scorer.consume(start, logits)
        for position in range(min(s.prefilled for s in scorers),
                              max(len(s.tokens) for s in scorers)):
            active = [(s, slot) for s, slot in zip(scorers, slots)
                      if s.prefilled <= position < len(s.tokens)]
            if not active:  # the shorter sequences ended before the longer prefills did
                continue
            logits = engine.runner.forward([Segment(slot, [s.tokens[position]], position,
                                                    decode=True) for s, slot in active])
            for (scorer, _), row in zip(active, logits.split(1)):
                scorer.consume(position, row)
        return [scorer.result(engine.compression(slot, len(scorer.tokens)),
                              held_bytes(engine, slot))
                for scorer, slot in zip(scorers, slots)]
    finally:
        for slot in slots:
            engine.cache.free_sequence(slot)
