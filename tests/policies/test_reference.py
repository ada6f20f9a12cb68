"""Each policy's scores and kept sets, driven through PolicyRunner on a real PagedKVCache, equal a
float64 reference written from its paper (tests/policies/reference.py), step by step: a prompt in
one chunk, then one token at a time, evicting after each (the "streaming" schedule; the
"prefill" schedule is tested in test_schedule.py)."""
import math
from types import SimpleNamespace

import pytest
import torch

from dmc.inference import PagedKVCache
from dmc.inference.kernels import apply_rope, rope_inv_freq
from dmc.policies import get_policy
from dmc.policies.base import split_budget
from dmc.policies.pyramidkv import pyramid_weights

from . import reference
from .driver import DIM, GROUP, KV, PROMPT, SCALE, TOTAL, drive, inputs

# the papers' values, which are the policies' defaults
PAPER = {"d2o": {"sinks": 4, "beta": 0.7}, "pyramidkv": {"window": 8, "kernel_size": 5},
         "adakv": {"window": 32, "kernel_size": 5, "safeguard": 0.2}}


def check(name, ref_name, seed=0, device="cpu", **kw):
    ref_kw = dict(PAPER.get(name, {}))
    ref_kw.update({key: val for key, val in kw.items() if key in ("window", "kernel_size",
                                                                  "sinks", "beta", "safeguard")})
    q, k, v = inputs(seed)
    got = drive(get_policy(name, 2.0, schedule="streaming", **kw), q, k, v, device=device)
    want = reference.run(ref_name, q[0], k[0], v[0], PROMPT, 2.0, SCALE,
                         fast=name == "fastcaote", **ref_kw)
    evicted_somewhere = False
    for step, ((kept, scores, _), (ref_kept, ref_scores)) in enumerate(zip(got, want)):
        assert kept[0] == ref_kept, f"step {step}"
        for h in range(KV):
            positions = ref_kept[h]
            evicted_somewhere |= len(positions) < PROMPT + step
            if name != "streamingllm":
                held = sorted(ref_scores[h])
                ours = scores[0][h, :len(held)].double().cpu()
                torch.testing.assert_close(ours, torch.tensor([ref_scores[h][j] for j in held],
                                                              dtype=torch.float64),
                                           atol=1e-5, rtol=1e-4)
    assert evicted_somewhere
    return got, want


def test_h2o_matches_reference():
    check("h2o", "h2o")


def test_tova_matches_reference():
    check("tova", "tova")


@pytest.mark.parametrize("window", [3, 32])
def test_snapkv_matches_reference(window):
    check("snapkv", "snapkv", window=window, kernel_size=5)


@pytest.mark.parametrize("name", ["caote", "fastcaote"])
def test_caote_on_h2o_matches_reference(name):
    check(name, "caote-h2o", base="h2o")


@pytest.mark.parametrize("name", ["caote", "fastcaote"])
def test_caote_on_tova_scores_each_head_by_its_own_tokens(name):
    # CAOTE's per-head selection leaves the KV heads holding different tokens: TOVA's score of
    # a slot is its own head's attention then, not an average over other heads' slots
    got, _ = check(name, "caote-tova", base="tova")
    assert any(kept[0][0] != kept[0][1] for kept, _, _ in got)


@pytest.mark.gpu
@pytest.mark.parametrize("name, ref_name, kw", [
    ("h2o", "h2o", {}), ("tova", "tova", {}), ("snapkv", "snapkv", {"window": 3, "kernel_size": 5}),
    ("caote", "caote-h2o", {"base": "h2o"}), ("fastcaote", "caote-h2o", {"base": "h2o"}),
    ("knorm", "knorm", {}), ("keydiff", "keydiff", {}), ("adakv", "snapkv", {"window": 3}),
    ("d2o", "d2o", {"sinks": 2, "beta": 0.5})])
def test_every_policy_on_cuda_matches_reference(name, ref_name, kw):
    """The same step-by-step check with the cache, the runner and the policy on CUDA: the
    selection, the merges and the compaction through the device block tables."""
    check(name, ref_name, device="cuda", **kw)


