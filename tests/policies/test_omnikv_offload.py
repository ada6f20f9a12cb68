"""OmniKV with host offload (dmc/policies/context_bank.py): the sparse layers' device pages hold
exactly the selected tokens (the page pool shrinks), the full KV sits in a separate host pool,
the outputs equal OmniKV without offload (same selection), device and host bytes are reported
apart; a request preempted while decoding resumes through the same sparse decode steps."""
import math

import pytest
import torch

from dmc.inference import Engine, SamplingParams
from dmc.inference.paging import pages_for
from dmc.megatron.model import build_gpt_model, llama_transformer_config
from dmc.policies import get_policy

from .driver import KV, PROMPT, drive, inputs

VOCAB, MAX_SEQ, PAGE, CR = 96, 160, 4, 3.0

pytestmark = pytest.mark.usefixtures("one_thread")


def held(tokens, cr=CR):
    """Slots a sparse head holds after ``tokens`` tokens: the selected earlier ones + the
    current one."""
    return min(math.ceil(tokens / cr), tokens - 1) + 1


def test_device_pages_hold_the_selection_and_equal_the_host_pool():
    """Filter layer 1 of 4, layer 3 sparse, float64 cache: after the prompt and each decode step
    layer 3's device slots are, in order, the filter layer's selection without offload (the
    prompt's last tokens before the first step); the dense layers keep every slot; the keys and
    values loaded from the host pool are the tokens' own; the pages in use are the heads'."""
    q, k, v = inputs(3, layers=4)
    offloaded, resident = (get_policy("omnikv", 2.0, filter_layers=[1], offload=flag)
                           for flag in (True, False))
    chosen = {}
    observe = resident.observe

    def spy(view, queries, q_positions, probs, prefill):
        observe(view, queries, q_positions, probs, prefill)
        if view.layer == 1 and not prefill:
            chosen[int(view.tokens[0])] = resident.selected[0].nonzero().flatten().tolist()

    resident.observe = spy
    drive(resident, q, k, v)
    got = drive(offloaded, q, k, v)
    for step, (kept, _, cache) in enumerate(got):
        tokens = PROMPT + step
        want = chosen.get(tokens, list(range(PROMPT - held(PROMPT, 2.0), PROMPT)))
        assert len(want) == held(tokens, 2.0)
        assert all(kept[3][h] == want for h in range(KV)), step
        assert all(kept[layer][h] == list(range(tokens)) for layer in range(3) for h in range(KV))
    keys, values, _ = cache.read(3, [0])
    torch.testing.assert_close(keys[0], k[3][:, want], rtol=0, atol=0)
    torch.testing.assert_close(values[0], v[3][:, want], rtol=0, atol=0)
    lengths = cache.allocator.lengths.long()
    assert cache.pages_in_use == int(pages_for(lengths, cache.page_size).sum())


@pytest.fixture(scope="module")
def deep(parallel_1x1):
    """Four layers, GQA 4:2; with filter layer 0, layers 2 and 3 are sparse."""
    torch.manual_seed(0)
    return build_gpt_model(llama_transformer_config(4, 64, 4, 96, num_query_groups=2), VOCAB,
                           MAX_SEQ)


def tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def omnikv(model, offload, max_batch=3, **kw):
    policy = get_policy("omnikv", CR, filter_layers=[0], offload=offload)
    return Engine(model, dmc=None, page_size=PAGE, max_batch=max_batch, chunk_size=16,
                  policy=policy, **kw)


