"""Decode steps launched before the previous one is read back (``Engine(overlap=True)``,
:mod:`dmc.inference.overlap`): the requests end with what the engine without overlap gives
them, token for token, through batches that shrink, stop tokens learned one step late, waiting
requests that join, and pools too small for two steps ahead (the CUDA version:
test_engine_gpu.py)."""
import pytest
import torch

from dmc.inference import Engine, SamplingParams
from dmc.policies import get_policy
from test_dms_engine import build_dms
from test_engine import build, check_against_model, prompts

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (13, 21, 7, 9)


def serve(model, groups, overlap, params, lengths=LENGTHS, max_batch=4, pages=36):
    """``generate`` on a small pool (see test_decode_graphs.generate), with how many steps the
    pipeline continued without a drain."""
    engine = Engine(model, page_size=4, max_batch=max_batch, chunk_size=5,
                    num_pages=pages * groups, cuda_graphs=True, overlap=overlap)
    continued = []
    if overlap:
        advance = engine.pipeline.advance
        engine.pipeline.advance = lambda finished: continued.append(advance(finished)) or \
            continued[-1]
    return engine, engine.generate(prompts(lengths), params), sum(continued)


def same_results(expected, results, exact_logprobs=True):
    for a, b in zip(expected, results):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        assert torch.equal(a.compression.slots, b.compression.slots)
        assert a.compression.tokens == b.compression.tokens
        assert a.kv_pages == b.kv_pages
        if exact_logprobs:
            assert a.logprobs == b.logprobs
        else:
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                       atol=1e-5, rtol=0)


@pytest.mark.parametrize("groups,window", [(4, "vanilla"), (2, "vanilla"), (2, 3), (4, None)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_overlapped_steps_equal_the_engine_without_overlap(parallel_1x1, groups, window,
                                                           temperature):
    """The batch shrinks as requests reach their budgets and the youngest is preempted when
    the pages run out (vanilla): the same tokens, log-probabilities (bit for bit: the batches
    are the same), compression and pages, most decode steps overlapped."""
    model, runtime = build(groups, window)
    params = [SamplingParams(max_new_tokens=n, temperature=temperature) for n in (20, 9, 30, 14)]
    params[1].temperature = 0.0
    plain_engine, plain, _ = serve(model, groups, False, params)
    engine, results, continued = serve(model, groups, True, params)
    same_results(plain, results)
    assert engine.stats.preemptions == plain_engine.stats.preemptions
    assert engine.stats.decode_tokens == plain_engine.stats.decode_tokens
    assert engine.stats.generated_tokens == plain_engine.stats.generated_tokens
    assert continued >= engine.stats.decode_steps // 2, (continued, engine.stats.decode_steps)
    assert engine.cache.pages_in_use == 0 and not engine.cache.allocator.steps
    assert not engine.pipeline.busy
    if temperature == 0.0:
        check_against_model(model, results, prompts(LENGTHS), dmc=runtime is not None)


@pytest.mark.parametrize("groups,window", [(2, "vanilla"), (2, 3)])
def test_stop_tokens_and_waiting_requests(parallel_1x1, groups, window):
    """Six requests on four sequence slots, two of them ending at a stop token drawn mid-way
    (learned one step late: the extra token dropped, the slot freed after the step in flight),
    the waiting ones joining as slots free up: every request ends as without overlap (tokens,
    reason, compression; log-probabilities to 1e-5, as batches differ for one step)."""
    model, _ = build(groups, window)
    lengths = LENGTHS + (11, 17)
    greedy = [SamplingParams(max_new_tokens=24) for _ in lengths]
    _, free_run, _ = serve(model, groups, False, greedy, lengths, pages=60)
    stops = [[], [free_run[1].tokens[5]], [], [free_run[3].tokens[9]], [], []]
    params = [SamplingParams(max_new_tokens=24, stop_tokens=s) for s in stops]
    plain_engine, plain, _ = serve(model, groups, False, params, lengths, pages=60)
    assert [r.finish_reason for r in plain].count("stop") == 2
    engine, results, continued = serve(model, groups, True, params, lengths, pages=60)
    same_results(plain, results, exact_logprobs=False)
    assert engine.stats.generated_tokens == plain_engine.stats.generated_tokens
    assert continued > 0 and engine.cache.pages_in_use == 0 and not engine.pipeline.busy


def test_overlap_drains_for_score_and_refuses_what_it_cannot_run(parallel_1x1):
    model, _ = build(2, 3)
    engine = Engine(model, page_size=4, max_batch=3, chunk_size=8, cuda_graphs=True,
                    overlap=True)
    for prompt in prompts((9, 13)):
        engine.add_request(prompt, SamplingParams(max_new_tokens=6))
    engine.step()  # prefill, first tokens
    engine.step()  # a decode step, left in flight
    assert engine.pipeline.flight is not None
    scored = engine.score(prompts((10,))[0])
    assert not engine.pipeline.busy and len(scored.token_logprobs) == 9
    results = []
    while engine.has_unfinished():
        results += engine.step()
    assert sorted(len(r.tokens) for r in results) == [6, 6]
    with pytest.raises(ValueError, match="overlap=True needs cuda_graphs=True"):
        Engine(model, page_size=4, max_batch=2, overlap=True)
    with pytest.raises(ValueError, match="DMSPagedCache"):
        Engine(build_dms(2, 4), page_size=4, max_batch=2, cuda_graphs=True, overlap=True)
    vanilla, _ = build(2, "vanilla")
    with pytest.raises(ValueError, match="policy"):
        Engine(vanilla, page_size=4, max_batch=2, cuda_graphs=True, overlap=True,
               policy=get_policy("tova", compression_ratio=2.0))


def test_requests_ending_at_stop_tokens_together_leave_nothing_in_flight(parallel_1x1):
    """Both requests draw their stop token at the step read back while the next one runs:
    that step is drained at once (its tokens dropped), every page returns."""
    model, _ = build(2, 3)
    greedy = [SamplingParams(max_new_tokens=12) for _ in range(2)]
    _, free_run, _ = serve(model, 2, False, greedy, (9, 13))
    at = next(i for i in range(2, 12) if all(r.tokens[i] not in r.tokens[:i] for r in free_run))
    params = [SamplingParams(max_new_tokens=12, stop_tokens=[r.tokens[at]]) for r in free_run]
    engine, results, continued = serve(model, 2, True, params, (9, 13))
    assert [len(r.tokens) for r in results] == [at + 1, at + 1] and continued > 0
    assert [r.finish_reason for r in results] == ["stop", "stop"]
    assert not engine.pipeline.busy and engine.cache.pages_in_use == 0
