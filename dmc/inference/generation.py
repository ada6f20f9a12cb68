"""Offline generation: queue prompts on an :class:`~dmc.inference.engine.Engine` and step it
until each has finished (continuous batching). :func:`stream` hands out each request's tokens
as the steps sample them (what a server streams to its clients, and what inter-token latency
is measured on); :func:`generate`, what ``Engine.generate`` runs, collects the results."""
from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import NamedTuple

from dmc.inference.sampling import SamplingParams
from dmc.inference.sequence import GenerationResult


class TokenDelta(NamedTuple):
    """What one engine step gave a request of :func:`stream`: ``index``, its prompt's position;
    ``tokens`` and ``logprobs``, sampled since its previous delta, in order (a token is never
    taken back: a preempted request recomputes and keeps the tokens it had); ``result``, its
    :class:`GenerationResult` in its last delta (the step it finished at; the delta may then
    hold no token, as for an aborted request), else None."""

    index: int
    tokens: list[int]
    logprobs: list[float]
    result: GenerationResult | None = None


def per_prompt(prompts: Seq[Seq[int]],
               params: SamplingParams | Seq[SamplingParams] | None) -> list[SamplingParams]:
    """``params`` as one :class:`SamplingParams` per prompt (one given for all, or None for the
    defaults); ValueError when a list has another length."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"generate: {len(prompts)} prompts but {len(params)} params")
    return list(params)


def stream(engine, prompts: Seq[Seq[int]],
           params: SamplingParams | Seq[SamplingParams] | None = None) -> Iterator[TokenDelta]:
    """Queue every prompt on ``engine`` and step it until all have finished, yielding after
    each step a :class:`TokenDelta` for every one of these requests that gained tokens or
    finished, in prompt order. Under ``overlap`` a step's tokens come with the next step's
    read-back (one step late, as :meth:`Engine.step` returns them). Requests queued earlier
    with ``engine.add_request`` run alongside; their results come from the engine's next
    ``step()``."""
    params = per_prompt(prompts, params)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    index = {request_id: i for i, request_id in enumerate(ids)}
    sent = dict.fromkeys(ids, 0)  # tokens handed out so far, of the requests not finished
    while sent:
        if not engine.has_unfinished():
            raise RuntimeError("generate: requests vanished from the engine")
        finished = {}
        for result in engine.step():
            if result.request_id in sent:
                finished[result.request_id] = result
            else:  # queued by add_request: the next step()
                engine._unclaimed.append(result)
        queued = engine.scheduler.running + list(engine.scheduler.waiting)
        live = {seq.request_id: seq for seq in queued if seq.request_id in sent}
        for request_id in list(sent):
            result = finished.get(request_id)
            source = result if result is not None else live[request_id]
            tokens = result.tokens if result is not None else source.generated
            done = sent[request_id]
            if len(tokens) > done or result is not None:
                yield TokenDelta(index[request_id], list(tokens[done:]),
                                 list(source.logprobs[done:]), result)
            sent[request_id] = len(tokens)
            if result is not None:
                del sent[request_id]


def generate(engine, prompts: Seq[Seq[int]],
             params: SamplingParams | Seq[SamplingParams] | None = None, *,
             progress: bool = False) -> list[GenerationResult]:
    """Generate for every prompt on ``engine`` (:func:`stream`); results in prompt order.

    ``params`` is one :class:`SamplingParams` for all prompts or one per prompt; ``progress``
    shows a tqdm bar over these requests' tokens (a request ended by a stop token counts its
    unused budget as done).
    """
    params = per_prompt(prompts, params)
    results: list[GenerationResult | None] = [None] * len(prompts)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(sp.max_new_tokens for sp in params), unit="tok", desc="generate")
    for delta in stream(engine, prompts, params):
        if bar is not None:
            bar.update(len(delta.tokens))
        if delta.result is not None:
            results[delta.index] = delta.result
            if bar is not None:
                bar.update(params[delta.index].max_new_tokens - len(delta.result.tokens))
    if bar is not None:
        bar.close()
    return results
