"""Compression schedules (dmc/policies/schedule.py) driven through PolicyRunner on a float64
cache: under "prefill" a policy compresses exactly once, after the prompt's last chunk, and keeps
what the float64 reference of its paper keeps with the whole prompt at once (the observation
window at the prompt's end); the decode phase then grows by one slot per step, or re-compresses
every N steps; no policy keeps more than its budget when it compresses; bad names fail clearly."""
import math
import warnings

import pytest
import torch

from dmc.policies import (
    POLICY_NAMES,
    Schedule,
    get_policy,
    parse_policy_spec,
    policy_from_spec,
)

from . import reference
from .driver import KV, PROMPT, SCALE, TOTAL, drive, inputs

EVICTING = [n for n in POLICY_NAMES if n != "omnikv"]
# name -> (options, reference name, reference options)
REFERENCES = {
    "snapkv": ({"window": 4}, "snapkv", {"window": 4, "kernel_size": 5}),
    "h2o": ({}, "h2o", {}),
    "tova": ({}, "tova", {}),
    "knorm": ({}, "knorm", {}),
    "keydiff": ({}, "keydiff", {}),
    "caote": ({}, "caote-h2o", {}),
    "adakv": ({"window": 4}, "snapkv", {"window": 4, "kernel_size": 5, "safeguard": 0.2}),
}


def spy_compressions(policy):
    """Record ``(tokens, layer, kept per head, budget)`` of every selection the runner asks."""
    calls, select = [], policy.select

    def spying(view, budget):
        keep = select(view, budget)
        calls.append((int(view.tokens[0]), view.layer, keep.sum(-1)[0].tolist(), int(budget[0])))
        return keep

    policy.select = spying
    return calls


@pytest.mark.parametrize("name", list(REFERENCES))
def test_prefill_schedule_compresses_once_after_the_chunked_prompt_as_one_shot(name):
    """The prompt in chunks of 4 (shorter than it): one compression, after the last chunk, equal
    to the reference's selection on the whole prompt; then the cache grows by one slot per
    decode step, the new tokens appended."""
    options, ref_name, ref_options = REFERENCES[name]
    q, k, v = inputs(0)
    policy = get_policy(name, 2.0, schedule="prefill", **options)
    calls = spy_compressions(policy)
    got = drive(policy, q, k, v, chunk=4)
    want = reference.run(ref_name, q[0], k[0], v[0], PROMPT, 2.0, SCALE,
                         fast=False, **ref_options)
    assert {tokens for tokens, *_ in calls} == {PROMPT}
    prompt_kept = got[0][0][0]
    assert prompt_kept == want[0][0]
    assert all(len(h) == math.ceil(PROMPT / 2) for h in prompt_kept) or name == "adakv"
    for step, (kept, _, _) in enumerate(got):
        assert kept[0] == [h + list(range(PROMPT, PROMPT + step)) for h in prompt_kept]


def test_streaming_with_chunks_shorter_than_the_prompt_is_another_algorithm_and_warns():
    """SnapKV under "streaming" with chunks of 4 evicts before the prompt's end (the warning) and
    keeps another set than the paper's one-shot selection; with the prompt in one chunk it
    neither warns nor differs."""
    q, k, v = inputs(0)
    want = reference.run("snapkv", q[0], k[0], v[0], PROMPT, 2.0, SCALE, window=4,
                         kernel_size=5)[0][0]
    with pytest.warns(UserWarning, match="before it has seen the end of the prompt"):
        chunked = drive(get_policy("snapkv", 2.0, window=4, schedule="streaming"), q, k, v,
                        chunk=4)
    assert chunked[0][0][0] != want
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        whole = drive(get_policy("snapkv", 2.0, window=4, schedule="streaming"), q, k, v)
        drive(get_policy("snapkv", 2.0, window=4), q, k, v, chunk=4)  # prefill: no warning
        drive(get_policy("h2o", 2.0), q, k, v, chunk=4)  # streaming is H2O's paper
    assert whole[0][0][0] == want


def test_d2o_at_its_defaults_is_the_paper_whatever_the_chunk_size():
    """D2O's default, prefill then every decode step (prefill/1): the prompt in chunks of 4
    gives the float64 reference's kept sets at every step (one-shot prompt encoding, then one
    eviction per generated token) and the layer shares of Eq. 4-5 on the whole prompt."""
    layers = 2
    q, k, v = inputs(5, layers)
    policy = get_policy("d2o", 2.0)
    assert policy.plan == Schedule("prefill", 1)
    got = drive(policy, q, k, v, chunk=4)
    shares, _ = reference.d2o_layer_shares(q, k, PROMPT, SCALE)
    torch.testing.assert_close(policy.layer_shares(torch.tensor([0]))[0],
                               torch.tensor(shares, dtype=torch.float64), rtol=1e-5, atol=1e-9)
    seq = torch.tensor([0])
    for layer in range(layers):
        want = reference.run("d2o", q[layer], k[layer], v[layer], PROMPT, 2.0, SCALE,
                             budgets=lambda n: int(policy.budgets(seq, torch.tensor([n]))[0,
                                                                                          layer]),
                             sinks=4, beta=0.7)
        assert [kept[layer] for kept, _, _ in got] == [ref for ref, _ in want]


