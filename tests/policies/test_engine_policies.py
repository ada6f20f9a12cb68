"""Policies served by the Engine on a tiny GQA model under the "streaming" schedule (evicting
after every chunk and decode step): pages freed for real, measured CR = the requested one,
batched == batch-1, a tight pool's preemptions change no output (either schedule),
score(prefill_tokens) semantics, bad arguments. The "prefill" schedule:
test_engine_schedules.py."""
import itertools
import math

import pytest
import torch

from dmc.inference import Engine, SamplingParams
from dmc.megatron.model import build_gpt_model, llama_transformer_config
from dmc.megatron.runtime import DMCConfig, DMCRuntime
from dmc.policies import POLICY_NAMES, get_policy
from tiny_models import spread_decisions

VOCAB, MAX_SEQ, PAGE = 96, 160, 4
SMALL_WINDOW = {"snapkv": {"window": 4}, "pyramidkv": {"window": 4}, "streamingllm": {"sinks": 2},
                "d2o": {"sinks": 2}, "caote": {"base": "snapkv", "window": 4},
                "adakv": {"window": 4}}
EVICTING = [n for n in POLICY_NAMES if n != "omnikv"]
UNEVEN = ("pyramidkv", "d2o", "adakv")  # budgets differ across layers or heads


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(parallel_1x1):
    torch.manual_seed(0)
    config = llama_transformer_config(2, 64, 4, 96, num_query_groups=2)
    return build_gpt_model(config, VOCAB, MAX_SEQ)


def tokens(n, seed=1):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model, name=None, cr=2.0, schedule="streaming", **kw):
    policy = None if name is None else get_policy(name, cr, schedule=schedule,
                                                  **SMALL_WINDOW.get(name, {}))
    return Engine(model, dmc=None, page_size=PAGE, max_batch=kw.pop("max_batch_", 3),
                  chunk_size=kw.pop("chunk", 16), policy=policy, **kw)


def pages_of(lengths):
    return int(((lengths + PAGE - 1) // PAGE).sum())


def check_allocator(cache):
    owned = cache.allocator.tables[cache.allocator.tables >= 0].tolist()
    assert len(owned) == len(set(owned)) and not set(owned) & set(cache.allocator.free_list)
    assert cache.pages_in_use == len(owned) == pages_of(cache.allocator.lengths.long())


@pytest.mark.parametrize("name", EVICTING)
def test_prefill_evicts_and_frees_pages(model, name):
    prompt = tokens(50)
    vanilla, compressed = engine(model), engine(model, name, cr=4.0)
    for e in (vanilla, compressed):
        e.add_request(prompt, SamplingParams(max_new_tokens=8))
        e.step()  # prefill (chunks of 16, evicting after each) + one decode step
        check_allocator(e.cache)
    held = compressed.cache.head_lengths(compressed.scheduler.running[0].slot)
    per_head = math.ceil(51 / 4)
    assert int(held.sum()) == 2 * 2 * per_head  # budgets per layer sum to the total
    if name not in UNEVEN:
        assert (held == per_head).all()
    assert compressed.cache.pages_in_use < vanilla.cache.pages_in_use / 2
    used = [compressed.cache.pages_in_use]
    while compressed.has_unfinished():
        compressed.step()
        check_allocator(compressed.cache)
        used.append(compressed.cache.pages_in_use)
    assert used[-1] == 0 and max(used) <= pages_of(torch.full((2, 2), math.ceil(58 / 4))) + 4


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_batched_equals_batch_one_and_cr_is_the_requested_one(model, name):
    prompt_list = [tokens(n, seed) for n, seed in ((37, 2), (22, 3), (29, 4))]
    params = SamplingParams(max_new_tokens=9)
    batched = engine(model, name).generate(prompt_list, params)
    for prompt, together in zip(prompt_list, batched):
        single = engine(model, name).generate([prompt], params)[0]
        assert single.tokens == together.tokens
        torch.testing.assert_close(torch.tensor(single.logprobs), torch.tensor(together.logprobs),
                                   atol=1e-5, rtol=0)
        assert torch.equal(single.compression.slots, together.compression.slots)
        fed = len(prompt) + 8
        if name == "omnikv":  # 2 layers: no sparse layer, every page resident
            assert together.compression.overall == 1.0
            assert together.kv_pages == pages_of(torch.full((2, 2), fed))  # nothing freed
        elif name in UNEVEN:  # a layer whose budget outgrows its tokens lags
            assert fed / math.ceil(fed / 2) <= together.compression.overall <= 2.05
        else:
            assert together.compression.overall == pytest.approx(fed / math.ceil(fed / 2))
        if name != "omnikv":
            assert together.kv_pages <= pages_of(torch.full((2, 2), math.ceil(fed / 2))) + 2


TIGHT_POOL = {"streaming": 28, "prefill": 40}  # pages; OmniKV (2 layers: nothing evicted) 64


@pytest.mark.parametrize("schedule", ["streaming", "prefill"])
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_tight_pool_changes_no_token(model, name, schedule):
    """A pool that preempts decoding requests gives each request the tokens,
    log-probabilities and compression an ample pool does: a resumed request prefills its prompt
    again, then feeds the tokens it generated back one per decode step, so the policy evicts
    as before (prompt + generated prefilled as one prompt changed H2O's tokens,
    and SnapKV compressed both at once). Under "streaming" chunks stay whole whatever the
    pages the batch holds (a chunk shortened to fit moved PyramidKV's and Ada-KV's evictions).
    The prompts are ones where the last-bit rounding a batch's make-up leaves flips no near-tie
    (KNorm's key norms tie between repeats of a token in layer 0; D2O's merges compound it):
    with others those two differ by up to 3e-4 between an ample batch and a prompt alone."""
    prompt_list = [tokens(n, seed) for n, seed in zip((20, 28, 14, 24), range(40, 44))]
    params = SamplingParams(max_new_tokens=24)
    ample = engine(model, name, 3.0, schedule, max_batch_=4).generate(prompt_list, params)
    pages = 64 if name == "omnikv" else TIGHT_POOL[schedule]
    tight = engine(model, name, 3.0, schedule, max_batch_=4, num_pages=pages)
    generated, preempt = [], tight.scheduler.preempt
    tight.scheduler.preempt = lambda seq: generated.append(len(seq.generated)) or preempt(seq)
    results = tight.generate(prompt_list, params)
    assert max(generated) > 1  # a request preempted while decoding replayed a decode step
    for got, want in zip(results, ample):
        assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason)
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs),
                                   atol=1e-5, rtol=0)
        assert torch.equal(got.compression.slots, want.compression.slots)
        assert (got.compression.tokens, got.kv_pages) == (want.compression.tokens, want.kv_pages)
    assert tight.scheduler.whole_chunks == (schedule == "streaming" and name != "omnikv")
    assert tight.cache.pages_in_use == 0


