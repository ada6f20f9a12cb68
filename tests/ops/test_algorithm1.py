"""dmc.ops.algorithm1: compressing a sequence chunk by chunk (open-slot pseudo-tokens, packing, the
open slot's tail) equals merging it token by token (Algorithm 1), slots and merge state alike."""
import pytest
import torch

from dmc.ops.algorithm1 import (
    KeyDecision,
    OpenSlot,
    compress_chunk,
    empty_prefix,
    hard_decisions,
    merge_into_open_slot,
    open_slot_prefix,
    ring_from_tail,
)
from dmc.ops.reference import compressed_cache_reference
from dmc.ops.rope import apply_rope, rope_inv_freq

HEADS, DIM, SEQ = 3, 8, 23


def _tokens(seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, HEADS, SEQ, DIM, generator=g)
    v = torch.randn(1, HEADS, SEQ, DIM, generator=g)
    alpha = (torch.rand(1, HEADS, SEQ, generator=g) > 0.4).float()
    alpha[..., 0] = 0
    omega = torch.rand(1, HEADS, SEQ, generator=g) + 0.05
    return k, v, alpha, omega


def _token_by_token(k, v, alpha, omega, window, inv_freq):
    """Per head: the list of slot keys (rotated) and values, and the final ring."""
    rows = window or 1
    ring = OpenSlot(torch.zeros(1, HEADS, rows, DIM), torch.zeros(1, HEADS, rows, DIM),
                    torch.zeros(1, HEADS, rows), torch.zeros(1, HEADS, dtype=torch.long))
    slots = [[] for _ in range(HEADS)]
    for t in range(SEQ):
        append = alpha[..., t] <= 0.5
        ring, mean_k, mean_v = merge_into_open_slot(ring, append, k[:, :, t], v[:, :, t],
                                                    omega[..., t], window)
        rotated = apply_rope(mean_k, torch.tensor(t), inv_freq)
        for h in range(HEADS):
            if not append[0, h]:
                slots[h].pop()
            slots[h].append((rotated[0, h], mean_v[0, h]))
    return slots, ring


@pytest.mark.parametrize("window", [3, None])
def test_chunks_equal_token_by_token(window):
    k, v, alpha, omega = _tokens()
    inv_freq = rope_inv_freq(DIM)
    want, want_ring = _token_by_token(k, v, alpha, omega, window, inv_freq)
    got = [[] for _ in range(HEADS)]
    ring, start = None, 0
    for size in (7, 1, 9, 6):
        span = slice(start, start + size)
        prefix = (empty_prefix(1, HEADS, DIM) if ring is None else open_slot_prefix(ring, window))
        chunk = compress_chunk(k[:, :, span], v[:, :, span], alpha[..., span], omega[..., span],
                               torch.arange(start, start + size), inv_freq, window, prefix)
        for h in range(HEADS):
            if start and alpha[0, h, start] > 0.5:  # the first token merged into the open slot
                got[h].pop()
            count = int(chunk.counts[0, h])
            got[h] += list(zip(chunk.slot_keys[0, h, :count], chunk.slot_values[0, h, :count]))
        ring = ring_from_tail(chunk.open, window or 1)
        start += size
    for h in range(HEADS):
        assert len(got[h]) == len(want[h])
        for (gk, gv), (wk, wv) in zip(got[h], want[h]):
            torch.testing.assert_close(gk, wk, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-5)
    assert torch.equal(ring.count, want_ring.count)
    held = torch.arange(window or 1) < ring.count.clamp(max=window or 1)[..., None]  # rows in use
    torch.testing.assert_close(ring.k[held], want_ring.k[held], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ring.v[held], want_ring.v[held], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ring.omega[held], want_ring.omega[held], rtol=1e-5, atol=1e-5)


def test_exact_merging_matches_the_float64_reference():
    k, v, alpha, omega = _tokens(seed=1)
    slots, _ = _token_by_token(k, v, alpha, omega, None, torch.zeros(DIM // 2))
    for h in range(HEADS):
        keys, values, _ = compressed_cache_reference(k[0, h], v[0, h], alpha[0, h], omega[0, h])
        torch.testing.assert_close(torch.stack([s[0] for s in slots[h]]).double(), keys[-1],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.stack([s[1] for s in slots[h]]).double(), values[-1],
                                   rtol=1e-5, atol=1e-5)


def test_llama3_scaling_keeps_short_and_divides_long_wavelengths():
    plain = rope_inv_freq(64, 500000.0)
    scaled = rope_inv_freq(64, 500000.0, llama3_scaling={"factor": 8.0})
    wavelen = 2 * torch.pi / plain
    assert torch.equal(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])
    torch.testing.assert_close(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_decision_splits_as_hard_decisions(dtype):
    """A key that still holds its decision channel splits into hard_decisions' alpha and key,
    a logit exactly at c included (no merge)."""
    gen = torch.Generator().manual_seed(4)
    key = (torch.randn(2, HEADS, SEQ, DIM, generator=gen) * 4).to(dtype)
    key[0, 0, 0, -1] = 1.5
    query = torch.randn(2, 2 * HEADS, SEQ, DIM, generator=gen).to(dtype)
    alpha, zeroed = KeyDecision(1.5).split(key)
    decided = hard_decisions(query, key, 1.5)
    assert torch.equal(alpha, decided.alpha) and torch.equal(zeroed, decided.key)
    assert alpha[0, 0, 0] == 0 and 0 < alpha.mean() < 1
