"""Paged decode and DMC write kernels: the PyTorch reference against float64, Triton (the
interpreter on CPU) and the batched CPU paths against the reference."""
import functools
import itertools
import math
import os
import time

import pytest
import torch

from dmc.inference import PagedKVCache
from dmc.inference.kernels import (
    dmc_write_inplace,
    dmc_write_reference,
    paged_decode_batched,
    paged_decode_reference,
    resolve_use_triton,
    rope_inv_freq,
    run_dmc_write,
    run_paged_decode,
)
from dmc.inference.kernels import native as native_kernels
from dmc.inference.kernels.paged_cpu import length_buckets
from triton_aot import compile_in_subprocess

TOLERANCE = {  # output rounding of the dtype, plus one ulp for the interpreter's truncating casts
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def random_paged_kv(lengths, head_dim, page_size, dtype, gen, spare_pages=3):
    """K/V pools whose pages are handed out in shuffled order; unused slots hold NaN so that any
    read past a head's length shows up. Returns ``k_pages, v_pages, block_tables, lengths``."""
    pages_per_head = [[math.ceil(n / page_size) for n in row] for row in lengths.tolist()]
    num_pages = sum(map(sum, pages_per_head)) + spare_pages
    max_pages = max(max(row) for row in pages_per_head) + 1
    k_pages = torch.full((num_pages, page_size, head_dim), float("nan"), dtype=dtype)
    v_pages = torch.full_like(k_pages, float("nan"))
    tables = torch.full(lengths.shape + (max_pages,), -1, dtype=torch.int32)
    free = torch.randperm(num_pages, generator=gen).tolist()
    for b, h in itertools.product(*map(range, lengths.shape)):
        n = int(lengths[b, h])
        for p in range(math.ceil(n / page_size)):
            page = free.pop()
            tables[b, h, p] = page
            used = min(page_size, n - p * page_size)
            k_pages[page, :used] = torch.randn(used, head_dim, generator=gen).to(dtype)
            v_pages[page, :used] = torch.randn(used, head_dim, generator=gen).to(dtype)
    return k_pages, v_pages, tables, lengths.to(torch.int32)


def dense_attention_float64(q, k_pages, v_pages, tables, lengths, scale):
    """Per (sequence, query head): gather the head's slots and run softmax attention in float64."""
    batch, q_heads, head_dim = q.shape
    group = q_heads // tables.shape[1]
    page_size = k_pages.shape[1]
    out = torch.zeros(batch, q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            kh, n = h // group, int(lengths[b, h // group])
            if n == 0:
                continue
            slots = torch.arange(n)
            pages = tables[b, kh, slots // page_size].long()
            keys = k_pages[pages, slots % page_size].double()
            values = v_pages[pages, slots % page_size].double()
            probs = torch.softmax(keys @ q[b, h].double() * scale, dim=0)
            out[b, h] = probs @ values
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,page_size", [(4, 4, 16), (8, 2, 5)])
def test_reference_decode_matches_dense_float64(dtype, q_heads, kv_heads, page_size):
    gen = torch.Generator().manual_seed(q_heads * 100 + page_size)
    lengths = torch.randint(1, 301, (3, kv_heads), generator=gen)
    lengths[0, 0], lengths[-1, -1] = 1, 300
    k_pages, v_pages, tables, lengths = random_paged_kv(lengths, 32, page_size, dtype, gen)
    q = torch.randn(3, q_heads, 32, generator=gen).to(dtype)
    out = paged_decode_reference(q, k_pages, v_pages, tables, lengths, scale=32**-0.5)
    expected = dense_attention_float64(q, k_pages, v_pages, tables, lengths, 32**-0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])


TRITON_DECODE_CASES = [  # q_heads, kv_heads, head_dim, page_size, dtype, num_splits, max_len
    (2, 2, 16, 4, torch.float32, 1, 70),
    (2, 2, 16, 4, torch.bfloat16, 3, 70),
    (6, 2, 24, 8, torch.float16, 2, 50),  # group of 3 and head_dim 24: padded blocks
    (8, 2, 16, 16, torch.float32, 4, 90),
    (4, 1, 16, 4, torch.bfloat16, None, 40),
]


@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim,page_size,dtype,num_splits,max_len", TRITON_DECODE_CASES
)
def test_triton_decode_matches_reference(
    q_heads, kv_heads, head_dim, page_size, dtype, num_splits, max_len
):
    gen = torch.Generator().manual_seed(head_dim + page_size + q_heads)
    lengths = torch.randint(1, max_len + 1, (2, kv_heads), generator=gen)
    lengths[0, -1] = max_len
    k_pages, v_pages, tables, lengths = random_paged_kv(lengths, head_dim, page_size, dtype, gen)
    q = torch.randn(2, q_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    expected = paged_decode_reference(q, k_pages, v_pages, tables, lengths, scale)
    out = run_paged_decode(q, k_pages, v_pages, tables, lengths, scale,
                           use_triton=True, num_splits=num_splits)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("num_splits", [1, 2])
def test_empty_head_gives_zeros(num_splits):
    gen = torch.Generator().manual_seed(0)
    paged = random_paged_kv(torch.tensor([[0, 5]]), 8, 4, torch.float32, gen)
    q = torch.randn(1, 4, 8, generator=gen)
    expected = paged_decode_reference(q, *paged, scale=1.0)
    out = run_paged_decode(q, *paged, 1.0, use_triton=True, num_splits=num_splits)
    assert expected[0, :2].eq(0).all() and expected[0, 2:].isfinite().all()
    torch.testing.assert_close(out, expected)


def drive_identical_caches(window, dtype, steps=10, *, device="cpu", kv_heads=2, head_dim=8,
                           page_size=4, stale_rings=False, merge=0.6):
    """The same random DMC writes (varying batches of sequences) into a reference and a Triton
    cache on ``device``, each token merging with probability ``merge``; ``stale_rings``: every
    ring row starts as NaN (a row past the open slot's tokens must never reach a page)."""
    gen = torch.Generator().manual_seed(7)
    caches = [PagedKVCache(2, kv_heads, head_dim, 40 * kv_heads, page_size=page_size,
                           max_seqs=3, window=window, dtype=dtype, device=device)
              for _ in range(2)]
    for cache in caches if stale_rings else ():
        for ring in (cache.open_k, cache.open_v, cache.open_omega):
            ring.fill_(float("nan"))
    seqs = [[c.add_sequence() for _ in range(3)] for c in caches][0]
    position = [0, 20, 55]
    for step in range(steps):
        batch = seqs if step % 3 else [seqs[2], seqs[0]]
        n = len(batch)
        k, v = torch.randn(2, n, kv_heads, head_dim, generator=gen).to(device, dtype)
        omega = (torch.rand(n, kv_heads, generator=gen) + 0.1).to(device)
        positions = torch.tensor([position[s] for s in batch])
        for layer in range(2):
            alpha = (torch.rand(n, kv_heads, generator=gen) < merge).float().to(device)
            for cache, use_triton in zip(caches, (False, True)):
                cache.write(layer, batch, positions, k, v, omega, alpha, use_triton=use_triton)
        for s in batch:
            position[s] += 1
    return caches


def assert_same_caches(reference, triton_cache, dtype, stale_rings=False):
    """Pages to the dtype's rounding, merge state and metadata to float32 rounding (with
    ``stale_rings`` the NaN ring rows no token has filled in both)."""
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-5, rtol=1 / 64)
    torch.testing.assert_close(triton_cache.k_pages.float(), reference.k_pages.float(), **tol)
    torch.testing.assert_close(triton_cache.v_pages.float(), reference.v_pages.float(), **tol)
    for name in ("open_k", "open_v", "open_omega", "open_count", "lengths", "block_tables"):
        got, want = getattr(triton_cache, name), getattr(reference, name)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6,
                                   equal_nan=stale_rings and name.startswith("open_"))


