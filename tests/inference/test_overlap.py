"""Decode steps launched before the previous one is read back (``Engine(overlap=True)``,
:mod:`dmc.inference.overlap`): the requests end with what the engine without overlap gives
them, token for token, through batches that shrink, stop tokens learned one step late, waiting
requests that join, and pools too small for two steps ahead (the CUDA version:
test_engine_gpu.py)."""
import pytest
import torch

from dmc.inference import Engine, SamplingParams
from dmc.inference.block_allocator import BlockAllocator
from dmc.inference.overlap import DecodePipeline
from dmc.policies import get_policy
from test_delayed_engine import build_delayed
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


@pytest.mark.parametrize("kind", ["dms", "merge_delay"])
@pytest.mark.parametrize("groups,window", [(2, 4), (4, 8)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_overlapped_ring_steps_equal_the_engine_without_overlap(parallel_1x1, kind, groups,
                                                                window, temperature):
    """DMS and DMC with delayed merging (``window`` the delay): a step overlaps once every
    sequence of its batch fills its window ring (static steps), eagerly before; the same
    tokens, log-probabilities, compression (paged slots and the full rings) and pages."""
    model = build_dms(groups, window) if kind == "dms" else build_delayed(groups, window)
    params = [SamplingParams(max_new_tokens=n, temperature=temperature) for n in (20, 9, 30, 14)]
    plain_engine, plain, _ = serve(model, groups, False, params)
    engine, results, continued = serve(model, groups, True, params)
    same_results(plain, results)
    assert engine.stats.preemptions == plain_engine.stats.preemptions
    assert continued >= engine.stats.decode_steps // 3, (continued, engine.stats.decode_steps)
    assert engine.cache.pages_in_use == 0 and not engine.pipeline.busy


def keep_device_copies_apart(monkeypatch):
    """From now on, block tables and lengths whose device copies are tensors of their own, as
    on a GPU (on the CPU they are the host tensors): the host lengths lag behind the device's
    writes until a step settles, so a step reserved while another is open must look ahead."""
    init = BlockAllocator.__init__

    def apart(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.device_tables, self.device_lengths = self.tables.clone(), self.lengths.clone()

    monkeypatch.setattr(BlockAllocator, "__init__", apart)


@pytest.mark.parametrize("kind", ["vanilla", "dmc", "exact", "dms", "merge_delay"])
def test_overlap_with_device_copies_apart(parallel_1x1, monkeypatch, kind):
    """With the host lengths lagging as on a GPU, overlapped steps (reserved one slot ahead of
    the step in flight, settled from the lengths read back) and plain ones end every request
    as the engine with the CPU's shared tensors does."""
    groups = 2
    model = (build(groups, "vanilla")[0] if kind == "vanilla" else
             build(groups, 3 if kind == "dmc" else None)[0] if kind in ("dmc", "exact") else
             build_dms(groups, 4) if kind == "dms" else build_delayed(groups, 4))
    params = [SamplingParams(max_new_tokens=n, temperature=0.8) for n in (20, 9, 30, 14)]
    _, shared, _ = serve(model, groups, False, params)
    keep_device_copies_apart(monkeypatch)
    _, plain, _ = serve(model, groups, False, params)
    engine, results, continued = serve(model, groups, True, params)
    allocator = engine.cache.allocator
    assert allocator.device_lengths is not allocator.lengths and continued > 0
    same_results(shared, plain)
    same_results(shared, results)
    assert engine.cache.pages_in_use == 0 and not engine.pipeline.busy
    assert torch.equal(allocator.device_tables, allocator.tables)
    assert torch.equal(allocator.device_lengths, allocator.lengths)


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
    dms = Engine(build_dms(2, 4), page_size=4, max_batch=2, cuda_graphs=True, overlap=True)
    dms.add_request(prompts((3,))[0], SamplingParams(max_new_tokens=4))
    dms.step()  # 3 tokens written: the ring of 5 not full
    with pytest.raises(ValueError, match="only when it is static"):
        dms.cache.begin_decode([0], static=False, overlap=True)
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


@pytest.mark.parametrize("kind", ["vanilla", "dmc", "dms", "merge_delay"])
def test_the_pipeline_goes_on_when_sequences_end(parallel_1x1, monkeypatch, kind):
    """Requests ending at their budgets and at a stop token (learned one step late) do not
    stop the pipeline: the next step continues the sequences still decoding, its inputs
    gathered on the device from the step in flight, the pages of the others returned once
    that step is back. With the device copies apart as on a GPU, every request ends as
    without overlap (log-probabilities to 1e-5: one step's batch holds the stopped sequence)
    and every page returns."""
    groups = 2
    model = (build(groups, "vanilla")[0] if kind == "vanilla" else
             build(groups, 3)[0] if kind == "dmc" else
             build_dms(groups, 4) if kind == "dms" else build_delayed(groups, 4))
    params = [SamplingParams(max_new_tokens=n, temperature=0.8) for n in (26, 9, 30, 14)]
    _, free_run, _ = serve(model, groups, False, params, pages=200)
    tokens = free_run[2].tokens
    params[2].stop_tokens = [next(t for i, t in enumerate(tokens) if i > 15
                                  and t not in tokens[:i])]
    keep_device_copies_apart(monkeypatch)
    _, plain, _ = serve(model, groups, False, params, pages=200)
    assert [r.finish_reason for r in plain] == ["length", "length", "stop", "length"]
    shrinking = []
    launch = DecodePipeline.launch

    def recording(self, seqs, started, pending=None):
        shrinking.append(pending is not None and len(seqs) < len(pending.seqs))
        return launch(self, seqs, started, pending)

    monkeypatch.setattr(DecodePipeline, "launch", recording)
    engine, results, continued = serve(model, groups, True, params, pages=200)
    same_results(plain, results, exact_logprobs=False)
    assert sum(shrinking) >= 3, shrinking  # each of the first three requests to end
    assert engine.cache.pages_in_use == 0 and not engine.pipeline.busy
    allocator = engine.cache.allocator
    assert torch.equal(allocator.device_tables, allocator.tables)
    assert torch.equal(allocator.device_lengths, allocator.lengths)
