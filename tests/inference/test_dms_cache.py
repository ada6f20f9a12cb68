"""DMS's paged cache against the float64 delayed-eviction mask
(:func:`dmc.ops.reference.dms_attention_bias_reference`): for random hard decisions, the keys a
query sees after each prefill chunk and each batched decode step are exactly the keys the cache
holds (paged survivors + filled ring rows), attention equals the float64 masked softmax, and the
pages hold survivors only (never a page for an evicted token; all back in the pool at the end)."""
import math

import pytest
import torch

from dmc.inference import CacheFullError
from dmc.inference.paging import pages_for
from dmc.inference.dms_cache import DMSPagedCache
from dmc.ops.reference import dms_attention_bias_reference

DIM, PAGE, LAYERS = 8, 3, 2


class History:
    """Everything written for one sequence and layer: keys ``[kv, T, dim]`` (value channel 0 =
    position, to recognise a key in the cache), decisions ``[kv, T]`` and queries."""

    def __init__(self, q_heads, kv_heads, tokens, evict_rate, gen):
        self.keys = torch.randn(kv_heads, tokens, DIM, generator=gen, dtype=torch.float64)
        self.values = torch.randn(kv_heads, tokens, DIM, generator=gen, dtype=torch.float64)
        self.values[..., 0] = torch.arange(tokens, dtype=torch.float64)
        self.queries = torch.randn(q_heads, tokens, DIM, generator=gen, dtype=torch.float64)
        self.alpha = torch.rand(kv_heads, tokens, generator=gen) < evict_rate
        self.alpha[:, 0] = False  # alpha_0 := 0

    def bias(self, window):
        """``[kv, T, T]`` float64 reference mask (computed once)."""
        if getattr(self, "_bias", None) is None:
            self._bias = dms_attention_bias_reference(self.alpha[None].double(), window)[0]
        return self._bias

    def expected(self, window, rows, scale):
        """Float64 attention of queries ``rows`` under the reference mask, ``[q_heads, n, dim]``,
        and the keys query ``rows[-1]`` sees, per KV head."""
        end = rows[-1] + 1
        bias = self.bias(window)[:, :end, :end]
        group = self.queries.shape[0] // self.keys.shape[0]
        keys = self.keys[:, :end].repeat_interleave(group, 0)
        values = self.values[:, :end].repeat_interleave(group, 0)
        scores = self.queries[:, rows] @ keys.transpose(1, 2) * scale
        probs = torch.softmax(scores + bias[:, rows].repeat_interleave(group, 0), -1)
        seen = [set(torch.nonzero(b[rows[-1]] == 0)[:, 0].tolist()) for b in bias]
        return probs @ values, seen


def held_keys(cache, slot, layer):
    """Positions of the keys the cache holds per KV head: paged survivors and filled ring rows."""
    _, values, lengths = cache.read(layer, [slot])
    ring = int(cache.ring_occupancy([slot], layer)[0])
    held = []
    for h in range(cache.num_kv_heads):
        survivors = values[0, h, :lengths[0, h], 0].round().long().tolist()
        in_ring = cache.ring_v[slot, layer, h, :ring, 0].round().long().tolist()
        assert len(set(survivors)) == len(survivors) and not set(survivors) & set(in_ring)
        held.append(set(survivors) | set(in_ring))
    return held


def survivors(history, window, tokens):
    """``[kv]`` keys that left the window (position < tokens - w - 1) and were kept."""
    left = max(tokens - window - 1, 0)
    return (~history.alpha[:, 1:left + 1]).sum(1)


def check_state(cache, slot, histories, window, tokens):
    """Pages hold the survivors only; held slots = survivors + ring occupancy."""
    lengths = torch.stack([survivors(histories[layer], window, tokens) for layer in range(LAYERS)])
    assert torch.equal(cache.head_lengths(slot).long(), lengths)
    ring = min(tokens, window + 1)
    assert torch.equal(cache.held_slots(slot), lengths + ring)
    return int(pages_for(lengths, PAGE).sum())