@pytest.mark.parametrize(
    "window,dtype,merge", [(3, torch.float32, 0.6), (None, torch.float32, 0.6),
                           (3, torch.bfloat16, 0.6), (5, torch.float32, 0.9)]
)
def test_triton_write_matches_reference(window, dtype, merge):
    """The last case merges 9 tokens in 10: open slots outgrow the ring, every row read."""
    assert_same_caches(*drive_identical_caches(window, dtype, steps=16, merge=merge), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stale_ring_rows_never_reach_a_page(dtype):
    """The Triton write reads only the ring rows of the open slot's earlier tokens: NaN in the
    others leaves the pages and the slot's rows as the reference writes them."""
    reference, triton_cache = drive_identical_caches(5, dtype, steps=12, stale_rings=True)
    assert_same_caches(reference, triton_cache, dtype, stale_rings=True)
    assert triton_cache.open_k.isnan().any()  # rows no token reached are still stale
    lengths = triton_cache.allocator.lengths
    assert int(lengths.sum()) > 0
    for seq, layer, head in (lengths > 0).nonzero().tolist():
        length = int(lengths[seq, layer, head])
        table = triton_cache.block_tables[seq, layer, head]
        written = torch.stack([triton_cache.k_pages[table[n // 4], n % 4]
                               for n in range(length)])
        assert written.isfinite().all()


def test_dispatch(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_use_triton(cpu) is False
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        resolve_use_triton(cpu, True)


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "pytorch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,page_size,head_dim,seed", [
    (4, 4, 16, 16, 0), (8, 2, 16, 64, 1), (6, 3, 5, 128, 2), (4, 1, 7, 24, 3),
])
def test_batched_decode_matches_reference(native, dtype, q_heads, kv_heads, page_size, head_dim,
                                          seed):
    """Random page layouts (NaN past every head's length), lengths 1..2000 with empty heads, GQA,
    head_dim 64 / 128 (the compiled kernel's specialised code) and others: the batched CPU path,
    compiled or PyTorch, equals the oracle to float32 rounding, and its log-sum-exp equals a
    float64 one."""
    gen = torch.Generator().manual_seed(seed)
    batch = 5
    lengths = torch.randint(1, 2001, (batch, kv_heads), generator=gen)
    lengths[lengths % 5 == 0] //= 40  # short heads next to long ones: several buckets
    lengths[0, 0], lengths[-1, -1], lengths[1, 0] = 0, 2000, 1
    k_pages, v_pages, tables, lengths = random_paged_kv(lengths, head_dim, page_size, dtype, gen)
    q = torch.randn(batch, q_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    expected = paged_decode_reference(q, k_pages, v_pages, tables, lengths, scale)
    out, lse = paged_decode_batched(q, k_pages, v_pages, tables, lengths, scale, native=native,
                                    return_lse=True)
    assert out.dtype == dtype and out[0, :q_heads // kv_heads].eq(0).all()
    tol = TOLERANCE[torch.float32] if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, expected, **tol)
    torch.testing.assert_close(lse, lse_float64(q, k_pages, v_pages, tables, lengths, scale),
                               atol=1e-4, rtol=1e-5)
    if native:
        dispatched = run_paged_decode(q, k_pages, v_pages, tables, lengths, scale,
                                      use_triton=False, host_lengths=lengths)
        torch.testing.assert_close(dispatched, out, atol=0, rtol=0)


def lse_float64(q, k_pages, v_pages, tables, lengths, scale):
    """Log-sum-exp of each query's scaled scores over its head's slots, in float64 (-inf for an
    empty head), from the slots gathered one by one."""
    batch, q_heads, _ = q.shape
    group, page_size = q_heads // tables.shape[1], k_pages.shape[1]
    lse = torch.full((batch, q_heads), float("-inf"), dtype=torch.float64)
    for b, h in itertools.product(range(batch), range(q_heads)):
        slots = torch.arange(int(lengths[b, h // group]))
        if slots.numel():
            keys = k_pages[tables[b, h // group, slots // page_size].long(), slots % page_size]
            lse[b, h] = torch.logsumexp(keys.double() @ q[b, h].double() * scale, dim=0)
    return lse.float()


def test_compiled_kernel_builds_and_runs_where_it_applies(monkeypatch):
    """With a C compiler the kernels build (here a failing build fails the test, it is not
    skipped) and take float32 / bfloat16 CPU pools; float16 pools, odd head sizes and
    ``DMC_NATIVE_KERNELS=0`` fall back to the PyTorch path (``None``)."""
    if native_kernels._compiler() is None:
        pytest.skip("no C compiler: the PyTorch path runs")
    assert native_kernels.load_library() is not None
    gen = torch.Generator().manual_seed(0)
    for head_dim, dtype, runs in [(64, torch.bfloat16, True), (64, torch.float16, False),
                                  (12, torch.float32, False)]:
        k_pages, v_pages, tables, lengths = random_paged_kv(torch.tensor([[5, 9]]), head_dim, 4,
                                                            dtype, gen)
        q = torch.randn(1, 2, head_dim, generator=gen)
        result = native_kernels.native_paged_decode(q, k_pages, v_pages, tables, lengths, 1.0)
        assert (result is not None) == runs
    monkeypatch.setenv("DMC_NATIVE_KERNELS", "0")
    monkeypatch.setattr(native_kernels, "_LIBRARY", [])
    assert native_kernels.load_library() is None


def test_batched_decode_all_heads_empty():
    gen = torch.Generator().manual_seed(0)
    paged = random_paged_kv(torch.tensor([[0, 0]]), 8, 4, torch.float32, gen)
    for native in (True, False):
        out = paged_decode_batched(torch.randn(1, 4, 8, generator=gen), *paged, scale=1.0,
                                   native=native)
        assert out.eq(0).all()


def test_length_buckets_bound_padding():
    gen = torch.Generator().manual_seed(0)
    pages = torch.randint(0, 300, (400,), generator=gen)
    buckets = length_buckets(pages, growth=1.25, slack=4)
    rows = torch.cat([r for r, _ in buckets])
    assert sorted(rows.tolist()) == (pages > 0).nonzero()[:, 0].tolist()
    assert len(buckets) <= 1 + math.log(304 / 5) / math.log(1.25)
    for picked, width in buckets:
        assert width == int(pages[picked].max())
        assert (width + 4) / (int(pages[picked].min()) + 4) < 1.25
    assert len(length_buckets(torch.full((64,), 17))) == 1  # vanilla: one bucket


def test_a_failing_build_warns_and_falls_back(monkeypatch, tmp_path):
    """A compiler that fails: a warning and the PyTorch paths; ``DMC_NATIVE_KERNELS=require``
    turns it into an error."""
    monkeypatch.setattr(native_kernels, "_LIBRARY", [])
    monkeypatch.setenv("CC", "false")  # exits 1 whatever it is given
    monkeypatch.setenv("DMC_KERNEL_CACHE", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="PyTorch paths run instead"):
        assert native_kernels.load_library() is None
    monkeypatch.setattr(native_kernels, "_LIBRARY", [])
    monkeypatch.setenv("DMC_NATIVE_KERNELS", "require")
    with pytest.raises(RuntimeError, match="failed"):
        native_kernels.load_library()


def test_a_new_build_prunes_builds_unused_for_a_month(monkeypatch, tmp_path):
    """Building into a cache folder deletes the builds not loaded for
    ``PRUNE_AFTER_DAYS`` and keeps recent ones (another CPU's, sharing the folder); loading a
    build marks it used."""
    if native_kernels._compiler() is None:
        pytest.skip("no C compiler: nothing is built")
    monkeypatch.setenv("DMC_KERNEL_CACHE", str(tmp_path))
    stale, recent = tmp_path / "dmc_kernels-stale.so", tmp_path / "dmc_kernels-recent.so"
    for path in (stale, recent):
        path.write_bytes(b"")
    month_ago = time.time() - (native_kernels.PRUNE_AFTER_DAYS + 1) * 86400
    os.utime(stale, (month_ago, month_ago))
    built = native_kernels._build(native_kernels._compiler())
    assert built.exists() and recent.exists() and not stale.exists()
    os.utime(built, (month_ago, month_ago))
    assert native_kernels._build(native_kernels._compiler()) == built
    assert built.stat().st_mtime > time.time() - 3600


@pytest.mark.parametrize("window,dtype", [(3, torch.float32), (12, torch.bfloat16),
                                          (None, torch.float32)])
@pytest.mark.parametrize("native", [True, False], ids=["compiled", "pytorch"])
def test_inplace_write_matches_reference(window, dtype, native):
    """Random rings (some heads past a full window, some appending), a subset of sequence slots
    in shuffled order: every tensor the write touches equals the reference's, for the compiled
    kernel and the PyTorch path."""
    gen = torch.Generator().manual_seed(3)
    seqs, layers, heads, dim, rows, pages, size = 5, 2, 3, 8, window or 1, 64, 4
    state = {
        "k_pages": torch.randn(pages, size, dim, generator=gen).to(dtype),
        "v_pages": torch.randn(pages, size, dim, generator=gen).to(dtype),
        "block_tables": torch.randperm(pages, generator=gen)[:seqs * layers * heads * 2]
        .reshape(seqs, layers, heads, 2).int(),
        "open_k": torch.randn(seqs, layers, heads, rows, dim, generator=gen),
        "open_v": torch.randn(seqs, layers, heads, rows, dim, generator=gen),
        "open_omega": torch.rand(seqs, layers, heads, rows, generator=gen) + 0.1,
        "open_count": torch.randint(1, 2 * rows + 2, (seqs, layers, heads), generator=gen).int(),
    }
    batch = torch.tensor([3, 0, 4])
    step = dict(seq_slots=batch, slots=torch.randint(0, 2 * size, (3, heads), generator=gen),
                append=torch.rand(3, heads, generator=gen) < 0.4,
                k=torch.randn(3, heads, dim, generator=gen).to(dtype),
                v=torch.randn(3, heads, dim, generator=gen).to(dtype),
                omega=torch.rand(3, heads, generator=gen) + 0.1, positions=torch.tensor([7, 2, 40]))
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2).float() / dim)
    results = []
    for write in (dmc_write_reference, functools.partial(dmc_write_inplace, native=native)):
        tensors = {name: t.clone() for name, t in state.items()}
        write(*tensors.values(), inv_freq, window, 1, *step.values())
        results.append(tensors)
    if native and window is not None and native_kernels._compiler() is not None:
        copies = [t.clone() for t in state.values()]
        assert native_kernels.native_dmc_write(*copies, inv_freq, window, 1,
                                               *step.values())  # it applies: the kernel ran
    for name, want in results[0].items():
        torch.testing.assert_close(results[1][name], want, atol=1e-6, rtol=1e-6)
    assert not torch.equal(results[1]["open_k"], state["open_k"])



RING_WRITES = {
    "reference": dmc_write_reference,
    "compiled": functools.partial(dmc_write_inplace, native=True),
    "pytorch": functools.partial(dmc_write_inplace, native=False),
    "triton": functools.partial(run_dmc_write, use_triton=True),
}


@pytest.mark.parametrize("ring_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", sorted(RING_WRITES))
def test_a_ring_in_the_keys_dtype_writes_what_a_float32_ring_writes(path, ring_dtype):
    """A 16-bit model's keys and values (and so its rings) are exact in its dtype: three steps of
    random writes through a ring of that dtype leave the pages, omegas and counts equal bit for
    bit to a float32 ring's, and the ring equal to it in value."""
    if path == "compiled" and (ring_dtype == torch.float16
                               or native_kernels.load_library() is None):
        pytest.skip("the compiled kernel takes float32 and bfloat16 rings")
    gen = torch.Generator().manual_seed(11)
    seqs, layers, heads, dim, window, pages, size = 4, 2, 3, 16, 4, 128, 4

    def model_dtype(*shape):
        return torch.randn(*shape, generator=gen).to(ring_dtype)

    ring = {"open_k": model_dtype(seqs, layers, heads, window, dim),
            "open_v": model_dtype(seqs, layers, heads, window, dim)}
    state = {
        "k_pages": torch.zeros(pages, size, dim, dtype=ring_dtype),
        "v_pages": torch.zeros(pages, size, dim, dtype=ring_dtype),
        "block_tables": torch.randperm(pages, generator=gen)[:seqs * layers * heads * 4]
        .reshape(seqs, layers, heads, 4).int(),
        "open_omega": torch.rand(seqs, layers, heads, window, generator=gen) + 0.1,
        "open_count": torch.randint(1, 2 * window, (seqs, layers, heads), generator=gen).int(),
    }
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2).float() / dim)
    caches = [{**state, **{name: t.to(dtype) for name, t in ring.items()}}
              for dtype in (torch.float32, ring_dtype)]
    caches = [{name: cache[name].clone() for name in ("k_pages", "v_pages", "block_tables",
                                                      "open_k", "open_v", "open_omega",
                                                      "open_count")} for cache in caches]
    for step in range(3):
        batch = torch.tensor([2, 0, 3])
        args = (batch, torch.full((3, heads), step + 4), torch.rand(3, heads, generator=gen) < 0.3,
                model_dtype(3, heads, dim), model_dtype(3, heads, dim),
                torch.rand(3, heads, generator=gen) + 0.1, torch.tensor([9, 4, 30]) + step)
        for cache in caches:
            RING_WRITES[path](*cache.values(), inv_freq, window, step % layers, *args)
    wide, narrow = caches
    assert narrow["open_k"].dtype == ring_dtype
    for name, tensor in wide.items():
        assert torch.equal(narrow[name].to(tensor.dtype), tensor), name
    assert not torch.equal(wide["k_pages"], state["k_pages"])


def unreserved_page_calls(entry: int):
    """One call of each compiled kernel on a small state whose block table has ``entry`` (-1:
    never reserved, or a page past the pool) where sequence slot 3's KV head 1 of layer 1 needs
    a page; returns ``{kernel: (call, pools)}``."""
    gen = torch.Generator().manual_seed(5)
    seqs, layers, heads, dim, pages, size, window, ring = 5, 2, 3, 8, 64, 4, 3, 4

    def state():
        tables = torch.randperm(pages, generator=gen)[:seqs * layers * heads * 2]
        tables = tables.reshape(seqs, layers, heads, 2).int()
        tables[3, 1, 1, 0] = entry
        pools = [torch.randn(pages, size, dim, generator=gen) for _ in range(2)]
        return pools, tables

    seq_slots, positions = torch.tensor([3, 0]), torch.tensor([6, 5])
    keys, values = (torch.randn(2, heads, dim, generator=gen) for _ in range(2))
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2).float() / dim)
    merge_state = [torch.randn(seqs, layers, heads, window, dim, generator=gen),
                   torch.randn(seqs, layers, heads, window, dim, generator=gen),
                   torch.rand(seqs, layers, heads, window, generator=gen) + 0.1,
                   torch.ones(seqs, layers, heads, dtype=torch.int32)]
    lengths = torch.ones(seqs, layers, heads, dtype=torch.int32)  # slot 0 / 1: page column 0
    calls = {}
    pools, tables = state()
    calls["DMC write"] = (lambda: native_kernels.native_dmc_write(
        *pools, tables, *merge_state, inv_freq, window, 1, seq_slots,
        torch.zeros(2, heads, dtype=torch.long), torch.ones(2, heads, dtype=torch.bool), keys,
        values, torch.ones(2, heads), positions), pools)
    pools_dms, tables_dms = state()
    rings = [torch.randn(seqs, layers, heads, ring, dim, generator=gen) for _ in range(2)]
    calls["DMS write"] = (lambda: native_kernels.native_dms_write(
        *pools_dms, tables_dms, lengths.clone(), *rings,
        torch.zeros(seqs, layers, heads, ring, dtype=torch.bool), 1, seq_slots, positions, keys,
        values, torch.zeros(2, heads, dtype=torch.bool)), pools_dms)
    pools_delay, tables_delay = state()
    cache = type("DelayedState", (), dict(
        k_pages=pools_delay[0], v_pages=pools_delay[1], block_tables=tables_delay,
        open_k=merge_state[0].clone(), open_v=merge_state[1].clone(),
        open_omega=merge_state[2].clone(), open_count=merge_state[3].clone(),
        ring_k=rings[0].clone(), ring_v=rings[1].clone(),
        ring_alpha=torch.zeros(seqs, layers, heads, ring), ring_omega=torch.ones(seqs, layers,
                                                                                heads, ring),
        lengths=lengths.clone(), window=window, head_dim=dim, inv_freq=inv_freq, ring_size=ring))
    calls["delayed-merging write"] = (lambda: native_kernels.native_delayed_write(
        cache, 1, seq_slots, positions, keys, values, torch.zeros(2, heads),
        torch.ones(2, heads)), pools_delay)
    pools_read, tables_read = state()
    rows = tables_read[seq_slots, 1]  # [batch, heads, 2]: the layer's rows of the two sequences
    calls["paged decode attention"] = (lambda: native_kernels.native_paged_decode(
        torch.randn(2, heads, dim, generator=gen), *pools_read, rows,
        torch.full((2, heads), 3, dtype=torch.int32), 1.0), pools_read)
    return calls


@pytest.mark.parametrize("entry", [-1, 64], ids=["unreserved", "past-the-pool"])
@pytest.mark.parametrize("kernel", ["DMC write", "DMS write", "delayed-merging write",
                                    "paged decode attention"])
def test_compiled_kernels_refuse_a_page_outside_the_pool(kernel, entry):
    """A block-table entry that is not a page of the pool (a reservation bug) makes the compiled
    kernel raise, naming the row, instead of reading or writing memory outside the pool; the
    other rows' pages are written as before (the pools change only there)."""
    if native_kernels.load_library() is None:
        pytest.skip("no compiled kernels: the PyTorch paths run")
    call, pools = unreserved_page_calls(entry)[kernel]
    before = [p.clone() for p in pools]
    with pytest.raises(native_kernels.UnreservedPageError,
                       match=f"{kernel}: 1 \\(sequence, KV head\\) row.*"
                             + ("batch row 0, KV head 1" if kernel.startswith("paged")
                                else "sequence slot 3, layer 1, KV head 1")):
        call()
    if kernel != "paged decode attention":
        assert not all(torch.equal(a, b) for a, b in zip(pools, before))


def test_compiled_kernels_accept_every_page_of_the_pool():
    """The same calls with the entry a page of the pool run through (the check refuses only
    entries outside it)."""
    if native_kernels.load_library() is None:
        pytest.skip("no compiled kernels: the PyTorch paths run")
    for kernel, (call, _) in unreserved_page_calls(63).items():
        assert call() not in (None, False), kernel


@pytest.mark.parametrize("entry", [-1, 64], ids=["unreserved", "past-the-pool"])
def test_pytorch_paths_refuse_a_page_outside_the_pool(entry):
    """The CPU's PyTorch write and decode (what runs without a C compiler) raise before reading
    or writing through a block-table entry that is no page of the pool, naming it (sequence
    slot 3's KV head 1 of layer 1); nothing changes; an entry past a head's length is not
    looked at."""
    gen = torch.Generator().manual_seed(6)
    seqs, layers, heads, dim, pages, size, window = 5, 2, 3, 8, 64, 4, 3
    tables = torch.randperm(pages, generator=gen)[:seqs * layers * heads * 2]
    tables = tables.reshape(seqs, layers, heads, 2).int()
    tables[3, 1, 1, 0] = entry
    state = [torch.randn(pages, size, dim, generator=gen) for _ in range(2)] + [
        torch.randn(seqs, layers, heads, window, dim, generator=gen),
        torch.randn(seqs, layers, heads, window, dim, generator=gen),
        torch.rand(seqs, layers, heads, window, generator=gen) + 0.1,
        torch.ones(seqs, layers, heads, dtype=torch.int32)]
    before = [t.clone() for t in state]
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2).float() / dim)
    keys, values = (torch.randn(2, heads, dim, generator=gen) for _ in range(2))
    with pytest.raises(native_kernels.UnreservedPageError,
                       match="DMC write \\(PyTorch path\\): 1 block-table entry .*sequence "
                             "slot 3, layer 1, KV head 1"):
        dmc_write_inplace(*state[:2], tables, *state[2:], inv_freq, window, 1,
                          torch.tensor([3, 0]), torch.zeros(2, heads, dtype=torch.long),
                          torch.ones(2, heads, dtype=torch.bool), keys, values,
                          torch.ones(2, heads), torch.tensor([6, 5]), native=False)
    assert all(torch.equal(a, b) for a, b in zip(state, before))
    rows = tables[[3, 0], 1]  # [2, heads, 2]: the layer's rows of the two sequences
    lengths = torch.full((2, heads), 3, dtype=torch.int32)
    q = torch.randn(2, heads, dim, generator=gen)
    with pytest.raises(native_kernels.UnreservedPageError,
                       match="paged decode attention \\(PyTorch path\\).*row 1, page column 0"):
        paged_decode_batched(q, *state[:2], rows, lengths, 1.0, native=False)
    lengths[0, 1] = 0  # that head holds no slot: its entry is not read
    assert paged_decode_batched(q, *state[:2], rows, lengths, 1.0, native=False).isfinite().all()


def test_triton_kernels_compile_for_hopper():
    """The paged decode (split, its ring mode and reduce), the DMC write (windowed with a float32
    and a bf16 ring, exact; each also deciding from the key, and at 1 and 8 warps), the decode
    RoPE (plain, DMC, DMS), the vanilla write (MHA, GQA), the DMS write (also reading the
    queries), the Gumbel-max draw and the write of delayed merging (windowed and exact, each
    reading the queries and given the decisions) pass Triton's compiler for
    sm_90 down to a cubin, as on an H100 (the interpreter never compiles); the decode and the
    write also under every setting a shipped tuning file holds."""
    from dmc.inference.kernels.tuning import shipped_tunings

    shipped = shipped_tunings().values()
    launches = len({row.launch for tuning in shipped for row in tuning.decode})
    write_warps = len({1, 8} | {tuning.write_warps for tuning in shipped})
    done = compile_in_subprocess("paged_decode", "dmc_write", "decode_rope", "rope_append",
                                 "dms_write", "gumbel", "delayed_write")
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = done.stdout.splitlines()
    assert sum("_decode_split_kernel: compiled" in line for line in compiled) == 4 + launches
    assert sum("_decode_reduce_kernel: compiled" in line for line in compiled) == 2 + launches
    assert sum("_dmc_write_kernel: compiled" in line for line in compiled) == 6 + write_warps
    assert sum("_decode_rope_kernel: compiled" in line for line in compiled) == 4
    assert sum("_rope_append_kernel: compiled" in line for line in compiled) == 2
    assert sum("_dms_write_kernel: compiled" in line for line in compiled) == 2
    assert sum("_gumbel_argmax_kernel: compiled" in line for line in compiled) == 1
    assert sum("_delayed_write_kernel: compiled" in line for line in compiled) == 4


def _write_state(batch, kv_heads, dim, window, dtype, seed, device="cpu"):
    """One layer's cache for :func:`~dmc.inference.kernels.dmc_write.dmc_write`'s deferred
    write (keyword arguments) and the heads' lengths ``[batch, 1, kv_heads]``: shuffled pages
    with room for a few steps, open slots of 1-5 tokens."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_head, page_size = 5, 4
    num_pages = batch * kv_heads * pages_per_head
    ring = (batch, 1, kv_heads, window or 1)
    state = dict(
        k_pages=torch.zeros(num_pages, page_size, dim, dtype=dtype),
        v_pages=torch.zeros(num_pages, page_size, dim, dtype=dtype),
        block_tables=torch.randperm(num_pages, generator=gen).view(
            batch, 1, kv_heads, pages_per_head).int(),
        open_k=torch.randn(*ring, dim, generator=gen),
        open_v=torch.randn(*ring, dim, generator=gen),
        open_omega=0.5 + torch.rand(ring, generator=gen),
        open_count=torch.randint(1, 6, ring[:3], generator=gen, dtype=torch.int32),
        inv_freq=rope_inv_freq(dim), window=window, layer=0,
        seq_slots=torch.arange(batch, dtype=torch.int32), slots=None, append=None)
    lengths = torch.randint(1, 9, ring[:3], generator=gen, dtype=torch.int32)
    state = {name: value.to(device) if isinstance(value, torch.Tensor) else value
             for name, value in state.items()}
    return state, lengths.to(device)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's sigmoid
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,q_heads", [(3, 2), (None, 8), (5, 6)])
def test_the_write_reading_the_queries_equals_decode_rope_then_write(dtype, window, q_heads,
                                                                     device):
    """The deferred DMC write with ``query=`` (one launch: the importance read from the
    queries, the queries rotated) against the decode RoPE kernel and then the write: the same
    rotated queries, pages, merge state and lengths, bit for bit, over four steps (MHA and
    GQA, windowed and exact merges; the interpreter on the CPU, compiled on CUDA)."""
    from dmc.inference.kernels import DecisionChannel, run_decode_rope
    from dmc.inference.kernels.dmc_write import dmc_write
    from dmc.ops.algorithm1 import KeyDecision
    from dmc.ops.rope import rope_tables

    batch, kv_heads, dim, c, offset = 3, 2, 16, 5.0, 2.0 ** -7
    states = [_write_state(batch, kv_heads, dim, window, dtype, 4, device) for _ in range(2)]
    channel = DecisionChannel(kv_heads, c, offset)
    gen = torch.Generator().manual_seed(9)
    for step in range(4):
        k = torch.randn(batch, kv_heads, dim, generator=gen)
        k[..., -1] = torch.where(torch.rand(batch, kv_heads, generator=gen) < 0.6, c + 1, c - 1)
        v = torch.randn(batch, kv_heads, dim, generator=gen)
        q = torch.randn(batch, q_heads, dim, generator=gen)
        q[..., -1] *= 8.0
        k, v, q = k.to(device, dtype), v.to(device, dtype), q.to(device, dtype)
        positions = torch.randint(0, 4096, (batch,), generator=gen).to(device)
        cos, sin = rope_tables(positions[:, None], rope_inv_freq(dim).to(device))
        (state, lengths), (fused, fused_lengths) = states
        q_rot, omega = run_decode_rope(q, cos, sin, channel)
        dmc_write(**state, k=k, v=v, omega=omega, positions=positions,
                  decide=(lengths, KeyDecision(c)))
        q_fused = dmc_write(**fused, k=k, v=v, omega=None, positions=positions,
                            decide=(fused_lengths, KeyDecision(c)),
                            query=(q, cos, sin, channel))
        assert torch.equal(q_fused, q_rot), step
        assert torch.equal(fused_lengths, lengths) and int(lengths.sum()) > 0
        for name in ("k_pages", "v_pages", "open_k", "open_v", "open_omega", "open_count"):
            assert torch.equal(fused[name], state[name]), (step, name)
    with pytest.raises(ValueError, match="query= reads omega itself"):
        dmc_write(**fused, k=k, v=v, omega=omega, positions=positions,
                  decide=(fused_lengths, KeyDecision(c)), query=(q, cos, sin, channel))


def test_triton_decode_refuses_layouts_it_would_misread():
    """Pools of other strides or shapes than the kernel assumes are refused, not read wrong."""
    from dmc.inference.kernels.paged_decode import paged_decode

    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([[5, 9]])
    k_pages, v_pages, tables, lengths = random_paged_kv(lengths, 16, 4, torch.float32, gen)
    q = torch.randn(1, 4, 16, generator=gen)
    strided = torch.zeros(k_pages.shape[:2] + (32,))[..., ::2]
    cases = [((q, strided, v_pages, tables), "unit stride"),
             ((q, k_pages, v_pages, torch.zeros(1, 2, 2 * tables.shape[-1],
                                               dtype=torch.int32)[..., ::2]), "unit stride"),
             ((q[..., :8], k_pages, v_pages, tables), "must agree"),
             ((q[:, :3], k_pages, v_pages, tables), "not a multiple of 2 KV heads")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            paged_decode(*args, lengths, 0.25)


def test_triton_decode_counts_slots_past_the_block_tables_width():
    """A length past what a head's row of the block table can hold (a reservation bug) reads
    no other head's entries: those slots are skipped and counted as faults."""
    from dmc.inference.kernels.faults import fault_counter
    from dmc.inference.kernels.paged_decode import paged_decode

    gen = torch.Generator().manual_seed(1)
    k_pages, v_pages, tables, lengths = random_paged_kv(torch.tensor([[8, 8]]), 16, 4,
                                                        torch.float32, gen)
    tables = tables[..., :2].contiguous()  # two pages of 4 slots per head, both filled
    q = torch.randn(1, 2, 16, generator=gen)
    expected = paged_decode(q, k_pages, v_pages, tables, lengths, 0.25)
    faults = fault_counter("cpu")
    longer = lengths.clone()
    longer[0, 0] = 11
    out = paged_decode(q, k_pages, v_pages, tables, longer, 0.25, faults=faults)
    assert int(faults[0]) == 3
    torch.testing.assert_close(out, expected)


def test_compiled_decode_weights_are_exp_of_the_score_gaps():
    """The compiled kernel's softmax weights against float64: two slots per head scoring 0 and
    a gap in [-20, 0], one-hot values, so out[1] / out[0] = exp(gap). Measured: 1.1e-7 at
    worst (float32 rounding of the two outputs); 1e-6 bounds it."""
    if native_kernels.load_library() is None:
        pytest.skip("no compiled kernels: the PyTorch paths run")
    heads, dim, size = 2001, 16, 4  # a gap every 0.01: every reduced argument |r| <= ln2 / 2
    gaps = torch.linspace(-20.0, 0.0, heads, dtype=torch.float64).float()
    k_pages, v_pages = torch.zeros(heads, size, dim), torch.zeros(heads, size, dim)
    k_pages[:, 1, 0] = gaps  # the query is e_0: slot 0 scores 0, slot 1 scores the gap
    v_pages[:, 0, 0], v_pages[:, 1, 1] = 1.0, 1.0
    q = torch.zeros(heads, 1, dim)
    q[:, 0, 0] = 1.0
    tables = torch.arange(heads, dtype=torch.int32).view(heads, 1, 1)
    lengths = torch.full((heads, 1), 2, dtype=torch.int32)
    out, _ = native_kernels.native_paged_decode(q, k_pages, v_pages, tables, lengths, 1.0)
    ratio = out[:, 0, 1].double() / out[:, 0, 0].double()
    torch.testing.assert_close(ratio, gaps.double().exp(), rtol=1e-6, atol=0)
    torch.testing.assert_close(out[:, 0, 0].double(), 1 / (1 + gaps.double().exp()),
                               rtol=1e-6, atol=0)


def test_compiled_write_rounds_bfloat16_ties_to_even():
    """A bfloat16 write of float32 values halfway between two bfloat16 values (and some that
    are not) stores, bit for bit, what torch's .to(bfloat16) and the reference store: ties go
    to the even mantissa (1 + 2^-8 to 1, 1 + 3 * 2^-8 up to 1 + 2^-6)."""
    if native_kernels.load_library() is None:
        pytest.skip("no compiled kernels: the PyTorch paths run")
    ties = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 0.5 + 2**-10, 3 + 2**-7, 2**-100 * (1 + 2**-8)]
    rest = [1 + 2**-8 + 2**-20, 1 + 2**-9]  # above a tie (rounds up), below one (down)
    row = torch.tensor(ties + rest, dtype=torch.float32)
    dim = row.numel()
    assert dim % 2 == 0 and torch.equal(row.double(), torch.tensor(ties + rest,
                                                                   dtype=torch.float64))

    def state():
        return [torch.zeros(4, 4, dim, dtype=torch.bfloat16),
                torch.zeros(4, 4, dim, dtype=torch.bfloat16),
                torch.arange(4, dtype=torch.int32).view(1, 1, 1, 4),
                torch.zeros(1, 1, 1, 3, dim), torch.zeros(1, 1, 1, 3, dim),
                torch.ones(1, 1, 1, 3), torch.zeros(1, 1, 1, dtype=torch.int32)]

    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2).float() / dim)
    step = (torch.tensor([0]), torch.tensor([[0]]), torch.tensor([[True]]), row.view(1, 1, dim),
            row.view(1, 1, dim), torch.ones(1, 1), torch.tensor([0]))  # position 0: no rotation
    reference, compiled = state(), state()
    dmc_write_reference(*reference, inv_freq, 3, 0, *step)
    assert native_kernels.native_dmc_write(*compiled, inv_freq, 3, 0, *step)
    want = row.to(torch.bfloat16).view(torch.int16)
    assert want[0] == torch.tensor(1.0, dtype=torch.bfloat16).view(torch.int16)  # down to even
    for pool in (0, 1):  # keys (RoPE at position 0 leaves them as they are) and values
        assert torch.equal(compiled[pool][0, 0].view(torch.int16), want)
        assert torch.equal(reference[pool][0, 0].view(torch.int16), want)