def test_a_resumed_request_prefills_its_prompt_then_replays_its_tokens_as_decode_steps(model):
    """H2O on a pool that preempts a decoding request: the request's forwards after that are
    its prompt's chunks (only the last one ending the prompt), then a decode step per token it
    had generated, fed at that token's position, that draws nothing (the request holds the
    same tokens until the step that feeds its newest one)."""
    prompt_list = [tokens(n, seed) for n, seed in zip((20, 28, 14, 24), range(40, 44))]
    e = engine(model, "h2o", 3.0, max_batch_=4, num_pages=28)
    log, forward, preempted, preempt = [], e.runner.forward, [], e.scheduler.preempt

    def recording_forward(segments):
        running = {seq.slot: seq for seq in e.scheduler.running}
        log.extend((running[s.slot].request_id, s, len(running[s.slot].generated))
                   for s in segments)
        return forward(segments)

    def recording_preempt(seq):
        preempted.append((seq.request_id, list(seq.generated), len(log)))
        preempt(seq)

    e.runner.forward, e.scheduler.preempt = recording_forward, recording_preempt
    e.generate(prompt_list, SamplingParams(max_new_tokens=24))
    request, generated, at = next(p for p in preempted if len(p[1]) > 1)
    prompt = prompt_list[request]
    after = [(segment, held) for r, segment, held in log[at:] if r == request]
    chunks = list(itertools.takewhile(lambda entry: not entry[0].decode, after))
    assert [t for segment, _ in chunks for t in segment.tokens] == prompt
    assert [segment.prompt_end for segment, _ in chunks] == [False] * (len(chunks) - 1) + [True]
    steps = after[len(chunks):len(chunks) + len(generated)]
    assert [(s.tokens, s.start, s.decode) for s, _ in steps] == [
        ([token], len(prompt) + i, True) for i, token in enumerate(generated)]
    assert [held for _, held in steps] == [len(generated)] * len(generated)