def test_caote_changes_the_kept_set():
    q, k, v = inputs(3)
    h2o = drive(get_policy("h2o"), q, k, v)
    caote = drive(get_policy("caote"), q, k, v)
    assert any(a[0] != b[0] for a, b in zip(h2o, caote))


@pytest.mark.parametrize("name", ["knorm", "keydiff"])
def test_key_only_policies_match_reference(name):
    """KNorm: -||k_j||; KeyDiff: -cos(mean unit key, k_j); the best b kept per head."""
    check(name, name)


@pytest.mark.parametrize("window", [None, 3])
def test_adakv_over_snapkv_matches_reference(window):
    """Ada-KV Alg. 1 at its defaults (SnapKV base, safeguard 0.2) and with a small window:
    guards and safeguards per head, the rest of the layer's 2 b slots by score over both heads;
    heads end up holding different numbers of slots, never more than 2 b together."""
    kw = {} if window is None else {"window": window}
    got, want = check("adakv", "snapkv", **kw)
    lengths = [[len(h) for h in kept[0]] for kept, _, _ in got]
    for step, per_head in enumerate(lengths):
        assert sum(per_head) <= KV * math.ceil((PROMPT + step) / 2)
    if window == 3:
        assert any(a != b for a, b in lengths)


def test_adakv_safeguard_keeps_floor_of_its_share_in_a_head_that_scores_low():
    """Over KNorm (no protected slots), with head 1's keys 10x longer so that the layer-wide
    ranking gives it nothing: after an eviction the head holds floor(0.2 b) of its own best
    slots (b = 8 ... 13: 0.2 b is not an integer but at b = 10), as the float64 reference's
    Alg. 1."""
    q, k, v = inputs(0)
    k[:, 1] *= 10.0
    got = drive(get_policy("adakv", 2.0, base="knorm", schedule="streaming"), q, k, v)
    want = reference.run("knorm", q[0], k[0], v[0], PROMPT, 2.0, SCALE, safeguard=0.2)
    at_floor = 0
    for step, ((kept, _, _), (ref_kept, _)) in enumerate(zip(got, want)):
        assert kept[0] == ref_kept, f"step {step}"
        b = math.ceil((PROMPT + step) / 2)
        low, high = len(kept[0][1]), len(kept[0][0])
        assert low >= math.floor(0.2 * b) and low + high <= KV * b
        at_floor += low == math.floor(0.2 * b)
    assert at_floor >= len(got) // 2


def test_random_priorities_are_uniform_fixed_by_the_seed_and_evict_the_lowest():
    q, k, v = inputs(0)
    runs = [drive(get_policy("random", 2.0, seed=seed, schedule="streaming"), q, k, v)
            for seed in (0, 0, 1)]
    kept = [[step[0] for step in run] for run in runs]
    assert kept[0] == kept[1] and kept[0] != kept[2]
    before = [list(range(PROMPT))] * KV
    for step, (held, scores, _) in enumerate(runs[0]):
        n = PROMPT + step
        for h in range(KV):
            assert len(held[0][h]) == math.ceil(n / 2)
            priority = dict(zip(before[h], scores[0][h].tolist()))
            evicted = set(before[h]) - set(held[0][h])
            assert all(priority[e] < min(priority[j] for j in held[0][h]) for e in evicted)
        before = [kept + [n] for kept in held[0]]
    policy = get_policy("random", 2.0, seed=5)
    positions = torch.arange(10000).expand(1, 2, 10000)
    view = SimpleNamespace(layer=3, positions=positions)
    priority = policy.scores(view, None)
    assert priority.shape == (1, 2, 10000) and 0 <= priority.min() and priority.max() < 1
    counts = torch.histc(priority, bins=10, min=0, max=1)
    assert (counts - 2000).abs().max() < 200  # 4.7 sigma of a binomial(20000, 0.1)
    assert abs(float(torch.corrcoef(priority[0])[0, 1])) < 0.05  # heads draw independently