def test_compiled_write_refuses_a_slot_past_its_heads_block_table_row():
    """KV head 0's slot 17 is page column 4 of a 4-column row: the write raises naming the row
    instead of writing through head 1's first entry; only head 1's own slot is written."""
    if native_kernels.load_library() is None:
        pytest.skip("no compiled kernels: the PyTorch paths run")
    dim, heads, size = 8, 2, 4
    gen = torch.Generator().manual_seed(2)
    pools = [torch.randn(8, size, dim, generator=gen) for _ in range(2)]
    before = [p.clone() for p in pools]
    tables = torch.arange(8, dtype=torch.int32).view(1, 1, heads, 4)  # head 1: pages 4 .. 7
    rings = [torch.zeros(1, 1, heads, 3, dim), torch.zeros(1, 1, heads, 3, dim),
             torch.ones(1, 1, heads, 3), torch.zeros(1, 1, heads, dtype=torch.int32)]
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2).float() / dim)
    token = torch.stack([torch.full((dim,), 2.0), torch.full((dim,), 3.0)])[None]
    with pytest.raises(native_kernels.UnreservedPageError,
                       match="DMC write: 1 \\(sequence, KV head\\) row.*sequence slot 0, "
                             "layer 0, KV head 0"):
        native_kernels.native_dmc_write(*pools, tables, *rings, inv_freq, 3, 0,
                                        torch.tensor([0]), torch.tensor([[17, 0]]),
                                        torch.ones(1, heads, dtype=torch.bool), token, token,
                                        torch.ones(1, heads), torch.tensor([0]))
    for pool, old in zip(pools, before):
        assert torch.equal(pool[4, 0], torch.full((dim,), 3.0))  # head 1's token, unrotated
        pool[4, 0] = old[4, 0]
        assert torch.equal(pool, old)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 4, 5])
def test_triton_decode_splits_lengths_of_more_blocks_than_splits(num_splits):
    """block_n 16 and up to 90 slots: 6 blocks of slots over 1 .. 5 splits, each split a
    ceil(6 / splits)-block chunk; the output equals float64 attention."""
    from dmc.inference.kernels.paged_decode import paged_decode

    gen = torch.Generator().manual_seed(num_splits)
    lengths = torch.tensor([[90, 37], [5, 81]])
    k_pages, v_pages, tables, lengths = random_paged_kv(lengths, 16, 16, torch.float32, gen)
    q = torch.randn(2, 8, 16, generator=gen)
    out = paged_decode(q, k_pages, v_pages, tables, lengths, 0.25, num_splits=num_splits,
                       block_n=16, num_warps=4, num_stages=1)
    expected = dense_attention_float64(q, k_pages, v_pages, tables, lengths, 0.25)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[torch.float32])
