"""Needle-in-a-haystack retrieval scored through the real compressed cache.

Each :class:`~dmc.data.needle.NeedleExample` is teacher-forced with
``Engine.score_batch(tokens, prefill_tokens=prompt_len)``: the prompt (haystack, needle, query
key) is prefilled, so a KV policy compresses it as it would before generating, and the answer
tokens go one at a time through the decode path. Greedy generation returns the answer exactly
when every answer token is the argmax given the answer tokens before it, so exact-match accuracy
of greedy generation is read off the same pass, with the per-token accuracy and the answer's NLL.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from dmc.data.needle import NeedleExample


def evaluate_needle(engine, examples: Sequence[NeedleExample]) -> dict:
    """Needle scores of ``engine`` (a :class:`dmc.inference.Engine`), ``engine.max_batch``
    examples at a time (:meth:`Engine.score_batch`). Returns a JSON-able dict::

        {"accuracy" (exact match of greedy generation), "accuracy_ci" (95% Wilson),
         "token_accuracy" (answer tokens that are the argmax given the true prefix),
         "answer_nll" (mean per answer token), "examples",
         "per_length": {tokens: {"accuracy", "accuracy_ci", "examples"}},
         "per_depth": {depth: {"accuracy", "accuracy_ci", "examples"}},
         "compression": {"cr", ...} (the caches after each whole example, summed; per the
             model's own KV heads, see :class:`dmc.inference.CompressionStats`),
         "cache_bytes": {"kv", ..., "total"} (summed)}
    """
    from dmc.inference import CompressionStats

    if not examples:
        raise ValueError("evaluate_needle: no examples")
    exact, hits, answer_tokens, nll, stats, cache_bytes = [], 0, 0, 0.0, [], []
    for start in range(0, len(examples), engine.max_batch):
        batch = examples[start:start + engine.max_batch]
        results = engine.score_batch([ex.tokens for ex in batch],
                                     prefill_tokens=[ex.prompt_len for ex in batch],
                                     return_logits=True)
        for ex, result in zip(batch, results):
            rows = slice(ex.prompt_len - 1, len(ex.tokens) - 1)  # logits that predict the answer
            correct = result.logits[rows].argmax(dim=-1) == torch.tensor(ex.answer)
            exact.append(bool(correct.all()))
            hits += int(correct.sum())
            answer_tokens += len(ex.answer)
            nll -= float(result.token_logprobs[rows].sum())
            stats.append(result.compression)
            cache_bytes.append(result.cache_bytes)
    return {
        **_accuracy(exact),
        "token_accuracy": hits / answer_tokens,
        "answer_nll": nll / answer_tokens,
        "examples": len(examples),
        "per_length": _grouped(exact, [len(ex.tokens) for ex in examples]),
        "per_depth": _grouped(exact, [f"{ex.depth:g}" for ex in examples]),
        "compression": CompressionStats.combine(stats).to_dict(),
        "cache_bytes": {k: sum(b[k] for b in cache_bytes) for k in cache_bytes[0]},
    }


def _accuracy(exact: Sequence[bool]) -> dict:
    from dmc.eval.stats import wilson_interval

    return {"accuracy": sum(exact) / len(exact),
            "accuracy_ci": list(wilson_interval(sum(exact), len(exact)))}


def _grouped(exact: Sequence[bool], keys: Sequence) -> dict:
    groups: dict = {}
    for key, ok in zip(keys, exact):
        groups.setdefault(key, []).append(ok)
    return {key: {**_accuracy(oks), "examples": len(oks)} for key, oks in sorted(groups.items())}
