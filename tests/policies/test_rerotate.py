"""Key re-rotation (dmc/policies/rerotate.py), the ``rerotate`` option of every policy: after an
eviction the key of kept slot ``i`` equals RoPE of its pre-RoPE key at ``i + n - L`` (the cache
positions of StreamingLLM Sec. 3.2, shifted by tokens minus slots), float64 reference; the copies
that rotations start from keep a bfloat16 cache from drifting; their bytes are counted."""
import warnings

import pytest
import torch

from dmc.inference import PagedKVCache
from dmc.inference.kernels import apply_rope, rope_inv_freq
from dmc.policies import PolicyRunner, get_policy

from .driver import DIM, GROUP, KV, SCALE, drive, inputs

INV_FREQ = rope_inv_freq(DIM)


def pre_rope(k):
    """The keys before RoPE, float64 ``[layers, kv, T, d]``."""
    positions = torch.arange(k.shape[2])
    return apply_rope(k.double(), -positions, INV_FREQ)


def check_cache_positions(got, k, v, merged_ok=False):
    """Every slot ``i`` held after the last step (after evictions at every step, or at the
    prompt's end and every few steps): key = RoPE(pre-RoPE key, i + n - L), value untouched
    (``merged_ok``: slots whose value was merged are skipped). Returns how many slots moved."""
    base, moved = pre_rope(k), 0
    kept, _, cache = got[-1]
    n = k.shape[2]
    for layer, heads in enumerate(kept):
        keys, values, _ = cache.read(layer, [0])
        for h, positions in enumerate(heads):
            held = len(positions)
            for i, j in enumerate(positions):
                value = values[0, h, i].double()
                if merged_ok and not torch.allclose(value, v[layer, h, j].double(), atol=1e-6):
                    continue
                torch.testing.assert_close(value, v[layer, h, j].double(), atol=1e-6, rtol=0)
                target = i + n - held
                want = apply_rope(base[layer, h, j], torch.tensor(target), INV_FREQ)
                torch.testing.assert_close(keys[0, h, i].double(), want, atol=1e-5, rtol=1e-5)
                moved += target != j
    return moved


@pytest.mark.parametrize("name,schedule", [("h2o", None), ("snapkv", None), ("tova", None),
                                           ("snapkv", "streaming"), ("adakv", "prefill/2"),
                                           ("knorm", "streaming")])
def test_kept_keys_sit_at_their_cache_positions(name, schedule):
    kind, _, every = (schedule or "").partition("/")
    options = {"schedule": kind or None, "recompress_every": int(every) if every else None}
    if name in ("snapkv", "adakv"):
        options["window"] = 3
    q, k, v = inputs(3, layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = drive(get_policy(name, 2.0, rerotate=True, **options), q, k, v, chunk=4)
    assert check_cache_positions(got, k, v) > 0


def test_without_rerotate_keys_stay_at_their_original_positions():
    q, k, v = inputs(3)
    got = drive(get_policy("h2o", 2.0), q, k, v)
    keys, _, _ = got[-1][2].read(0, [0])
    for h, positions in enumerate(got[-1][0][0]):
        torch.testing.assert_close(keys[0, h, :len(positions)], k[0, h, positions])


def test_merged_keys_move_too():
    """D2O merges, then re-rotates: the slots it did not merge follow the RoPE identity, and
    some slots were merged."""
    q, k, v = inputs(0)
    got = drive(get_policy("d2o", 2.0, sinks=2, beta=0.5, rerotate=True), q, k, v)
    assert check_cache_positions(got, k, v, merged_ok=True) > 0
    _, values, _ = got[-1][2].read(0, [0])
    kept = got[-1][0][0]
    assert any(not torch.allclose(values[0, h, i].double(), v[0, h, j].double(), atol=1e-6)
               for h in range(KV) for i, j in enumerate(kept[h]))


def test_streamingllm_sinks_do_not_drift_in_bfloat16():
    """200 tokens through a bfloat16 cache, the sinks moving at almost every step: each sink
    key stays within two bfloat16 roundings of RoPE at its cache position (rotating the cached
    key step by step would drift: small angles round away)."""
    total = 200
    q, k, v = inputs(4, total=total)
    got = drive(get_policy("streamingllm", 2.0), q, k, v, dtype=torch.bfloat16)
    kept, _, cache = got[-1]
    keys, _, _ = cache.read(0, [0])
    base = pre_rope(k)
    held = len(kept[0][0])
    for h in range(KV):
        assert kept[0][h][:4] == [0, 1, 2, 3]
        want = apply_rope(base[0, h, :4], torch.arange(4) + total - held, INV_FREQ)
        error = (keys[0, h, :4].double() - want).norm(dim=-1) / want.norm(dim=-1)
        assert error.max() < 2 ** -7


@pytest.mark.parametrize("name,copies", [("streamingllm", 4), ("h2o", None)])
def test_the_copies_are_policy_state(name, copies):
    """StreamingLLM copies its sinks' keys, any other policy every held key (float32)."""
    cache = PagedKVCache(1, KV, DIM, num_pages=64, page_size=4, max_seqs=2, window=None,
                         dtype=torch.float64, max_seq_len=64)
    bytes_of = []
    for rerotate in (False, True):
        runner = PolicyRunner(get_policy(name, 2.0, rerotate=rerotate), cache, KV * GROUP, SCALE)
        seq = cache.add_sequence()
        runner.reset(seq)
        for t in range(20):
            cache.append(0, [seq], torch.randn(1, KV, DIM), torch.randn(1, KV, DIM))
            runner.observe(0, [seq], torch.randn(1, KV * GROUP, 1, DIM), torch.tensor([[t]]),
                           prefill=False)
            runner.evict([seq], [t + 1], decode=True)
        bytes_of.append(runner.state_bytes(seq))
        held = int(cache.head_lengths(seq).sum()) // KV
        cache.free_sequence(seq)
    per_head = held if copies is None else copies
    assert bytes_of[1] - bytes_of[0] == KV * per_head * DIM * 4