def test_only_the_policies_that_read_the_attention_are_handed_it(model, monkeypatch):
    """The runner computes the new queries' attention only for a policy whose ``observe``
    reads it (a wrapper: its base's); the others (no ``observe`` of their own) generate the same
    tokens without it as with it, and the runner computes it for them not once."""
    from dmc.policies import base, runner

    readers = {n for n in POLICY_NAMES if get_policy(n, 2.0, **SMALL_WINDOW.get(n, {}))
               .reads_attention}
    assert set(POLICY_NAMES) - readers == {"streamingllm", "random", "knorm", "keydiff"}
    calls, causal_probs = [], runner.causal_probs
    monkeypatch.setattr(runner, "causal_probs", lambda *a: calls.append(1) or causal_probs(*a))
    prompts, params = [tokens(37, 2), tokens(22, 3)], SamplingParams(max_new_tokens=6)
    for name in sorted(set(POLICY_NAMES) - readers):
        skipped = engine(model, name).generate(prompts, params)
        assert not calls, name
        with monkeypatch.context() as forced:
            forced.setattr(base.KVPolicy, "reads_attention", property(lambda self: True))
            computed = engine(model, name).generate(prompts, params)
        assert calls and [r.tokens for r in skipped] == [r.tokens for r in computed], name
        calls.clear()


@pytest.mark.parametrize("name, reads", [("streamingllm", []), ("h2o", ["keys"]),
                                         ("tova", ["keys"]), ("keydiff", ["keys"]),
                                         ("d2o", ["keys", "keys", "values"])])
def test_a_decode_step_reads_each_layer_only_for_what_it_uses(model, name, reads):
    """The runner reads a layer's keys or values once each, when they are used: the keys for
    the attention a reading policy observes (H2O, TOVA) or for KeyDiff's key scores, no values
    for either; not for selection from the policy's own statistics, nor for StreamingLLM's
    re-rotation (its sinks rotate from their float32 copies, its recent window stays where it
    was written) or sink copies past the prompt, nor to compact (slots move page to page).
    D2O's merge reads the keys and values again after the step's last layer."""
    e = engine(model, name, cr=3.0)
    e.add_request(tokens(30, seed=4), SamplingParams(max_new_tokens=4))
    e.step()  # the prompt
    calls, read, read_part = [], e.cache.read, e.cache.read_part
    e.cache.read = lambda *a: calls.append((a[0], "both")) or read(*a)
    e.cache.read_part = lambda *a: calls.append(a[::2]) or read_part(*a)
    e.step()  # a decode step: every layer evicts one slot per head
    assert sorted(calls) == sorted((layer, part) for layer in range(2) for part in reads)


@pytest.mark.parametrize("name", EVICTING)
def test_no_policy_keeps_more_slots_than_its_budget(model, name):
    """After the prefill and every decode step each layer holds at most its budget per head
    (Ada-KV: at most KV heads x budget over the layer's heads)."""
    e = engine(model, name, cr=3.0)
    e.add_request(tokens(45, seed=7), SamplingParams(max_new_tokens=6))
    while e.has_unfinished():
        e.step()
        for seq in e.scheduler.running:
            held = e.cache.head_lengths(seq.slot).long().cpu()  # [layers, kv]
            seen = torch.tensor([int(e.policy.positions[seq.slot].max()) + 1],
                                device=e.cache.device)
            budgets = e.policy.policy.budgets(torch.tensor([seq.slot]), seen)[0].cpu()
            assert (held.sum(-1) <= held.shape[1] * budgets).all()
            if name != "adakv":
                assert (held <= budgets[:, None]).all()
    assert e.cache.pages_in_use == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_serves_on_cuda(model, name):
    """On CUDA (the hooks, the selection, the compaction through the device block tables, the
    paged attention): every policy keeps within its budget, as above, and a batch of prompts
    of mixed lengths generates what each prompt generates alone, greedy."""
    assert next(model.parameters()).is_cuda
    if name != "omnikv":
        test_no_policy_keeps_more_slots_than_its_budget(model, name)
    prompts, params = [tokens(37, 2), tokens(22, 3), tokens(9, 4)], SamplingParams(max_new_tokens=8)
    batched = engine(model, name).generate(prompts, params)
    for prompt, together in zip(prompts, batched):
        alone = engine(model, name).generate([prompt], params)[0]
        assert together.tokens == alone.tokens, name


