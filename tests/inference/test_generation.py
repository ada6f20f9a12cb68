"""Streaming (``Engine.stream``, :mod:`dmc.inference.generation`): each request's deltas, put
together, are what ``generate`` returns for it, a token at a time, through stop tokens, waiting
requests, preemptions, overlapped steps and an abort; the last delta carries the result."""
import pytest
import torch

from dmc.inference import Engine, SamplingParams, TokenDelta
from test_engine import build, prompts

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (13, 21, 7, 9, 16)


def engine_for(model, **kwargs):
    return Engine(model, page_size=4, max_batch=3, chunk_size=8, **kwargs)


def params_list(stop_token=None):
    return [SamplingParams(max_new_tokens=n, temperature=1.5, seed=10 + n,
                           stop_tokens=() if stop_token is None else (stop_token,))
            for n in (12, 5, 17, 9, 14)]


def collect(deltas: list[TokenDelta], count: int):
    """Per request: its tokens and log-probabilities put together, its deltas' token counts and
    the results (checking that only a request's last delta has one)."""
    tokens, logprobs = [[] for _ in range(count)], [[] for _ in range(count)]
    sizes, results = [[] for _ in range(count)], [None] * count
    for delta in deltas:
        assert results[delta.index] is None  # nothing after the last delta
        tokens[delta.index] += delta.tokens
        logprobs[delta.index] += delta.logprobs
        sizes[delta.index].append(len(delta.tokens))
        results[delta.index] = delta.result
    assert all(r is not None for r in results)
    return tokens, logprobs, sizes, results


def assert_streamed_as_generated(deltas, expected, most=1):
    """Each request's deltas rebuild ``expected``'s result for it; a request gets ``most``
    tokens per step (two in its first: the one its prefill samples, then its first decode
    step's)."""
    tokens, logprobs, sizes, results = collect(deltas, len(expected))
    for i, want in enumerate(expected):
        assert tokens[i] == want.tokens == results[i].tokens
        assert logprobs[i] == results[i].logprobs
        torch.testing.assert_close(torch.tensor(logprobs[i]), torch.tensor(want.logprobs),
                                   atol=1e-5, rtol=0)
        assert results[i].finish_reason == want.finish_reason
        assert sizes[i][0] <= 2 and max(sizes[i][1:], default=0) <= most


@pytest.mark.parametrize("window", ["vanilla", 3])
def test_streamed_tokens_are_the_generated_ones_a_step_at_a_time(parallel_1x1, window):
    """Five requests on three slots (two wait), mixed budgets and a stop token that ends some
    early: the deltas of each request rebuild its result, one token per step."""
    model, _ = build(2, window)
    expected = engine_for(model).generate(prompts(LENGTHS), params_list())
    stop = expected[2].tokens[3]  # ends request 2 (and maybe others) early
    expected = engine_for(model).generate(prompts(LENGTHS), params_list(stop))
    assert any(r.finish_reason == "stop" for r in expected)
    assert any(r.finish_reason == "length" for r in expected)
    assert_streamed_as_generated(list(engine_for(model).stream(prompts(LENGTHS),
                                                               params_list(stop))), expected)


def test_streaming_with_preemptions_takes_no_token_back(parallel_1x1):
    """A pool too small for the batch preempts and recomputes requests: their deltas go on
    where they stopped (a preempted request keeps its tokens), and match the roomy engine's."""
    model, _ = build(2, "vanilla")  # 4 heads x 6-8 pages per request: 3 do not fit together
    expected = engine_for(model).generate(prompts(LENGTHS), params_list())
    tight = engine_for(model, num_pages=48)
    assert_streamed_as_generated(list(tight.stream(prompts(LENGTHS), params_list())), expected)
    assert tight.stats.preemptions > 0


def test_overlapped_steps_stream_the_same_tokens(parallel_1x1):
    """With ``overlap`` a step's tokens come with the next step's read-back: the same deltas
    put together (two at a step that drains the pipeline: the step in flight read back, then
    a step planned anew)."""
    model, _ = build(2, 3)
    expected = engine_for(model).generate(prompts(LENGTHS), params_list())
    engine = engine_for(model, cuda_graphs=True, overlap=True)
    assert_streamed_as_generated(list(engine.stream(prompts(LENGTHS), params_list())), expected,
                                 most=2)
    assert engine.stats.continued_steps > 0


def test_an_abort_while_streaming_ends_the_request_with_what_it_had(parallel_1x1):
    """A consumer aborting request 1 after its third token gets a last delta with no token and
    the abort result holding the three; the others stream to their ends as without it."""
    model, _ = build(2, 3)
    engine = engine_for(model)
    expected = engine_for(model).generate(prompts(LENGTHS), params_list())
    deltas, seen = [], 0
    for delta in engine.stream(prompts(LENGTHS), params_list()):
        deltas.append(delta)
        if delta.index == 1 and delta.result is None:
            seen += len(delta.tokens)
            if seen == 3:
                assert engine.abort(1)  # request ids follow the prompts on a new engine
    tokens, _, _, results = collect(deltas, len(LENGTHS))
    assert results[1].finish_reason == "abort" and tokens[1] == expected[1].tokens[:3]
    last = [d for d in deltas if d.index == 1][-1]
    assert last.result is results[1] and last.tokens == []
    for i in (0, 2, 3, 4):
        assert tokens[i] == expected[i].tokens
    assert engine.cache.pages_in_use == 0
