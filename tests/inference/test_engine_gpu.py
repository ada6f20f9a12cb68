"""The engine on a CUDA GPU (Triton kernels): greedy generation equals the eval-mode megatron
model, and a decode step waits for the device once (gpu mark: skipped without CUDA; the CPU
versions are in test_engine.py)."""
import warnings

import pytest
import torch

from dmc.inference import Engine, SamplingParams
from test_engine import build, check_against_model, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_thread")]

@pytest.mark.parametrize("groups,window", [(4, None), (2, 3), (2, 12), (2, "vanilla")])
def test_greedy_generation_on_cuda_equals_eval_model(parallel_1x1, groups, window):
    model, runtime = build(groups, window)
    assert next(model.parameters()).is_cuda
    engine = Engine(model, page_size=4, max_batch=4, chunk_size=5)
    assert engine.device.type == "cuda" and engine.cache.k_pages.is_cuda
    prompt_list = prompts()
    results = engine.generate(prompt_list, SamplingParams(max_new_tokens=32))
    assert all(r.finish_reason == "length" and len(r.tokens) == 32 for r in results)
    if runtime is not None:
        assert min(r.compression.overall for r in results) > 1.5
    check_against_model(model, results, prompt_list, dmc=runtime is not None)
    assert engine.cache.pages_in_use == 0


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("window", [3, "vanilla"])
def test_decode_step_waits_for_the_device_once(parallel_1x1, window, cuda_graphs):
    """A decode step synchronises with the host exactly once: the copy that brings back the
    sampled tokens together with the lengths the deferred DMC writes reached. Decisions, append
    slots and lengths stay on the device, pages are reserved on the host beforehand, host data
    goes to the device without a stream sync; with ``cuda_graphs``, the same for a step replayed
    from its graph."""
    model, _ = build(2, window)
    engine = Engine(model, page_size=4, max_batch=2, chunk_size=16, cuda_graphs=cuda_graphs)
    for prompt in prompts((9, 13)):
        engine.add_request(prompt, SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9))
    engine.step()  # prefill and first tokens
    engine.step()  # a first decode step: kernels compiled, pages in place
    if cuda_graphs:
        engine.step()  # batch 2 captured (and replayed)
        assert engine.graphs.captured == [(2, True)]  # batch 2, top-p: the sorting graph
    syncs = synchronising_calls(engine.step)
    assert len(syncs) == 1, syncs


def synchronising_calls(step) -> list[str]:
    """The calls the sync debug mode flags while ``step()`` runs (from an idle device)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "synchronizing" in str(w.message)]


@pytest.mark.parametrize("groups,window", [(4, None), (2, 3), (2, "vanilla")])
def test_decode_steps_replayed_from_cuda_graphs_equal_eager_ones(parallel_1x1, groups, window):
    """Steps replayed from a CUDA graph per batch size give the eval-mode model's tokens, as the
    eager engine does (the attention's launch size differs: logprobs to 1e-4)."""
    model, runtime = build(groups, window)
    prompt_list = prompts()
    params = [SamplingParams(max_new_tokens=n) for n in (24, 12, 32)]  # batches 3, 2, 1
    engine = Engine(model, page_size=4, max_batch=4, chunk_size=5, cuda_graphs=True)
    results = engine.generate(prompt_list, params)
    assert engine.graphs.captured == [(1, False), (2, False), (3, False)]
    check_against_model(model, results, prompt_list, dmc=runtime is not None)
    eager = Engine(model, page_size=4, max_batch=4, chunk_size=5).generate(prompt_list, params)
    for a, b in zip(results, eager):
        assert a.tokens == b.tokens
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=1e-4, rtol=0)
    assert engine.cache.pages_in_use == 0


@pytest.mark.parametrize("kind", ["dms", "merge_delay"])
def test_ring_steps_replayed_from_cuda_graphs_equal_eager_ones(parallel_1x1, kind):
    """DMS (window 4) and DMC with delayed merging (delay 4): every ring is full after the
    prompts, so steps replayed from a CUDA graph per batch size give the eager engine's tokens
    and slots."""
    from test_delayed_engine import build_delayed
    from test_dms_engine import build_dms

    model = build_dms(2, 4) if kind == "dms" else build_delayed(2, 4)
    prompt_list = prompts()
    params = [SamplingParams(max_new_tokens=n) for n in (24, 12, 32)]  # batches 3, 2, 1
    engine = Engine(model, page_size=4, max_batch=4, chunk_size=5, cuda_graphs=True)
    results = engine.generate(prompt_list, params)
    assert engine.graphs.captured == [(1, False), (2, False), (3, False)]
    eager = Engine(model, page_size=4, max_batch=4, chunk_size=5).generate(prompt_list, params)
    for a, b in zip(results, eager):
        assert a.tokens == b.tokens
        assert torch.equal(a.compression.slots, b.compression.slots)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=1e-4, rtol=0)
    assert engine.cache.pages_in_use == 0