def test_score_prefill_tokens_is_exact_for_vanilla_and_dmc(model):
    seq = tokens(40, seed=5)
    vanilla = engine(model)
    full = vanilla.score(seq, return_logits=True)
    split = vanilla.score(seq, return_logits=True, prefill_tokens=11)
    torch.testing.assert_close(split.logits, full.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split.token_logprobs, full.token_logprobs, atol=1e-5, rtol=0)

    torch.manual_seed(0)
    runtime = DMCRuntime(DMCConfig(window=3, c=-1.0))
    config = llama_transformer_config(2, 64, 4, 96, num_query_groups=2)
    dmc_model = build_gpt_model(config, VOCAB, MAX_SEQ, dmc=runtime)
    spread_decisions(dmc_model)
    runtime.set_mode("eval")
    dmc = Engine(dmc_model, page_size=PAGE, max_batch=1, chunk_size=8)
    full, split = dmc.score(seq), dmc.score(seq, prefill_tokens=13)
    torch.testing.assert_close(split.token_logprobs, full.token_logprobs, atol=1e-5, rtol=0)
    assert torch.equal(split.compression.slots, full.compression.slots)
    assert full.compression.overall > 1.5
    with pytest.raises(ValueError, match="prefill_tokens"):
        dmc.score(seq, prefill_tokens=0)
    with pytest.raises(ValueError, match="not supported on a DMC model"):
        Engine(dmc_model, page_size=PAGE, policy=get_policy("h2o"))


@pytest.mark.parametrize("name", ["h2o", "streamingllm"])
def test_score_with_a_policy_evicts_at_every_teacher_forced_token(model, name):
    seq = tokens(60, seed=6)
    full = engine(model).score(seq)
    e = engine(model, name, cr=3.0)
    stepped = e.score(seq, prefill_tokens=20)
    n = len(seq)
    assert stepped.compression.overall == pytest.approx(n / math.ceil(n / 3))
    # the first chunk's 16 predictions see the full cache; later ones see evictions
    torch.testing.assert_close(stepped.token_logprobs[:16], full.token_logprobs[:16],
                               atol=1e-5, rtol=0)
    assert (stepped.token_logprobs[20:] - full.token_logprobs[20:]).abs().max() > 1e-4
    assert e.cache.pages_in_use == 0


def test_omnikv_sparse_layer_changes_decoding_and_reports_no_compression(parallel_1x1):
    """Three layers, filter layer 0: layer 1 (after it) dense, layer 2 sparse. Dense prefill is
    the vanilla model's; the decoded tokens differ; without offload the memory CR is 1 (every
    page held; with offload: test_omnikv_offload.py)."""
    torch.manual_seed(0)
    deep = build_gpt_model(llama_transformer_config(3, 64, 4, 96, num_query_groups=2), VOCAB,
                           MAX_SEQ)
    seq = tokens(60, seed=6)
    full = engine(deep).score(seq)
    policy = get_policy("omnikv", 3.0, filter_layers=[0], offload=False)
    e = Engine(deep, dmc=None, page_size=PAGE, max_batch=3, chunk_size=16, policy=policy)
    chunked, stepped = e.score(seq), e.score(seq, prefill_tokens=20)
    torch.testing.assert_close(chunked.token_logprobs, full.token_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(stepped.token_logprobs[:19], full.token_logprobs[:19],
                               atol=1e-5, rtol=0)
    assert (stepped.token_logprobs[20:] - full.token_logprobs[20:]).abs().max() > 1e-4
    assert stepped.compression.overall == 1.0 and chunked.compression.overall == 1.0
    assert e.cache.pages_in_use == 0


def test_get_policy_rejects_bad_names_and_arguments():
    with pytest.raises(ValueError, match="valid names.*h2o.*omnikv"):
        get_policy("lru")
    with pytest.raises(ValueError, match="accepted.*window"):
        get_policy("snapkv", windw=3)
    with pytest.raises(ValueError, match="compression_ratio"):
        get_policy("h2o", 0.5)
    with pytest.raises(ValueError, match="base must be one of"):
        get_policy("caote", base="d2o")
    with pytest.raises(ValueError, match="pooling"):
        get_policy("snapkv", pooling="median")
    with pytest.raises(ValueError, match="kernel_size"):
        get_policy("pyramidkv", kernel_size=4)
    with pytest.raises(ValueError, match="filter_layers"):
        get_policy("omnikv", filter_layers=[-1])
    assert get_policy("fastcaote", 3.0, base="tova").base.name == "tova"


def test_a_policy_serves_one_engine(model):
    policy = get_policy("tova")
    engine_a = Engine(model, dmc=None, page_size=PAGE, max_batch=1, policy=policy)
    assert engine_a.policy.policy is policy
    with pytest.raises(ValueError, match="already serves"):
        Engine(model, dmc=None, page_size=PAGE, max_batch=1, policy=policy)