def test_d2o_at_its_defaults_matches_reference():
    """Sinks 4, N:M = 3:1, beta 0.7 (App. A.3)."""
    check("d2o", "d2o")


def test_d2o_single_layer_matches_reference():
    got, want = check("d2o", "d2o", sinks=2, beta=0.5)
    # merged keys and values equal the reference's, slot by slot
    q, k, v = inputs(0)
    ref = reference.run("d2o", q[0], k[0], v[0], PROMPT, 2.0, SCALE, sinks=2, beta=0.5)
    assert ref == want
    cache = got[-1][2]
    keys, values, lengths = cache.read(0, [0])
    heads = _final_heads(q[0], k[0], v[0])
    merged = False
    for h in range(KV):
        for slot, j in enumerate(want[-1][0][h]):
            torch.testing.assert_close(keys[0, h, slot].double(), heads[h].key[j], atol=1e-5,
                                       rtol=1e-5)
            torch.testing.assert_close(values[0, h, slot].double(), heads[h].value[j],
                                       atol=1e-5, rtol=1e-5)
            merged |= not torch.allclose(heads[h].value[j], v[0, h, j].double())
    assert merged, "some evicted tokens should have been merged"


def _final_heads(q, k, v):
    """Re-run the D2O reference keeping its head objects."""
    captured = {}
    original = reference.d2o_merge

    def spy(head, keep, tau, h, beta):
        captured[h] = head
        original(head, keep, tau, h, beta)

    reference.d2o_merge = spy
    try:
        reference.run("d2o", q, k, v, PROMPT, 2.0, SCALE, sinks=2, beta=0.5)
    finally:
        reference.d2o_merge = original
    return captured