@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (4, 2)])
@pytest.mark.parametrize("window,chunk", [(0, 2), (1, 3), (3, 4), (5, 1), (6, 16)])
def test_eviction_timing_equals_float64_mask(q_heads, kv_heads, window, chunk):
    """Sequences of different prompt lengths prefilled in chunks, then decoded as one batch at
    different positions (some still filling their ring): after every step the keys held are the
    keys the last query sees under the reference mask."""
    gen = torch.Generator().manual_seed(100 * window + chunk + q_heads)
    prompts, decode = (1, 5, 11), 14
    scale = DIM ** -0.5
    cache = DMSPagedCache(LAYERS, kv_heads, DIM, 200, window, page_size=PAGE, max_seqs=4,
                          dtype=torch.float64)
    slots = [cache.add_sequence() for _ in prompts]
    hist = {s: [History(q_heads, kv_heads, n + decode, 0.5, gen) for _ in range(LAYERS)]
            for s, n in zip(slots, prompts)}

    def check(slot, layer, rows, got, held=True):
        want, seen = hist[slot][layer].expected(window, rows, scale)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        if held:  # reading the held keys settles the cache: not inside a decode step
            assert held_keys(cache, slot, layer) == seen

    for slot, n in zip(slots, prompts):
        for start in range(0, n, chunk):
            rows = list(range(start, min(start + chunk, n)))
            for layer, h in enumerate(hist[slot]):
                got = cache.prefill(layer, slot, start, h.queries[:, rows], h.keys[:, rows],
                                    h.values[:, rows], h.alpha[:, rows], scale)
                check(slot, layer, rows, got)
    pages = sum(check_state(cache, s, hist[s], window, n) for s, n in zip(slots, prompts))
    assert cache.pages_in_use == pages
    for step in range(decode):
        cache.begin_decode(slots)
        for layer in range(LAYERS):
            hs = [hist[s][layer] for s in slots]
            pos = [n + step for n in prompts]
            cache.decode_write(layer, slots, torch.stack([h.keys[:, p] for h, p in zip(hs, pos)]),
                               torch.stack([h.values[:, p] for h, p in zip(hs, pos)]),
                               torch.stack([h.alpha[:, p] for h, p in zip(hs, pos)]))
            got = cache.attention(layer, slots,
                                  torch.stack([h.queries[:, p] for h, p in zip(hs, pos)]), scale)
            for i, (slot, p) in enumerate(zip(slots, pos)):
                check(slot, layer, [p], got[i][:, None], held=False)
        cache.settle()
        for layer in range(LAYERS):
            for slot, n in zip(slots, prompts):
                assert held_keys(cache, slot, layer) == hist[slot][layer].expected(
                    window, [n + step], scale)[1]
        pages = sum(check_state(cache, s, hist[s], window, n + step + 1)
                    for s, n in zip(slots, prompts))
        assert cache.pages_in_use == pages  # the reserved pages of dropped tokens came back
    for slot in slots:
        cache.free_sequence(slot)
    assert cache.pages_in_use == 0 and cache.free_pages == 200


@pytest.mark.parametrize("evict", [True, False])
def test_evicted_tokens_never_take_a_page(evict):
    """All tokens evicted: no page is ever held, only the ring; all kept: the pages hold every
    token that left the window."""
    window, tokens, kv = 2, 20, 2
    cache = DMSPagedCache(1, kv, DIM, 30, window, page_size=PAGE, max_seqs=1,
                          dtype=torch.float32)
    slot = cache.add_sequence()
    keys = torch.randn(kv, tokens, DIM)
    cache.prefill(0, slot, 0, torch.randn(kv, 4, DIM), keys[:, :4], keys[:, :4],
                  torch.full((kv, 4), evict), 1.0)
    for p in range(4, tokens):
        cache.begin_decode([slot])
        cache.decode_write(0, [slot], keys[None, :, p], keys[None, :, p],
                           torch.full((1, kv), evict))
        cache.attention(0, [slot], torch.randn(1, kv, DIM))
        cache.settle()
        kept = 0 if evict else p + 1 - window - 1
        assert cache.head_lengths(slot)[0].tolist() == [kept] * kv
        assert cache.pages_in_use == kv * math.ceil(kept / PAGE)
    bytes_ = cache.sequence_bytes(slot)
    assert bytes_["dmc_state"] == kv * (window + 1) * (2 * DIM * 4 + 1)
    assert torch.equal(cache.held_slots(slot), cache.head_lengths(slot).long() + window + 1)


