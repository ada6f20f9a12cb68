"""Needle-in-a-haystack retrieval scored through the real compressed cache.

Each :class:`~dmc.data.needle.NeedleExample` is teacher-forced with
``Engine.score(tokens, prefill_tokens=prompt_len)``: the prompt (haystack, needle, query key) is
prefilled, so a KV policy compresses it as it would before generating, and the answer tokens go
one at a time through the decode path. Greedy generation returns the answer exactly when every
answer token is the argmax given the answer tokens before it, so exact-match accuracy of greedy
generation is read off the same pass, with the per-token accuracy and the answer's NLL.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from dmc.data.needle import NeedleExample


def evaluate_needle(engine, examples: Sequence[NeedleExample]) -> dict:
    """Needle scores of ``engine`` (a :class:`dmc.inference.Engine`). Returns a JSON-able dict::

        {"accuracy" (exact match of greedy generation), "token_accuracy" (answer tokens that
         are the argmax given the true prefix), "answer_nll" (mean per answer token),
         "examples", "per_depth": {depth: accuracy},
         "compression": {"cr", ...} (the caches after each whole example, summed)}
    """
    from dmc.inference.engine import CompressionStats

    if not examples:
        raise ValueError("evaluate_needle: no examples")
    exact, hits, answer_tokens, nll, stats = [], 0, 0, 0.0, []
    by_depth: dict[str, list[bool]] = {}
    for ex in examples:
        result = engine.score(ex.tokens, prefill_tokens=ex.prompt_len, return_logits=True)
        rows = slice(ex.prompt_len - 1, len(ex.tokens) - 1)  # logits that predict the answer
        greedy = result.logits[rows].argmax(dim=-1)
        correct = greedy == torch.tensor(ex.answer)
        exact.append(bool(correct.all()))
        by_depth.setdefault(f"{ex.depth:g}", []).append(exact[-1])
        hits += int(correct.sum())
        answer_tokens += len(ex.answer)
        nll -= float(result.token_logprobs[rows].sum())
        stats.append(result.compression)
    return {
        "accuracy": sum(exact) / len(exact),
        "token_accuracy": hits / answer_tokens,
        "answer_nll": nll / answer_tokens,
        "examples": len(examples),
        "per_depth": {d: sum(v) / len(v) for d, v in by_depth.items()},
        "compression": CompressionStats.combine(stats).to_dict(),
    }