@pytest.mark.parametrize("prompt", [PROMPT, 3])
def test_streamingllm_keeps_sinks_and_recent_with_cache_positions(prompt):
    """Kept: the first 4 tokens and the most recent ones; and every kept key scores against the
    next query exactly as StreamingLLM's cache positions do: key j at RoPE position j, the query
    at the cache length (also when early budgets are below the number of sinks)."""
    q, k, v = inputs(1)
    inv_freq = rope_inv_freq(DIM)
    positions = torch.arange(TOTAL)
    pre_k = apply_rope(k[0], -positions, inv_freq)  # undo RoPE: the pre-RoPE keys
    pre_q = apply_rope(q[0], -positions, inv_freq)
    got = drive(get_policy("streamingllm", 2.0, sinks=4), q, k, v, prompt=prompt)
    for step, (kept, _, cache) in enumerate(got):
        n = prompt + step
        b = math.ceil(n / 2)
        assert all(len(head) == b for head in kept[0])  # the budget, also when b < the sinks
        if prompt < 8:  # budgets below the sinks at first: later tokens took sink slots
            continue
        expected = list(range(min(4, b))) + list(range(n - (b - min(4, b)), n))
        assert kept[0] == [expected] * KV
    cache = got[-1][2]
    keys, _, lengths = cache.read(0, [0])
    held = int(lengths[0, 0])
    probe = pre_q[:, -1]  # a query for the next token, at its original position
    original = apply_rope(probe, torch.tensor(TOTAL), inv_freq)
    at_cache = apply_rope(probe, torch.tensor(held), inv_freq)
    for h in range(KV):
        ideal = apply_rope(pre_k[h, got[-1][0][0][h]], torch.arange(held), inv_freq)
        for g in range(GROUP):
            torch.testing.assert_close(keys[0, h, :held].float() @ original[h * GROUP + g],
                                       ideal @ at_cache[h * GROUP + g], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cr", [2.0, 1.2])
def test_pyramidkv_budgets_are_the_window_plus_the_pyramid_over_the_rest(cr):
    """Sec. 4.2.1 at the defaults (alpha 8, beta 20): every layer holds the window plus Eq. 1's
    share of what remains, the integers sum to the total and are within one slot of the
    formula (a layer capped at its tokens excepted: CR 1.2 gives layer 0 more than it holds);
    a budget at or below the window is uniform."""
    layers = 4
    policy = get_policy("pyramidkv", cr, schedule="streaming")
    q, k, v = inputs(2, layers)
    got = drive(policy, q, k, v)
    for step, (kept, _, _) in enumerate(got):
        n = PROMPT + step
        per_head = math.ceil(n / cr)
        budgets = policy.budgets(torch.tensor([0]), torch.tensor([n]))[0].tolist()
        assert sum(budgets) == layers * per_head
        assert budgets == sorted(budgets, reverse=True) and min(budgets) >= min(8, per_head)
        ideal = reference.pyramid_budgets(layers, per_head, 20.0, 8)
        if max(ideal) <= n:
            assert all(abs(a - b) < 1 for a, b in zip(budgets, ideal)), (budgets, ideal)
        else:
            assert budgets[0] == n
        held = [len(kept[layer][0]) for layer in range(layers)]
        # a layer whose budget grows faster than tokens arrive cannot get evicted tokens back
        assert all(h <= b for h, b in zip(held, budgets))
        assert held == budgets or step > 0
    small = policy.budgets(torch.tensor([0, 0]), torch.tensor([8, 5]))
    assert small.tolist() == [[math.ceil(8 / cr)] * layers, [math.ceil(5 / cr)] * layers]
    assert pyramid_weights(3, 20.0) == pytest.approx([1.95, 1.0, 0.05])


def test_pyramidkv_at_its_defaults_selects_as_snapkv_under_each_layer_budget():
    """Sec. 4.2.2: in every layer, SnapKV's selection (window = alpha = 8, pooled votes) under
    that layer's budget, against the float64 SnapKV reference."""
    layers = 3
    policy = get_policy("pyramidkv", 1.5, schedule="streaming")
    q, k, v = inputs(6, layers)
    got = drive(policy, q, k, v)
    seq = torch.tensor([0])
    for layer in range(layers):
        want = reference.run("snapkv", q[layer], k[layer], v[layer], PROMPT, 1.5, SCALE,
                             budgets=lambda n: int(policy.budgets(seq, torch.tensor([n]))[0,
                                                                                           layer]),
                             window=8, kernel_size=5)
        assert [kept[layer] for kept, _, _ in got] == [ref for ref, _ in want]
    assert any(len(kept[-1][0]) < len(kept[0][0]) for kept, _, _ in got)


def test_pyramidkv_selection_is_snapkv_under_its_budget():
    """With one layer the pyramid is flat: PyramidKV == SnapKV (same window)."""
    q, k, v = inputs(4)
    pyramid = drive(get_policy("pyramidkv", 2.0, window=3, schedule="streaming"), q, k, v)
    snap = drive(get_policy("snapkv", 2.0, window=3, schedule="streaming"), q, k, v)
    assert [a[0] for a in pyramid] == [b[0] for b in snap]


@pytest.mark.parametrize("selector", ["exponential", "last"])
def test_omnikv_selects_eq4_and_sparse_layers_attend_to_it(selector):
    """Filter layer 1 of 4 (layer 0 before it and layer 2 after it dense, layer 3 sparse):
    after each decode step the selected tokens are Eq. 4's top ceil(n / CR) (max over the
    heads, window of 16, float64 reference) of the earlier tokens plus the current one; layer
    3's decode attention (every page resident) is softmax attention over them."""
    layers = 4
    policy = get_policy("omnikv", 2.0, filter_layers=[1], selector=selector, offload=False)
    q, k, v = inputs(7, layers)
    chosen = []
    observe = policy.observe

    def spy(view, queries, q_positions, probs, prefill):
        observe(view, queries, q_positions, probs, prefill)
        if view.layer == 1 and not prefill:
            chosen.append(policy.selected[0, :view.positions.shape[-1]].clone())

    policy.observe = spy
    got = drive(policy, q, k, v)
    assert [policy.sparse(layer) for layer in range(layers)] == [False, False, False, True]
    assert len(chosen) == TOTAL - PROMPT
    for step, mask in enumerate(chosen, start=1):
        n = PROMPT + step
        want = reference.omnikv_selection(q[1], k[1], n, math.ceil(n / 2), SCALE,
                                          selector=selector)
        assert torch.nonzero(mask).flatten().tolist() == want, step
    cache = got[-1][2]
    assert all(cache.head_lengths(0).flatten() == TOTAL)
    query = torch.randn(1, KV * GROUP, DIM, dtype=torch.float64)
    out = policy.attend(3, torch.tensor([0]), query, SimpleNamespace(cache=cache))
    keep = chosen[-1]
    for h in range(KV * GROUP):
        keys, values = k[3, h // GROUP].double()[keep], v[3, h // GROUP].double()[keep]
        expected = reference.attention(query[0, h], keys, SCALE) @ values
        torch.testing.assert_close(out[0, h], expected, atol=1e-5, rtol=1e-5)
    assert policy.attend(2, torch.tensor([0]), query, SimpleNamespace(cache=cache)) is None


def test_d2o_layer_shares_follow_eq4_and_differ_with_attention_entropy():
    """Layers of different attention entropy (queries scaled 0.3, 1, 5): the flattest layer has
    the smallest variance of its column sums and the largest share; shares and budgets equal
    Eq. 4-5 (float64 reference) after the evictions (the evicted prompt tokens' column sums
    count), and stay frozen through the decode steps."""
    layers = 3
    policy = get_policy("d2o", 2.0)
    q, k, v = inputs(5, layers)
    for layer, factor in enumerate((0.3, 1.0, 5.0)):
        q[layer] *= factor
    got = drive(policy, q, k, v)
    want, variance = reference.d2o_layer_shares(q, k, PROMPT, SCALE)
    torch.testing.assert_close(policy.layer_variance(torch.tensor([0]))[0],
                               torch.tensor(variance, dtype=torch.float64), rtol=1e-5, atol=1e-9)
    shares = policy.layer_shares(torch.tensor([0]))[0]
    torch.testing.assert_close(shares, torch.tensor(want, dtype=torch.float64), rtol=1e-5,
                               atol=1e-9)
    assert shares[0] > shares[1] > shares[2] and float(shares[0] / shares[2]) > 1.2
    for step, (kept, _, _) in enumerate(got):
        n = PROMPT + step
        budgets = policy.budgets(torch.tensor([0]), torch.tensor([n]))[0].tolist()
        assert sum(budgets) == layers * math.ceil(n / 2)
        assert budgets == split_budget(layers * math.ceil(n / 2), want, n)
        held = [len(kept[layer][0]) for layer in range(layers)]
        assert all(h <= b for h, b in zip(held, budgets))


def _filled_cache(layers: int, tokens: int, device: str = "cpu"):
    cache = PagedKVCache(layers, 2, DIM, num_pages=40, page_size=4, max_seqs=2, window=None,
                         dtype=torch.float64, max_seq_len=32, device=device)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    keys = torch.randn(2, layers, 2, tokens, DIM, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(layers))
    values = torch.randn(keys.shape, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(layers + 1))
    for layer in range(layers):
        for t in range(tokens):
            cache.append(layer, seqs, keys[:, layer, :, t].to(device),
                         values[:, layer, :, t].to(device))
    return cache, seqs, keys, values


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compacting_every_layer_at_once_equals_one_layer_at_a_time(device):
    """``compact(slice(None), ...)`` moves every layer's kept slots like a compaction per
    layer (on CUDA through the device block tables); new keys are written to the kept slots
    of a prefix while the values still move page to page."""
    keep = torch.rand(2, 3, 2, 10, generator=torch.Generator().manual_seed(0)) < 0.4
    keep[0, 1, 0] = False  # a head that keeps nothing
    keep[1, 2] = True  # heads that evict nothing
    whole, seqs, keys, values = _filled_cache(3, 10, device)
    by_layer, _, _, _ = _filled_cache(3, 10, device)
    new = whole.compact(slice(None), seqs, keep.to(device))
    assert new.tolist() == keep.sum(-1).tolist()
    for layer in range(3):
        assert by_layer.compact(layer, seqs, keep[:, layer]).tolist() == new[:, layer].tolist()
        got = whole.read(layer, seqs)
        for b in range(2):
            for h in range(2):
                kept = keep[b, layer, h].nonzero()[:, 0]
                for read, cached in zip(got, (keys, values)):
                    torch.testing.assert_close(read[b, h, :len(kept)].double().cpu(),
                                               cached[b, layer, h, kept])
        for a, b in zip(got, by_layer.read(layer, seqs)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for part, read in zip(("keys", "values"), got):
            torch.testing.assert_close(whole.read_part(layer, seqs, part), read, rtol=0, atol=0)
    assert whole.pages_in_use == by_layer.pages_in_use == int(
        sum(-(-n // 4) for n in new.reshape(-1).tolist()))
    cache, seqs, keys, values = _filled_cache(1, 10, device)
    fresh = torch.randn(2, 2, 6, DIM, dtype=torch.float64)  # new keys of slots 0-5
    keep = torch.ones(2, 2, 10, dtype=torch.bool)
    keep[:, :, 3] = False
    cache.compact(0, seqs, keep.to(device), keys=fresh.to(device))
    got_k, got_v, _ = cache.read(0, seqs)
    want_k = torch.cat([fresh, keys[:, 0, :, 6:]], dim=2)[:, :, keep[0, 0]]
    torch.testing.assert_close(got_k.double().cpu(), want_k)
    torch.testing.assert_close(got_v.double().cpu(), values[:, 0][:, :, keep[0, 0]])


def test_reading_a_part_names_the_accepted_ones():
    cache, seqs, _, _ = _filled_cache(1, 4, "cpu")
    with pytest.raises(ValueError, match=r"part must be one of \['keys', 'values'\], got 'k'"):
        cache.read_part(0, seqs, "k")


def test_split_budget():
    assert split_budget(10, [1, 1, 1], 10) == [4, 3, 3]
    assert split_budget(10, [10, 1, 1], 5) == [5, 3, 2]
    assert sum(split_budget(37, [0.3, 0.5, 0.2, 1.0], 20)) == 37
    with pytest.raises(ValueError, match="weights"):
        split_budget(3, [0, 0], 5)


def test_compact_moves_kept_slots_to_the_front_and_frees_pages():
    cache = PagedKVCache(1, 2, DIM, num_pages=12, page_size=4, max_seqs=2, window=None,
                         dtype=torch.float64, max_seq_len=32)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    keys = torch.randn(2, 2, 10, DIM, dtype=torch.float64)
    values = torch.randn_like(keys)
    for t in range(10):
        cache.append(0, seqs, keys[:, :, t], values[:, :, t])
    assert cache.pages_in_use == 2 * 2 * 3
    keep = torch.zeros(2, 2, 10, dtype=torch.bool)
    keep[0, 0, [1, 4, 9]] = True
    keep[0, 1] = True
    keep[1, :, :5] = True
    new = cache.compact(0, seqs, keep)
    assert new.tolist() == [[3, 10], [5, 5]]
    assert cache.pages_in_use == 1 + 3 + 2 + 2 and cache.free_pages == 12 - 8
    read_k, read_v, _ = cache.read(0, seqs)
    torch.testing.assert_close(read_k[0, 0, :3].double(), keys[0, 0, [1, 4, 9]])
    torch.testing.assert_close(read_v[1, 1, :5].double(), values[1, 1, :5])
    torch.testing.assert_close(read_k[0, 1].double(), keys[0, 1])
    owned = cache.allocator.tables[cache.allocator.tables >= 0].tolist()
    assert len(set(owned)) == len(owned) == cache.pages_in_use
    with pytest.raises(ValueError, match="keep must be"):
        cache.compact(0, seqs, keep[:, :, :4])
    for s in seqs:
        cache.free_sequence(s)
    assert cache.free_pages == 12
