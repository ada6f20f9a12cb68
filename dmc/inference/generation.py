"""Offline generation: queue prompts on an :class:`~dmc.inference.engine.Engine` and step it
until each has finished (continuous batching); what ``Engine.generate`` runs."""
from __future__ import annotations

from collections.abc import Sequence as Seq

from dmc.inference.sampling import SamplingParams
from dmc.inference.sequence import GenerationResult


def generate(engine, prompts: Seq[Seq[int]],
             params: SamplingParams | Seq[SamplingParams] | None = None, *,
             progress: bool = False) -> list[GenerationResult]:
    """Generate for every prompt on ``engine``; results in prompt order.

    ``params`` is one :class:`SamplingParams` for all prompts or one per prompt; ``progress``
    shows a tqdm bar over generated tokens (of all running requests). Requests queued earlier
    with ``engine.add_request`` run alongside; their results come from the engine's next
    ``step()``.
    """
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"generate: {len(prompts)} prompts but {len(params)} params")
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    budget = {i: sp.max_new_tokens for i, sp in zip(ids, params)}
    results: dict[int, GenerationResult] = {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(budget.values()), unit="tok", desc="generate")
    wanted = set(ids)
    while wanted - results.keys():
        if not engine.has_unfinished():
            raise RuntimeError("generate: requests vanished from the engine")
        before = engine.stats.generated_tokens
        for result in engine.step():
            if result.request_id not in wanted:  # queued by add_request: the next step()
                engine._unclaimed.append(result)
                continue
            results[result.request_id] = result
            if bar is not None:  # a stop token ends a request early: count its rest as done
                bar.update(budget[result.request_id] - len(result.tokens))
        if bar is not None:
            bar.update(engine.stats.generated_tokens - before)
    if bar is not None:
        bar.close()
    return [results[i] for i in ids]
