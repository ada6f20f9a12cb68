"""Decode steps through static buffers (``Engine(cuda_graphs=True)``): on the CPU the static path
(forward and sampling) runs eagerly and must give what the ordinary forward and sampling give,
token for token and bit for bit, with batch sizes that change as requests finish and pages that
fill (the CUDA capture and replay of the same path: test_engine_gpu.py)."""
import pytest
import torch

from dmc.inference import Engine, SamplingParams
from dmc.inference.decode_graphs import DecodeGraphs
from dmc.megatron.runtime import DMCConfig
from dmc.policies import get_policy
from test_delayed_engine import build_delayed
from test_dms_engine import build_dms
from test_engine import build, check_against_model, prompts

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [(4, "vanilla"), (2, "vanilla"), (2, 3), (4, None)]


def generate(model, groups, cuda_graphs, params, lengths=(13, 21, 7, 9),
             max_new=(20, 9, 30, 14)):
    """Requests of different lengths and budgets on a small pool (18 pages per KV head of a
    layer: all prompts take 15, every vanilla sequence at its end 33, the longest alone 10):
    the decode batch shrinks as they finish and the youngest is preempted when pages run out."""
    engine = Engine(model, page_size=4, max_batch=4, chunk_size=5, num_pages=36 * groups,
                    cuda_graphs=cuda_graphs)
    request_params = [SamplingParams(max_new_tokens=n, temperature=params.temperature,
                                     top_p=params.top_p) for n in max_new]
    request_params[1].temperature = 0.0  # a greedy request among sampled ones
    return engine, engine.generate(prompts(lengths), request_params)


@pytest.mark.parametrize("groups,window", CASES)
@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.8, 1.0), (0.8, 0.9)])
def test_static_decode_steps_equal_the_ordinary_forward(parallel_1x1, groups, window,
                                                        temperature, top_p):
    model, runtime = build(groups, window)
    params = SamplingParams(temperature=temperature, top_p=top_p)
    eager_engine, eager = generate(model, groups, False, params)
    static_engine, static = generate(model, groups, True, params)
    for a, b in zip(eager, static):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs
        assert torch.equal(a.compression.slots, b.compression.slots)
        assert a.finish_reason == b.finish_reason == "length"
    graphs = static_engine.graphs
    assert isinstance(graphs, DecodeGraphs) and not graphs.capture and graphs.captured == []
    assert len(graphs.buffers) >= 3, "the batch size should change as requests finish"
    assert static_engine.stats.preemptions == eager_engine.stats.preemptions
    if window == "vanilla":
        assert static_engine.stats.preemptions > 0, "the pool should run out of pages"
    assert static_engine.cache.pages_in_use == 0
    for engine in (eager_engine, static_engine):  # the device's share of the decode steps
        assert 0 < engine.stats.decode_device_seconds < engine.stats.decode_seconds
    if temperature == 0.0:
        check_against_model(model, static, prompts((13, 21, 7, 9)), dmc=runtime is not None)


@pytest.mark.parametrize("kind", ["dms", "merge_delay"])
@pytest.mark.parametrize("groups,window", [(2, 4), (4, 8)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_static_ring_steps_equal_the_ordinary_forward(parallel_1x1, kind, groups, window,
                                                      temperature):
    """DMS (about half the tokens evicted) and DMC with delayed merging (``window`` the delay):
    a step runs static once every sequence of its batch fills its window ring, eagerly before
    (window 8: the 7-token prompt's first decode steps), and gives what the ordinary steps
    give, bit for bit."""
    model = build_dms(groups, window) if kind == "dms" else build_delayed(groups, window)
    params = SamplingParams(temperature=temperature)
    _, eager = generate(model, groups, False, params)
    static_engine = Engine(model, page_size=4, max_batch=4, chunk_size=5, num_pages=36 * groups,
                           cuda_graphs=True)
    ready, static_ready = [], static_engine.kv.static_ready
    static_engine.kv.static_ready = lambda seqs: ready.append(static_ready(seqs)) or ready[-1]
    request_params = [SamplingParams(max_new_tokens=n, temperature=temperature)
                      for n in (20, 9, 30, 14)]
    request_params[1].temperature = 0.0
    static = static_engine.generate(prompts((13, 21, 7, 9)), request_params)
    for a, b in zip(eager, static):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs
        assert torch.equal(a.compression.slots, b.compression.slots)
    assert all(ready) == (window < 7) and sum(ready) > 20
    assert max(r.compression.overall for r in static) > 1.2, "the cache should compress"
    assert static_engine.cache.pages_in_use == 0


def test_cuda_graphs_refuse_a_policy_and_capture_on_cpu(parallel_1x1):
    model, _ = build(2, "vanilla")
    with pytest.raises(ValueError, match="cuda_graphs=True needs a model without a KV policy"):
        Engine(model, page_size=4, max_batch=2, cuda_graphs=True,
               policy=get_policy("h2o", compression_ratio=2.0))
    Engine(model, DMCConfig(method="dms", dms_window=4), page_size=4, max_batch=2,
           cuda_graphs=True)  # DMS: accepted
    engine = Engine(model, page_size=4, max_batch=2)
    with pytest.raises(ValueError, match="capture=True needs a model on a CUDA device"):
        DecodeGraphs(engine.runner, capture=True)


def test_static_sampling_equals_sampling_on_device():
    """Every row drawn at once (greedy rows then take the argmax), with or without the sort:
    the tokens and log-probabilities of :func:`sample_on_device`, row for row."""
    from dmc.inference.sampling import (SamplingColumns, needs_filter, sample_on_device,
                                        sample_static)

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=generator) * 3
    params = [SamplingParams(temperature=t, top_k=k, top_p=p)
              for t, k, p in [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.0, 3, 0.5),
                              (1.0, 0, 0.8), (2.0, 0, 1.0)]]
    seeds, positions = [3, -7, 2**70, 11, 0, 5], [0, 4, 9, 2, 1, 30]
    for rows in ([0, 1, 5], list(range(6))):
        picked = [params[i] for i in rows]
        expected = sample_on_device(logits[rows], picked, [seeds[i] for i in rows],
                                    [positions[i] for i in rows])
        settings = SamplingColumns.of(picked, [seeds[i] for i in rows],
                                      [positions[i] for i in rows], torch.device("cpu"))
        for filtering in {needs_filter(picked), True}:
            assert torch.equal(sample_static(logits[rows], settings, filtering), expected)