def test_prefill_position_must_follow_the_cache():
    cache = DMSPagedCache(1, 1, DIM, 4, 2, page_size=PAGE, max_seqs=1, dtype=torch.float32)
    slot = cache.add_sequence()
    x = torch.randn(1, 3, DIM)
    cache.prefill(0, slot, 0, x, x, x, torch.zeros(1, 3, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match="position 5, but 3 tokens"):
        cache.prefill(0, slot, 5, x, x, x, torch.zeros(1, 3, dtype=torch.bool), 1.0)


def test_a_full_pool_raises_before_any_change():
    """Survivors need pages: a prefill whose kept tokens do not fit raises CacheFullError."""
    cache = DMSPagedCache(1, 1, DIM, 1, 0, page_size=PAGE, max_seqs=1, dtype=torch.float32)
    slot = cache.add_sequence()
    x = torch.randn(1, 8, DIM)
    with pytest.raises(CacheFullError):
        cache.prefill(0, slot, 0, x, x, x, torch.zeros(1, 8, dtype=torch.bool), 1.0)
    assert cache.pages_in_use == 0


def test_paged_growth_is_what_kept_tokens_take():
    """Every token kept: the survivors gained over the next k tokens are exactly the tokens that
    leave the ring, which :meth:`paged_growth` returns (the scheduler's worst case)."""
    window, tokens, kv = 3, 16, 2
    cache = DMSPagedCache(1, kv, DIM, 30, window, page_size=PAGE, max_seqs=1,
                          dtype=torch.float32)
    assert cache.paged_growth([None], 10)[0].tolist() == [[10 - window - 1] * kv]
    assert cache.paged_growth([None], window + 1)[0].tolist() == [[0] * kv]
    slot = cache.add_sequence()
    keys = torch.randn(kv, tokens, DIM)
    cache.prefill(0, slot, 0, torch.randn(kv, 2, DIM), keys[:, :2], keys[:, :2],
                  torch.zeros(kv, 2, dtype=torch.bool), 1.0)
    lengths, growth = [cache.head_lengths(slot)[0]], []
    for p in range(2, tokens):
        growth.append([cache.paged_growth([slot], k)[0, 0] for k in range(1, 5)])
        cache.begin_decode([slot])
        cache.decode_write(0, [slot], keys[None, :, p], keys[None, :, p],
                           torch.zeros(1, kv, dtype=torch.bool))
        cache.attention(0, [slot], torch.randn(1, kv, DIM))
        cache.settle()
        lengths.append(cache.head_lengths(slot)[0])
    for i, bounds in enumerate(growth):
        for k, bound in enumerate(bounds, start=1):
            if i + k < len(lengths):
                assert torch.equal(bound, (lengths[i + k] - lengths[i]).long())


def drive_decode_writes(caches, writes, window, dtype, static_from=2):
    """Random batches of sequences (varying subsets, slot order shuffled) decode through
    ``caches`` (``writes[i]``: cache i's ``decode_write`` keywords; caches from ``static_from``
    on take static steps once every ring of the batch is full); after every step each tensor
    of the caches equals cache 0's (bf16 floats of a ``use_triton`` cache on the CPU to the
    interpreter's rounding). Returns the sequence slots and the count of static steps."""
    gen = torch.Generator().manual_seed(window)
    kv, seqs, steps = 2, 3, 3 * (window + 1) + 2 * PAGE + 3
    device = caches[0].device
    slots = [[c.add_sequence() for _ in range(seqs)] for c in caches][0]
    static_steps = 0
    for step in range(steps):
        batch = [slots[i] for i in torch.randperm(seqs, generator=gen)[:1 + step % seqs]]
        keys, values = torch.randn(2, len(batch), kv, DIM, generator=gen).to(device)
        positions = caches[-1].written[batch, 0].clone()
        static = bool((positions > window).all())
        static_steps += static
        for i, cache in enumerate(caches):
            cache.begin_decode(batch, static=static and i >= static_from)
        for layer in range(LAYERS):
            evict = (torch.rand(len(batch), kv, generator=gen) < 0.4).to(device)
            for cache, write in zip(caches, writes):
                cache.decode_write(layer, batch, keys, values, evict, positions.to(device),
                                   **write)
        for cache in caches:
            cache.settle()
        for name in ("k_pages", "v_pages", "block_tables", "lengths", "ring_k", "ring_v",
                     "ring_evict", "written"):
            want = getattr(caches[0], name)
            for other, write in zip(caches[1:], writes[1:]):
                got = getattr(other, name)
                if (write.get("use_triton") and device.type == "cpu"
                        and dtype == torch.bfloat16 and got.is_floating_point()):
                    torch.testing.assert_close(got.float(), want.float(), rtol=1 / 128, atol=0)
                else:
                    assert torch.equal(want, got), (step, name)
    assert len({cache.pages_in_use for cache in caches}) == 1 and caches[0].pages_in_use > 0
    return slots, static_steps


@pytest.mark.parametrize("window,dtype", [(0, torch.float32), (2, torch.bfloat16),
                                          (5, torch.float32)])
def test_compiled_decode_write_equals_the_pytorch_path(window, dtype):
    """Four caches, one writing with the compiled kernel, one with the PyTorch path, one with
    static steps (device positions, no host branch) once every ring of the batch is full, one
    with the Triton kernel (:mod:`dmc.inference.kernels.dms_write`, under the interpreter;
    static steps as the third): every tensor of the caches stays equal (pages, block tables,
    lengths, rings, flags, token counts), across ring wrap-arounds, page boundaries and
    evictions."""
    caches = [DMSPagedCache(LAYERS, 2, DIM, 200, window, page_size=PAGE, max_seqs=3,
                            dtype=dtype) for _ in range(4)]
    caches[1].native_kernels = False
    slots, static_steps = drive_decode_writes(caches, [{}, {}, {}, {"use_triton": True}],
                                              window, dtype)
    assert static_steps > 3
    caches[2].free_sequence(slots[0])
    with pytest.raises(ValueError, match="window ring full"):
        caches[2].begin_decode([slots[1], caches[2].add_sequence()], static=True)


@pytest.mark.gpu
@pytest.mark.parametrize("window,dtype", [(2, torch.bfloat16), (32, torch.float16)])
def test_triton_decode_write_on_cuda_equals_the_pytorch_path(window, dtype):
    """On a GPU: the Triton write (static steps once the rings are full) and the PyTorch path
    keep every tensor of their caches equal, bit for bit."""
    caches = [DMSPagedCache(LAYERS, 2, DIM, 400, window, page_size=PAGE, max_seqs=3, dtype=dtype,
                            device="cuda") for _ in range(2)]
    drive_decode_writes(caches, [{"use_triton": False}, {"use_triton": True}], window, dtype,
                        static_from=1)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("window,dtype,q_heads", [(2, torch.bfloat16, 4), (4, torch.float32, 2)])
def test_the_write_reading_the_queries_equals_decode_rope_then_write(window, dtype, q_heads,
                                                                     device):
    """The Triton decode write with ``query=`` (one launch: the eviction read from the queries,
    the queries and the key rotated) against the decode RoPE kernel for the queries and the
    keys and then the write: the same rotated queries and every tensor of the caches, bit for
    bit, across ring wrap-arounds and page boundaries (the interpreter on the CPU)."""
    from dmc.inference.kernels import EvictionChannel, run_decode_rope
    from dmc.ops.rope import rope_inv_freq, rope_tables

    kv, seqs, c, scale = 2, 3, 0.5, 1.0
    caches = [DMSPagedCache(LAYERS, kv, DIM, 200, window, page_size=PAGE, max_seqs=seqs,
                            dtype=dtype, device=device) for _ in range(2)]
    slots = [[cache.add_sequence() for _ in range(seqs)] for cache in caches][0]
    channel = EvictionChannel(kv, c, scale)
    gen = torch.Generator().manual_seed(window)
    for step in range(2 * (window + 1) + 2 * PAGE):
        positions = caches[0].written[slots, 0].to(device)
        cos, sin = rope_tables(positions[:, None], rope_inv_freq(DIM).to(device))
        for cache in caches:
            cache.begin_decode(slots)
        for layer in range(LAYERS):
            q = torch.randn(seqs, q_heads, DIM, generator=gen).to(device, dtype)
            keys, values = torch.randn(2, seqs, kv, DIM, generator=gen).to(device, dtype)
            q_rot, evict = run_decode_rope(q, cos, sin, channel)
            caches[0].decode_write(layer, slots, run_decode_rope(keys, cos, sin)[0], values,
                                   evict, positions, use_triton=True)
            fused = caches[1].decode_write(layer, slots, keys, values, None, positions,
                                           use_triton=True, query=(q, cos, sin, channel))
            assert torch.equal(fused, q_rot), (step, layer)
        for cache in caches:
            cache.settle()
        for name in ("k_pages", "v_pages", "lengths", "ring_k", "ring_v", "ring_evict",
                     "written"):
            assert torch.equal(getattr(caches[1], name), getattr(caches[0], name)), (step, name)
    assert int(caches[0].lengths.sum()) > 0 and bool(caches[0].ring_evict.any())
