"""Schedules served by the Engine on a tiny GQA model: under "prefill" a prompt longer than the
chunk is held whole until its last chunk, then only the budget stays (pages freed); decoding
adds a slot per step and the compression stats report the CR the memory has; batched ==
batch-1; streaming with short chunks warns; no policy exceeds its budget when it compresses."""
import math
import warnings

import pytest
import torch

from dmc.inference import Engine, SamplingParams
from dmc.policies import POLICY_NAMES, policy_from_spec

from .test_engine_policies import (  # noqa: F401 (model: the tiny GQA model fixture)
    SMALL_WINDOW,
    check_allocator,
    model,
    pages_of,
    tokens,
)

EVICTING = [n for n in POLICY_NAMES if n != "omnikv"]

pytestmark = pytest.mark.usefixtures("one_thread")


def engine(model, spec=None, cr=2.0, chunk=16, max_batch=3):
    name = None if spec is None else spec.partition("@")[0]
    policy = None if spec is None else policy_from_spec(spec, cr, **SMALL_WINDOW.get(name, {}))
    return Engine(model, dmc=None, page_size=4, max_batch=max_batch, chunk_size=chunk,
                  policy=policy)


def held_after_each_forward(e):
    """Record the slots per (layer, head) of the first running sequence after every forward."""
    seen, forward = [], e.runner.forward

    def recording(segments):
        out = forward(segments)
        seen.append(e.cache.head_lengths(segments[0].slot).long().clone())
        check_allocator(e.cache)
        return out

    e.runner.forward = recording
    return seen


def test_prefill_holds_the_prompt_then_the_budget_then_grows(model):
    """SnapKV (paper: prefill), prompt 50 in chunks of 16 at CR 4: 16, 32, 48 slots per head
    while prefilling, ceil(50 / 4) = 13 after the last chunk (pages freed), then one more per
    decode step; the result reports 57 tokens over 13 + 7 slots."""
    vanilla, e = engine(model), engine(model, "snapkv", 4.0)
    seen = held_after_each_forward(e)
    result = e.generate([tokens(50)], SamplingParams(max_new_tokens=8))[0]
    per_head = [int(h.max()) for h in seen]
    assert per_head == [16, 32, 48, 13] + list(range(14, 21))
    assert all((h == h.max()).all() for h in seen)
    assert result.compression.overall == pytest.approx(57 / 20)
    assert result.kv_pages == pages_of(torch.full((2, 2), 20))
    vanilla.generate([tokens(50)], SamplingParams(max_new_tokens=8))
    assert e.stats.peak_pages == pages_of(torch.full((2, 2), 48))  # measured after forwards
    assert vanilla.stats.peak_pages == pages_of(torch.full((2, 2), 57))


def test_prefill_recompresses_every_n_decode_steps(model):
    e = engine(model, "h2o@prefill/3", 4.0)
    seen = held_after_each_forward(e)
    e.generate([tokens(50)], SamplingParams(max_new_tokens=11))
    per_head = [int(h.max()) for h in seen[3:]]  # after the prompt's last chunk
    assert per_head == [13, 14, 15, 14, 15, 16, 14, 15, 16, 15, 16]
    assert per_head[3] == math.ceil(53 / 4) and per_head[6] == math.ceil(56 / 4)


@pytest.mark.parametrize("spec", ["snapkv", "d2o", "adakv", "h2o@prefill"])
def test_prefill_schedule_batched_equals_batch_one(model, spec):
    prompt_list = [tokens(n, seed) for n, seed in ((37, 2), (22, 3), (29, 4))]
    params = SamplingParams(max_new_tokens=9)
    batched = engine(model, spec).generate(prompt_list, params)
    for prompt, together in zip(prompt_list, batched):
        single = engine(model, spec).generate([prompt], params)[0]
        assert single.tokens == together.tokens
        torch.testing.assert_close(torch.tensor(single.logprobs), torch.tensor(together.logprobs),
                                   atol=1e-5, rtol=0)
        assert torch.equal(single.compression.slots, together.compression.slots)
        fed = len(prompt) + 8
        if spec == "snapkv":  # compressed once: the prompt's budget plus every generated token
            assert together.compression.overall == pytest.approx(
                fed / (math.ceil(len(prompt) / 2) + 8))


def test_score_under_prefill_is_exact_until_the_prompt_ends(model):
    """Every prefill chunk's predictions equal the uncompressed model's (nothing is evicted
    before the prompt's end); the teacher-forced tokens after it see the compressed cache."""
    seq = tokens(60, seed=6)
    full = engine(model).score(seq)
    e = engine(model, "snapkv", 3.0)
    scored = e.score(seq, prefill_tokens=40)
    torch.testing.assert_close(scored.token_logprobs[:40], full.token_logprobs[:40], atol=1e-5,
                               rtol=0)
    assert (scored.token_logprobs[40:] - full.token_logprobs[40:]).abs().max() > 1e-4
    assert scored.compression.overall == pytest.approx(60 / (math.ceil(40 / 3) + 20))
    assert e.cache.pages_in_use == 0


def test_streaming_with_a_chunk_shorter_than_the_prompt_warns(model):
    params = SamplingParams(max_new_tokens=2)
    with pytest.warns(UserWarning, match="end of the prompt"):
        engine(model, "snapkv@streaming").generate([tokens(50)], params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine(model, "snapkv@streaming", chunk=64).generate([tokens(50)], params)
        engine(model, "snapkv").generate([tokens(50)], params)
        engine(model, "knorm@streaming").generate([tokens(50)], params)  # reads no window
    assert not [w for w in caught if "end of the prompt" in str(w.message)]


@pytest.mark.parametrize("name", EVICTING)
def test_no_policy_keeps_more_slots_than_its_budget_when_it_compresses(model, name):
    """At its paper's schedule, right after every compression, each layer holds at most its
    budget per head (Ada-KV: at most KV heads x budget over the layer's heads)."""
    e = engine(model, name, cr=3.0)
    runner, compressed = e.policy, []
    compress = runner._compress

    def checking(seqs, seen):
        compress(seqs, seen)
        budgets = runner.policy.budgets(seqs, seen)
        for seq, budget in zip(seqs.tolist(), budgets):
            held = e.cache.head_lengths(seq).long()  # [layers, kv]
            assert (held.sum(-1) <= held.shape[1] * budget).all()
            if name != "adakv":
                assert (held <= budget[:, None]).all()
        compressed.append(seen.tolist())

    runner._compress = checking
    e.add_request(tokens(45, seed=7), SamplingParams(max_new_tokens=6))
    while e.has_unfinished():
        e.step()
    assert compressed[0] == ([45] if runner.plan.kind == "prefill" else [16])