def test_score_with_offload_equals_without_and_reports_device_and_host_bytes(deep):
    """Teacher forcing (prefill 24 of 60 tokens, then 36 decode steps): the log-probabilities
    with offload equal those without (fp32); the sparse layers hold held(60) slots per head on
    the device, the dense ones 60; the device bytes shrink by what the sparse layers left, the
    host pool holds the sparse layers' 60 tokens, apart from ``total``."""
    seq = tokens(60, seed=8)
    results = {flag: omnikv(deep, flag).score(seq, prefill_tokens=24) for flag in (True, False)}
    on, off = results[True], results[False]
    torch.testing.assert_close(on.token_logprobs, off.token_logprobs, atol=1e-5, rtol=0)
    assert on.compression.slots.tolist() == [[60, 60]] * 2 + [[held(60)] * 2] * 2
    assert off.compression.overall == 1.0
    assert on.compression.overall == pytest.approx(4 * 60 / (2 * 60 + 2 * held(60)))
    page_bytes = 2 * PAGE * 16 * 4  # head_dim 16, float32
    device_pages = 2 * 2 * math.ceil(60 / PAGE) + 2 * 2 * math.ceil(held(60) / PAGE)
    assert on.cache_bytes["kv"] == device_pages * page_bytes
    assert off.cache_bytes["kv"] == 4 * 2 * math.ceil(60 / PAGE) * page_bytes
    assert off.cache_bytes["host"] == 0
    assert on.cache_bytes["host"] >= 2 * 2 * 60 * 16 * 4 * 2  # 2 sparse layers, K and V
    assert on.cache_bytes["total"] == sum(v for key, v in on.cache_bytes.items()
                                          if key not in ("total", "host"))
    assert on.cache_bytes["total"] < off.cache_bytes["total"]


def test_generation_frees_pages_and_equals_no_offload_batched(deep):
    """Three prompts decoded together: the same tokens (and log-probabilities) with and without
    offload; after every step each running sequence's sparse heads hold held(t) slots, the
    allocator's pages match the heads' lengths, and fewer pages are in use than without
    offload; the host pool is on the host (the pages on the engine's device); all pages return
    at the end."""
    prompts = [tokens(n, seed) for n, seed in ((37, 2), (22, 3), (29, 4))]
    params = SamplingParams(max_new_tokens=10)
    off = omnikv(deep, False).generate(prompts, params)
    e, resident = omnikv(deep, True), omnikv(deep, False)
    for engine in (e, resident):
        for prompt in prompts:
            engine.add_request(prompt, params)
    on = {}
    while e.has_unfinished():
        for result in e.step():
            on[result.request_id] = result
        resident.step()
        lengths = e.cache.allocator.lengths.long()
        assert e.cache.pages_in_use == int(pages_for(lengths, PAGE).sum())
        for seq in (s for s in e.scheduler.running if s.decoding):
            t = seq.cached
            assert e.cache.head_lengths(seq.slot)[2:].flatten().tolist() == [held(t)] * 4
            pool = e.policy.bank.keys[seq.slot]  # [sparse layers, kv, capacity, dim]
            assert pool.device.type == "cpu" and pool.shape[2] >= t
            assert e.policy.host_bytes(seq.slot) == 2 * pool.numel() * pool.element_size()
        if e.scheduler.running and all(s.decoding for s in e.scheduler.running):
            assert e.cache.pages_in_use < resident.cache.pages_in_use
    assert e.cache.pages_in_use == 0
    for want, request in zip(off, sorted(on)):
        assert on[request].tokens == want.tokens
        torch.testing.assert_close(torch.tensor(on[request].logprobs), torch.tensor(want.logprobs),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("offload", [True, False])
def test_a_request_preempted_while_decoding_resumes_through_sparse_decode_steps(deep, offload):
    """A pool of 110 pages preempts requests while they decode; resumed, each feeds the tokens
    it generated back through decode steps (the sparse layers' selected attention, the offload
    after the prompt), so the tokens, log-probabilities and slots are those of an ample pool
    (prefilling them with the prompt attended densely: |dlogp| up to 0.3, other tokens)."""
    prompts = [tokens(n, seed) for n, seed in ((20, 2), (14, 3), (17, 4))]
    params = SamplingParams(max_new_tokens=24)
    ample = omnikv(deep, offload).generate(prompts, params)
    tight = omnikv(deep, offload, num_pages=110)
    generated, preempt = [], tight.scheduler.preempt
    tight.scheduler.preempt = lambda seq: generated.append(len(seq.generated)) or preempt(seq)
    for got, want in zip(tight.generate(prompts, params), ample):
        assert got.tokens == want.tokens and got.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs),
                                   atol=1e-5, rtol=0)
        assert torch.equal(got.compression.slots, want.compression.slots)
    assert max(generated) > 1 and tight.cache.pages_in_use == 0


def test_offload_is_validated():
    with pytest.raises(ValueError, match="offload"):
        get_policy("omnikv", offload="yes")
    assert get_policy("omnikv").offload is True
