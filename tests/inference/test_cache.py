"""PagedKVCache: DMC append/merge against a float64 simulation, prefill packing, the allocator."""
import random

import pytest
import torch

from dmc.inference import CacheFullError, PagedKVCache
from dmc.inference.scheduler import worst_new_pages
from dmc.ops import partial_accumulate, zero_decision_channel
from dmc.ops.algorithm1 import KeyDecision

F32_TOL = dict(atol=1e-4, rtol=1e-4)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def rope64(x, position, base=10000.0):
    """Rotate-half RoPE in float64."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(0, x.shape[-1], 2, dtype=torch.float64) / x.shape[-1])
    cos, sin = torch.cos(position * inv_freq), torch.sin(position * inv_freq)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class HeadSim:
    """Algorithm 1 for one head in float64: a slot's key is the omega-weighted mean of its last
    ``window`` tokens (all of them when ``window`` is None), rotated at its newest token."""

    def __init__(self, window):
        self.window, self.keys, self.values = window, [], []
        self.open, self.open_count = [], 0  # pre-RoPE (k, v, omega) of the open slot's tokens

    def step(self, k, v, omega, alpha, position):
        if alpha < 0.5 or not self.keys:
            self.keys.append(None)
            self.values.append(None)
            self.open, self.open_count = [], 0
        self.open.append((k.double(), v.double(), float(omega)))
        if self.window is not None:
            self.open = self.open[-self.window :]
        self.open_count += 1
        mean_k, mean_v, _ = self.open_mean()
        self.keys[-1], self.values[-1] = rope64(mean_k, position), mean_v

    def open_mean(self):
        weights = torch.tensor([w for _, _, w in self.open], dtype=torch.float64)
        keys = torch.stack([k for k, _, _ in self.open])
        values = torch.stack([v for _, v, _ in self.open])
        total = weights.sum()
        return weights @ keys / total, weights @ values / total, total


def cached_slots(cache, seq, layer, head):
    """A head's slots read through its block table: float64 keys, values ``[length, head_dim]``."""
    slots = torch.arange(int(cache.lengths[seq, layer, head]))
    pages = cache.block_tables[seq, layer, head, slots // cache.page_size].long()
    offsets = slots % cache.page_size
    return cache.k_pages[pages, offsets].double(), cache.v_pages[pages, offsets].double()


def assert_matches_sims(cache, sims, tol):
    for (seq, layer, head), sim in sims.items():
        keys, values = cached_slots(cache, seq, layer, head)
        assert keys.shape[0] == len(sim.keys)
        torch.testing.assert_close(keys, torch.stack(sim.keys), **tol)
        torch.testing.assert_close(values, torch.stack(sim.values), **tol)


def random_token(gen, heads, dim, batch=1, p_merge=0.6):
    """``k, v [batch, heads, dim]``, ``omega, alpha [batch, heads]`` (hard alpha)."""
    k, v = torch.randn(2, batch, heads, dim, generator=gen)
    omega = torch.rand(batch, heads, generator=gen) * 2 + 0.1
    alpha = (torch.rand(batch, heads, generator=gen) < p_merge).float()
    return k, v, omega, alpha


@pytest.mark.parametrize(
    "window,dtype",
    [(3, torch.float32), (None, torch.float32), (3, torch.bfloat16), (None, torch.bfloat16)],
)
def test_write_matches_float64_simulation(window, dtype):
    layers, heads, dim = 2, 2, 8
    cache = PagedKVCache(layers, heads, dim, 64, page_size=4, max_seqs=4, window=window,
                         dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    seqs = [cache.add_sequence() for _ in range(3)]
    position = dict(zip(seqs, (0, 17, 90)))
    sims = {(s, l, h): HeadSim(window) for s in seqs for l in range(layers) for h in range(heads)}
    for step in range(24):
        batch = random.Random(step).sample(seqs, k=1 + step % 3)
        positions = torch.tensor([position[s] for s in batch])
        for layer in range(layers):
            k, v, omega, alpha = random_token(gen, heads, dim, len(batch))
            k, v = k.to(dtype), v.to(dtype)
            cache.write(layer, batch, positions, k, v, omega, alpha)
            for b, s in enumerate(batch):
                for h in range(heads):
                    sims[s, layer, h].step(k[b, h], v[b, h], omega[b, h], alpha[b, h], position[s])
        for s in batch:
            position[s] += 1
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    assert_matches_sims(cache, sims, tol)

    q = torch.randn(3, 2 * heads, dim, generator=gen)  # GQA: 2 query heads per KV head
    out = cache.attention(1, seqs, q.to(dtype))
    for b, s in enumerate(seqs):
        for h in range(2 * heads):
            sim = sims[s, 1, h // 2]
            probs = torch.softmax(torch.stack(sim.keys) @ q[b, h].double() * dim**-0.5, dim=0)
            torch.testing.assert_close(out[b, h].double(), probs @ torch.stack(sim.values), **tol)


@pytest.mark.parametrize("window", [3, None])
def test_merged_slots_equal_training_accumulation(window):
    """Each finished slot holds Eq. 9 (``dmc.ops.partial_accumulate``) at its last token, rotated
    at that token's position."""
    gen = torch.Generator().manual_seed(2)
    seq_len, heads, dim = 20, 2, 8
    k, v, omega, alpha = random_token(gen, heads, dim, seq_len, p_merge=0.7)  # batch = time
    cache = PagedKVCache(1, heads, dim, 16, page_size=4, max_seqs=1, window=window,
                         dtype=torch.float32)
    seq = cache.add_sequence()
    for t in range(seq_len):
        step = slice(t, t + 1)
        cache.write(0, [seq], torch.tensor([t]), k[step], v[step], omega[step], alpha[step])

    def as_bhs(x):  # [seq, heads, ...] -> [1, heads, seq, ...]
        return x.transpose(0, 1).unsqueeze(0).double()

    k_acc, v_acc = partial_accumulate(as_bhs(k), as_bhs(v), as_bhs(alpha), as_bhs(omega), window)
    for h in range(heads):
        last = [t for t in range(seq_len) if t == seq_len - 1 or alpha[t + 1, h] < 0.5]
        keys, values = cached_slots(cache, seq, 0, h)
        expected_k = torch.stack([rope64(k_acc[0, h, t], t) for t in last])
        torch.testing.assert_close(keys, expected_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values, v_acc[0, h, last], atol=1e-5, rtol=1e-5)


def pack_from_sims(cache, layer, seq, sims, first_slot, overwrite_last=None):
    """Pack each head's simulated slots from ``first_slot[h]`` on, plus its open-slot state."""
    heads, rows = len(sims), cache.window or 1
    counts = [len(sim.keys) - first for sim, first in zip(sims, first_slot)]
    keys = torch.zeros(heads, max(counts), cache.head_dim)
    values = torch.zeros_like(keys)
    open_k, open_v = torch.zeros(2, heads, rows, cache.head_dim)
    open_omega = torch.zeros(heads, rows)
    for h, (sim, first) in enumerate(zip(sims, first_slot)):
        keys[h, : counts[h]] = torch.stack(sim.keys[first:]).float()
        values[h, : counts[h]] = torch.stack(sim.values[first:]).float()
        if cache.window is None:
            open_k[h, 0], open_v[h, 0], open_omega[h, 0] = sim.open_mean()
        else:
            for r, (k, v, w) in enumerate(sim.open):
                open_k[h, r], open_v[h, r], open_omega[h, r] = k, v, w
    open_count = [sim.open_count for sim in sims]
    cache.pack_prefill(layer, seq, keys, values, counts, open_k, open_v, open_omega, open_count,
                       overwrite_last=overwrite_last)


@pytest.mark.parametrize("window", [3, None])
def test_pack_prefill_chunks_then_decode(window):
    """Two packed prefill chunks (the second's first token may merge into the first's last slot),
    then decode writes, equal the token-by-token simulation."""
    heads, dim, layer = 3, 8, 1
    cache = PagedKVCache(2, heads, dim, 64, page_size=4, max_seqs=2, window=window,
                         dtype=torch.float32)
    seq = cache.add_sequence()
    gen = torch.Generator().manual_seed(3)
    sims = [HeadSim(window) for _ in range(heads)]
    tokens = [random_token(gen, heads, dim) for _ in range(30)]
    tokens[11][3][0, 1] = 1.0  # head 1 merges the second chunk's first token into its last slot
    tokens[11][3][0, 2] = 0.0  # head 2 opens a new slot there

    def simulate(span):
        for t in span:
            k, v, omega, alpha = tokens[t]
            for h, sim in enumerate(sims):
                sim.step(k[0, h], v[0, h], omega[0, h], alpha[0, h], t)

    simulate(range(11))
    pack_from_sims(cache, layer, seq, sims, [0] * heads)
    before = [len(sim.keys) for sim in sims]
    simulate(range(11, 20))
    merged = [bool(tokens[11][3][0, h] > 0.5) for h in range(heads)]
    first = [n - m for n, m in zip(before, merged)]
    pack_from_sims(cache, layer, seq, sims, first, overwrite_last=merged)
    for t in range(20, 30):
        cache.write(layer, [seq], torch.tensor([t]), *tokens[t])
    simulate(range(20, 30))
    assert_matches_sims(cache, {(seq, layer, h): sim for h, sim in enumerate(sims)}, F32_TOL)


def test_vanilla_append_and_alpha_zero_write():
    """Plain appends store the given keys; DMC writes with alpha = 0 store RoPE(k) the same way."""
    gen = torch.Generator().manual_seed(4)
    vanilla, dmc = (PagedKVCache(1, 2, 8, 16, page_size=4, max_seqs=2, window=3,
                                 dtype=torch.float32) for _ in range(2))
    seqs = [vanilla.add_sequence(), vanilla.add_sequence()]
    assert [dmc.add_sequence() for _ in seqs] == seqs
    for t in range(9):
        k, v, omega, _ = random_token(gen, 2, 8, batch=2)
        positions = torch.tensor([t, t + 3])
        vanilla.append(0, seqs, rope64(k.double(), positions.double()[:, None, None]), v)
        dmc.write(0, seqs, positions, k, v, omega, torch.zeros(2, 2))
    for s in seqs:
        for h in range(2):
            for got, want in zip(cached_slots(dmc, s, 0, h), cached_slots(vanilla, s, 0, h)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert vanilla.head_lengths(seqs[1]).tolist() == [[9, 9]]


@pytest.mark.parametrize("tokens", [1, 3, 4, 9])
def test_worst_new_pages_batched_equals_head_by_head(tokens):
    """The scheduler's batched reservation: per sequence (one without a slot included), the sum
    over heads of the pages ``tokens`` more slots need beyond those held, head by head."""
    cache = PagedKVCache(2, 2, 8, 64, page_size=4, max_seqs=3, dtype=torch.float32)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    for layer, grown in ((0, [[9, 4]]), (1, [[1, 8]])):
        for step in range(max(map(max, grown))):
            for s, n in zip(seqs, grown[0]):
                if step < n:
                    cache.append(layer, [s], torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    slots = [seqs[0], None, seqs[1]]
    expected = []
    for slot in slots:
        held = [0] * 4 if slot is None else cache.head_lengths(slot).reshape(-1).tolist()
        expected.append(sum(-(-(n + tokens) // 4) - -(-n // 4) for n in held))
    assert worst_new_pages(cache, slots, tokens) == expected


def check_allocator_invariants(cache):
    owned = cache.block_tables[cache.block_tables >= 0].tolist()
    free = cache.allocator.free_list
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert set(owned).isdisjoint(free) and len(set(free)) == len(free) == cache.free_pages
    assert len(owned) + cache.free_pages == cache.num_pages
    pages_needed = (cache.lengths.long() + cache.page_size - 1) // cache.page_size
    assert cache.pages_in_use == int(pages_needed.sum()) == len(owned)
    columns = torch.arange(cache.max_pages_per_head)
    assert torch.equal(cache.block_tables >= 0, columns < pages_needed.unsqueeze(-1))
    page_bytes = 2 * cache.page_size * cache.head_dim * cache.k_pages.element_size()
    assert cache.page_bytes == page_bytes


STATE = ("k_pages", "v_pages", "block_tables", "lengths", "open_k", "open_v", "open_omega",
         "open_count")


def snapshot(cache):
    tensors = {name: getattr(cache, name).clone() for name in STATE}
    return tensors | {"free": list(cache.allocator.free_list)}


def assert_unchanged(cache, before):
    after = snapshot(cache)
    assert after.pop("free") == before["free"]
    for name, value in after.items():
        assert torch.equal(value, before[name]), name


def test_allocator_invariants_under_random_operations():
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    layers, heads, dim = 2, 2, 4
    cache = PagedKVCache(layers, heads, dim, 40, page_size=4, max_seqs=4, window=2,
                         dtype=torch.bfloat16, max_seq_len=32)
    active, full_errors = {}, 0  # sequence slot -> next position
    for _ in range(300):
        op = rng.random()
        if op < 0.1 and len(active) < 4:
            active[cache.add_sequence()] = 0
        elif op < 0.17 and active:
            seq = rng.choice(sorted(active))
            del active[seq]
            cache.free_sequence(seq)
        elif active:
            batch = rng.sample(sorted(active), k=rng.randint(1, len(active)))
            k, v, omega, alpha = random_token(gen, heads, dim, len(batch), p_merge=0.4)
            layer = rng.randrange(layers)
            before = snapshot(cache)
            try:
                if op < 0.25:
                    cache.append(layer, batch, k, v)
                else:
                    positions = torch.tensor([active[s] for s in batch])
                    cache.write(layer, batch, positions, k, v, omega, alpha)
            except CacheFullError:
                full_errors += 1
                assert_unchanged(cache, before)
            for s in batch:
                active[s] += 1
        check_allocator_invariants(cache)
    assert full_errors > 0  # the pool (or a head's 32-slot limit) ran out at least once
    for s in list(active):
        cache.free_sequence(s)
    check_allocator_invariants(cache)
    assert cache.pages_in_use == 0
    assert sorted(cache.allocator.free_list) == list(range(40))


# the interpreter's Triton cases take 8-15 s each: two of the four run in the fast suite, one
# windowed and one exact, one with each source of decisions
@pytest.mark.parametrize("window,use_triton,key_decides", [
    (3, False, False), (None, False, False),
    pytest.param(3, True, False, marks=pytest.mark.slow), (None, True, False),
    (3, True, True), pytest.param(None, True, True, marks=pytest.mark.slow), (3, False, True)])
def test_deferred_write_equals_host_decided_write(window, use_triton, key_decides):
    """Deferred DMC writes (decisions kept on the device, pages reserved for every head of every
    layer at a page boundary by begin_decode, lengths read back once by settle, with or without a
    carried tensor) leave the same slots, lengths, merge state and page count as host-decided
    ones; attention before settle sees the new slots. ``key_decides``: the deferred writes get
    the decisions in the key's last channel (:class:`KeyDecision`, read in place by the Triton
    kernel, split off by the PyTorch path), the host-decided ones alpha and the zeroed key."""
    gen = torch.Generator().manual_seed(11)
    layers, heads, dim = 2, 3, 8
    caches = [PagedKVCache(layers, heads, dim, 60, page_size=4, max_seqs=3, window=window,
                           dtype=torch.float32, max_seq_len=64) for _ in range(2)]
    seqs = [[c.add_sequence() for _ in range(3)] for c in caches][0]
    for step in range(14):
        batch = seqs if step % 4 else seqs[::-2]
        k, v, omega, alpha = random_token(gen, heads, dim, len(batch), p_merge=0.6)
        q = torch.randn(len(batch), 2 * heads, dim, generator=gen)
        positions = torch.full((len(batch),), step)
        inputs = [(k, alpha)] * 2
        if key_decides:  # logits 0.5 above or below c in the last channel
            raw = torch.cat([k[..., :-1], (torch.where(alpha > 0.5, 0.5, -0.5) + 2.0)[..., None]],
                            dim=-1)
            inputs = [(zero_decision_channel(raw), alpha), (raw, KeyDecision(2.0))]
        caches[1].begin_decode(batch)
        for layer in range(layers):
            outs = []
            for cache, defer, (key, decisions) in zip(caches, (False, True), inputs):
                cache.write(layer, batch, positions, key, v, omega, decisions, defer=defer,
                            use_triton=use_triton)
                outs.append(cache.attention(layer, batch, q))
            torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
        if step % 2:  # the engine's way: the sampled tokens ride along in the same copy
            carried = torch.randn(2, len(batch), dtype=torch.float64, generator=gen)
            assert torch.equal(caches[1].settle(carry=carried), carried)
        else:
            assert caches[1].settle() is None
        check_allocator_invariants(caches[1])
        assert caches[1].pages_in_use == caches[0].pages_in_use
    exact, deferred = caches
    assert torch.equal(deferred.settle(carry=torch.ones(3, dtype=torch.float64)), torch.ones(3))
    for name in ("lengths", "open_k", "open_v", "open_omega", "open_count"):
        assert torch.equal(getattr(deferred, name), getattr(exact, name)), name
    for layer in range(layers):
        for got, want in zip(deferred.read(layer, seqs), exact.read(layer, seqs)):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_a_deferred_write_needs_its_step():
    """A deferred write outside the step begin_decode opened for the same sequences, or a second
    one of a layer in a step, raises before touching the cache (an append decided on the device
    could land on a page its head does not own); begin_decode takes the pages of every layer at
    a page boundary at once and settle gives back those of the heads that merged."""
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(3, 2, 8, 40, page_size=2, max_seqs=2, dtype=torch.float32,
                         max_seq_len=16)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    k, v, omega, _ = random_token(gen, 2, 8, 2)
    merge, append = torch.ones(2, 2), torch.zeros(2, 2)

    def write(layer, alpha, batch=seqs):
        cache.write(layer, batch, torch.zeros(len(batch), dtype=torch.long), k[:len(batch)],
                    v[:len(batch)], omega[:len(batch)], alpha[:len(batch)], defer=True)

    with pytest.raises(RuntimeError, match="layer 0 .* needs its own reserve_step"):
        write(0, append)
    cache.begin_decode(seqs)  # every head is empty: one page each, 3 x 2 x 2
    assert cache.pages_in_use == 12
    write(0, append)
    with pytest.raises(RuntimeError, match="layer 0"):
        write(0, append)
    with pytest.raises(RuntimeError, match=r"layer 1 for sequences \[0\]"):
        write(1, append, batch=seqs[:1])
    write(1, append)
    cache.settle()  # layer 2 never written: its pages return
    check_allocator_invariants(cache)
    assert cache.pages_in_use == 8
    cache.begin_decode(seqs)  # lengths 1 in layers 0-1 (page not full), 0 in layer 2
    assert cache.pages_in_use == 12
    for layer in range(3):
        write(layer, merge)  # an empty head appends whatever its decision
    cache.settle()
    check_allocator_invariants(cache)
    assert cache.pages_in_use == 12
    assert cache.head_lengths(seqs[1]).tolist() == [[1, 1]] * 3


def test_cache_full_error_names_pages_and_changes_nothing():
    cache = PagedKVCache(1, 2, 4, 5, page_size=2, max_seqs=1, window=None, dtype=torch.float32,
                         max_seq_len=8)
    seq = cache.add_sequence()
    ones = torch.ones(1, 2, 4)

    def write(alpha):
        omega, alpha = torch.ones(1, 2), torch.tensor([alpha])
        cache.write(0, [seq], torch.tensor([0]), ones, ones, omega, alpha)

    write([0.0, 0.0])  # lengths (1, 1): two pages
    write([0.0, 0.0])  # (2, 2): none
    before = snapshot(cache)
    with pytest.raises(CacheFullError, match="need 4 pages, only 3 free"):  # (6, 6): 3 pages each
        cache.pack_prefill(0, seq, torch.ones(2, 4, 4), torch.ones(2, 4, 4), [4, 4],
                           torch.ones(2, 1, 4), torch.ones(2, 1, 4), torch.ones(2, 1), [1, 1])
    assert_unchanged(cache, before)
    write([0.0, 0.0])  # (3, 3): two pages
    write([0.0, 0.0])  # (4, 4): none
    before = snapshot(cache)
    with pytest.raises(CacheFullError, match="need 2 pages, only 1 free"):
        write([0.0, 0.0])
    assert_unchanged(cache, before)
    write([1.0, 0.0])  # head 0 merges, only head 1 crosses a page boundary: (4, 5)
    assert cache.free_pages == 0 and cache.head_lengths(seq).tolist() == [[4, 5]]
    check_allocator_invariants(cache)
    cache.free_sequence(seq)
    assert cache.pages_in_use == 0


def test_sequence_slots_and_head_limit():
    cache = PagedKVCache(1, 1, 4, 8, page_size=2, max_seqs=1, window=3, dtype=torch.float32,
                         max_seq_len=4)
    seq = cache.add_sequence()
    with pytest.raises(CacheFullError, match="sequence slots"):
        cache.add_sequence()
    ones = torch.ones(1, 1, 4)
    for _ in range(4):
        cache.append(0, [seq], ones, ones)
    with pytest.raises(CacheFullError, match="max_seq_len"):
        cache.append(0, [seq], ones, ones)
    cache.free_sequence(seq)
    assert cache.pages_in_use == 0 and cache.add_sequence() == seq
    with pytest.raises(ValueError, match="distinct and added"):
        cache.append(0, [seq, seq], torch.ones(2, 1, 4), torch.ones(2, 1, 4))


@pytest.mark.parametrize("window,rows", [(3, 3), (None, 1)])
def test_sequence_bytes_counts_pages_tables_and_merge_state(window, rows):
    """kv = pages x page bytes; metadata = 4 bytes per page id and per head length; dmc_state =
    every head's float32 ring (or running mean) of keys, values and omegas plus its int32 count."""
    layers, heads, dim, page = 2, 3, 8, 4
    cache = PagedKVCache(layers, heads, dim, 64, page_size=page, max_seqs=2, window=window,
                         dtype=torch.bfloat16)
    slot = cache.add_sequence()
    lengths = torch.tensor([[1, 4, 9], [0, 5, 13]])
    for layer in range(layers):
        cache.allocator.grow(torch.tensor([slot]), layer, lengths[layer][None])
    pages = int(((lengths + page - 1) // page).sum())
    got = cache.sequence_bytes(slot)
    assert got == {"kv": pages * 2 * page * dim * 2, "metadata": pages * 4 + layers * heads * 4,
                   "dmc_state": layers * heads * ((2 * rows * dim + rows) * 4 + 4)}
    assert cache.sequence_bytes(slot, dmc_state=False)["dmc_state"] == 0


@pytest.mark.parametrize("window,ring_dtype", [(None, torch.bfloat16), (3, torch.int8),
                                               (3, torch.float64)])
def test_a_ring_dtype_the_window_cannot_take_is_refused(window, ring_dtype):
    """The running mean (``window=None``) accumulates: float32 only; a ring holds float32 or a
    16-bit model's own keys."""
    with pytest.raises(ValueError, match=f"ring_dtype: accepted torch.float32.* got {ring_dtype}"):
        PagedKVCache(1, 1, 4, 4, page_size=2, max_seqs=1, window=window, ring_dtype=ring_dtype)