def test_prefill_schedule_recompresses_every_n_decode_steps():
    """prefill/3: compressions after the prompt and after decode tokens 3, 6, 9 (to
    ceil(n / CR) slots), the cache growing by one slot per step in between."""
    q, k, v = inputs(1)
    policy = policy_from_spec("h2o@prefill/3", 2.0)
    calls = spy_compressions(policy)
    got = drive(policy, q, k, v, chunk=4)
    assert sorted({tokens for tokens, *_ in calls}) == [PROMPT + 3 * i for i in range(4)]
    held = math.ceil(PROMPT / 2)
    for step, (kept, _, _) in enumerate(got):
        n = PROMPT + step
        held = math.ceil(n / 2) if step % 3 == 0 else held + 1
        assert [len(h) for h in kept[0]] == [held] * KV, step


@pytest.mark.parametrize("name", EVICTING)
@pytest.mark.parametrize("schedule", [None, "streaming"])
def test_no_policy_keeps_more_slots_than_its_budget_when_it_compresses(name, schedule):
    """Every selection, at the paper's schedule and under streaming, keeps at most the budget
    per head (Ada-KV: at most KV heads x budget over the layer), and the cache then holds
    exactly what was kept."""
    layers = 3
    q, k, v = inputs(2, layers)
    options = {"window": 4} if name in ("snapkv", "pyramidkv", "adakv") else {}
    policy = get_policy(name, 3.0, schedule=schedule, **options)
    calls = spy_compressions(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = drive(policy, q, k, v, chunk=4)
    assert calls
    for _, _, kept, budget in calls:
        assert sum(kept) <= KV * budget and (name == "adakv" or max(kept) <= budget)
    last_tokens, _, _, _ = calls[-1]
    kept_at_end = [kept for tokens, _, kept, _ in calls if tokens == last_tokens]
    if last_tokens == TOTAL:
        assert [[len(h) for h in layer] for layer in got[-1][0]] == kept_at_end


def test_defaults_are_the_papers():
    defaults = {name: get_policy(name).plan.text for name in POLICY_NAMES}
    assert defaults == {"h2o": "streaming", "tova": "streaming", "snapkv": "prefill",
                        "streamingllm": "streaming", "pyramidkv": "prefill", "d2o": "prefill/1",
                        "caote": "streaming", "fastcaote": "streaming", "omnikv": "streaming",
                        "random": "prefill", "knorm": "prefill", "keydiff": "streaming",
                        "adakv": "prefill"}
    assert get_policy("adakv", base="h2o").plan.text == "streaming"  # the base's paper
    assert get_policy("caote", base="snapkv").plan.text == "streaming"  # CAOTE's block-wise
    assert [n for n in POLICY_NAMES if get_policy(n).rerotate] == ["streamingllm"]
    assert get_policy("d2o", schedule="prefill").plan == Schedule("prefill")
    assert get_policy("d2o", recompress_every=4).plan == Schedule("prefill", 4)


@pytest.mark.parametrize("make,message", [
    (lambda: get_policy("snapkv", schedule="prefil"),
     r"schedule must be one of \['prefill', 'streaming'\], got 'prefil'"),
    (lambda: get_policy("adakv", schedule="eager"), r"schedule must be one of \['prefill'"),
    (lambda: get_policy("h2o", schedule="streaming", recompress_every=2),
     "recompress_every applies to schedule='prefill' only"),
    (lambda: get_policy("h2o", schedule="prefill", recompress_every=0),
     "recompress_every must be an integer >= 1"),
    (lambda: get_policy("h2o", rerotate="yes"), "rerotate must be True, False or None"),
    (lambda: get_policy("omnikv", rerotate=True), "rerotate: OmniKV evicts nothing"),
    (lambda: parse_policy_spec("snapkv@later"),
     r"schedule must be one of \['prefill', 'streaming'\], got 'later'"),
    (lambda: parse_policy_spec("snapkv@prefill/x"), "expected prefill, prefill/N"),
    (lambda: parse_policy_spec("lru@prefill"), "unknown policy 'lru'"),
])
def test_bad_schedules_fail_naming_the_field_and_the_accepted_values(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_specs_name_the_schedule():
    assert parse_policy_spec("SnapKV") == ("snapkv", {})
    assert parse_policy_spec("snapkv@prefill/8") == ("snapkv", {"schedule": "prefill",
                                                                "recompress_every": 8})
    policy = policy_from_spec("snapkv@streaming", 4.0, window=8)
    assert (policy.schedule, policy.compression_ratio, policy.window) == ("streaming", 4.0, 8)
    assert Schedule.parse("prefill/2").text == "prefill/2"