@pytest.mark.parametrize("kind", ["exact", "dmc", "vanilla", "dms", "merge_delay"])
def test_overlapped_steps_on_cuda_equal_steps_without_overlap(parallel_1x1, kind):
    """Decode steps launched before the previous one is read back (``overlap=True``) give the
    tokens and slots of the engine without overlap, both replaying CUDA graphs (batches 3, 2,
    1 as requests end; sampled): DMC (4 KV heads, exact; 2, window 3), vanilla GQA, DMS
    (window 4) and DMC with delayed merging (delay 4: steps overlap once every ring is full)."""
    from test_delayed_engine import build_delayed
    from test_dms_engine import build_dms

    model = {"exact": lambda: build(4, None)[0], "dmc": lambda: build(2, 3)[0],
             "vanilla": lambda: build(2, "vanilla")[0], "dms": lambda: build_dms(2, 4),
             "merge_delay": lambda: build_delayed(2, 4)}[kind]()
    prompt_list = prompts()
    params = [SamplingParams(max_new_tokens=n, temperature=0.8) for n in (24, 12, 32)]
    options = dict(page_size=4, max_batch=4, chunk_size=5, cuda_graphs=True)
    plain = Engine(model, **options).generate(prompt_list, params)
    engine = Engine(model, overlap=True, **options)
    results = engine.generate(prompt_list, params)
    for a, b in zip(results, plain):
        assert a.tokens == b.tokens
        assert torch.equal(a.compression.slots, b.compression.slots)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=1e-4, rtol=0)
    assert engine.cache.pages_in_use == 0 and not engine.pipeline.busy


@pytest.mark.parametrize("window", [3, "vanilla"])
def test_overlapped_decode_step_makes_no_synchronising_call(parallel_1x1, window):
    """In the steady state an overlapped step launches the next graph replay before it reads
    the previous step back, and that read waits on the copy's event: no call the sync debug
    mode flags (a step without overlap makes one: the test above)."""
    model, _ = build(2, window)
    engine = Engine(model, page_size=4, max_batch=2, chunk_size=16, cuda_graphs=True,
                    overlap=True)
    for prompt in prompts((9, 13)):
        engine.add_request(prompt, SamplingParams(max_new_tokens=12, temperature=0.7))
    for _ in range(4):  # prefill; batch 2 warmed up, captured, replayed
        engine.step()
    assert engine.graphs.captured == [(2, False)] and engine.pipeline.flight is not None
    assert synchronising_calls(engine.step) == []
    assert engine.pipeline.flight is not None


@pytest.mark.parametrize("window", [3, "vanilla"])
def test_a_continued_step_of_fewer_sequences_makes_no_synchronising_call(parallel_1x1, window):
    """When a request reaches its budget the pipeline goes on with the others: that step's
    inputs are gathered on the device from the step in flight (batch 2 -> 1, both graphs
    captured beforehand) and it makes no call the sync debug mode flags either."""
    model, _ = build(2, window)
    engine = Engine(model, page_size=4, max_batch=2, chunk_size=16, cuda_graphs=True,
                    overlap=True)
    sampled = dict(temperature=0.7)
    engine.generate(prompts((9,)), SamplingParams(max_new_tokens=6, **sampled))  # batch 1
    engine.generate(prompts((9, 13)), SamplingParams(max_new_tokens=6, **sampled))  # batch 2
    assert engine.graphs.captured == [(1, False), (2, False)]
    for prompt, budget in zip(prompts((9, 13)), (6, 14)):
        engine.add_request(prompt, SamplingParams(max_new_tokens=budget, **sampled))
    while not (engine.pipeline.flight is not None and len(engine.pipeline.flight.seqs) == 2
               and len(engine.pipeline.flight.seqs[0].generated) + 2 > 6):
        engine.step()
    assert synchronising_calls(engine.step) == []
    assert len(engine.pipeline.flight.seqs) == 1  # the shorter request's last token came back
