"""Triton paged decode and DMC write compiled for a CUDA GPU against the PyTorch reference on the
same device: fp16 / bf16, shuffled page layouts, GQA groups, long caches with split-K (gpu mark:
skipped without CUDA; the interpreter versions are in test_kernels.py)."""
import pytest
import torch

from dmc.inference.kernels import paged_decode_reference, run_paged_decode
from dmc.inference.kernels.tuning import shipped_tunings
from test_kernels import TOLERANCE, assert_same_caches, drive_identical_caches, random_paged_kv

pytestmark = pytest.mark.gpu

DECODE_CASES = [  # batch, q_heads, kv_heads, head_dim, page_size, max_len, num_splits
    (4, 8, 8, 64, 16, 300, 1),
    (4, 32, 8, 128, 16, 4096, None),  # GQA 4, long cache, split-K by the heuristic
    (3, 12, 4, 128, 16, 8192, 16),  # group of 3 (padded block), many splits
    (2, 8, 1, 64, 32, 2500, 4),  # one KV head (MQA), larger pages
    (5, 16, 2, 96, 8, 1000, 2),  # head_dim 96 (padded block)
]


@pytest.mark.parametrize("query_fp32", [False, True], ids=["query-in-cache-dtype", "query-fp32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,q_heads,kv_heads,head_dim,page_size,max_len,num_splits", DECODE_CASES
)
def test_triton_decode_on_cuda_matches_reference(dtype, batch, q_heads, kv_heads, head_dim,
                                                 page_size, max_len, num_splits, query_fp32):
    """``query_fp32``: the engine's float32 rotated queries over a bf16/fp16 cache (the kernel
    rounds them to the cache dtype for its tensor-core dots)."""
    gen = torch.Generator().manual_seed(batch * 1000 + max_len)
    lengths = torch.randint(1, max_len + 1, (batch, kv_heads), generator=gen)
    lengths[0, -1], lengths[-1, 0] = max_len, 1  # DMC-like ragged heads: longest and shortest
    paged = [t.cuda() for t in random_paged_kv(lengths, head_dim, page_size, dtype, gen)]
    q = torch.randn(batch, q_heads, head_dim, generator=gen).to(
        "cuda", torch.float32 if query_fp32 else dtype)
    scale = head_dim ** -0.5
    expected = paged_decode_reference(q, *paged, scale)
    out = run_paged_decode(q, *paged, scale, use_triton=True, num_splits=num_splits)
    assert out.dtype == q.dtype and out.is_cuda
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])


SHIPPED = shipped_tunings().values()  # dmc/inference/kernels/tunings/*.json


@pytest.mark.parametrize("block_n,num_warps,num_stages", sorted(
    {(32, 4, 2), (64, 4, 3), (64, 8, 4), (128, 8, 2)}
    | {row.launch for tuning in SHIPPED for row in tuning.decode}))
def test_other_tunings_of_the_decode_kernel_match_the_reference(block_n, num_warps, num_stages):
    """Tunings of benchmarks/paged_kernel.py's sweep and every one a shipped tuning file
    holds, on DMC-like short GQA heads and on long ones split: the result does not depend on
    the tuning (a default may change to any)."""
    from dmc.inference.kernels.paged_decode import paged_decode

    gen = torch.Generator().manual_seed(block_n + num_warps + num_stages)
    for batch, max_len, splits in ((24, 700, None), (2, 4096, 8)):
        lengths = torch.randint(1, max_len + 1, (batch, 4), generator=gen)
        paged = [t.cuda() for t in random_paged_kv(lengths, 128, 16, torch.bfloat16, gen)]
        q = torch.randn(batch, 16, 128, generator=gen).to("cuda", torch.bfloat16)
        out = paged_decode(q, *paged, 128 ** -0.5, num_splits=splits, block_n=block_n,
                           num_warps=num_warps, num_stages=num_stages)
        torch.testing.assert_close(out.float(), paged_decode_reference(
            q, *paged, 128 ** -0.5).float(), **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("window", [12, 3, None])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_write_on_cuda_matches_reference(window, dtype):
    caches = drive_identical_caches(window, dtype, steps=40, device="cuda", kv_heads=4,
                                    head_dim=128, page_size=16)
    assert all(c.k_pages.is_cuda for c in caches)
    assert_same_caches(*caches, dtype)


@pytest.mark.parametrize("warps", sorted({1, 2, 8} | {t.write_warps for t in SHIPPED} - {4}))
def test_the_deferred_dmc_write_at_other_warp_counts_writes_the_same(warps):
    """benchmarks/write_kernel.py's write (bf16, window 12, decided from the key) at ``warps``
    warps a program and at the default 4: the same pages, rings and lengths (the tuning only
    lays the work out; a sum may round in another order)."""
    from conftest import load_benchmark
    from dmc.inference.kernels.dmc_write import dmc_write

    bench = load_benchmark("write_kernel")
    args = bench.parse_args(["--batch", "9", "--kv-heads", "4", "--length", "40", "--cr", "2"])
    writes = [bench.deferred_write(args, torch.device("cuda")) for _ in range(2)]
    for (call_args, _), num_warps in zip(writes, (4, warps)):
        for _ in range(3):
            dmc_write(**call_args, num_warps=num_warps)
    (default, default_lengths), (other, other_lengths) = writes
    assert torch.equal(other_lengths, default_lengths)
    assert int((default_lengths > 40).sum()) > 0 and int((default_lengths == 40).sum()) > 0
    for name in ("k_pages", "v_pages", "open_k", "open_v"):
        torch.testing.assert_close(other[name].float(), default[name].float(),
                                   **TOLERANCE[torch.bfloat16])
    for name in ("open_omega", "open_count"):
        torch.testing.assert_close(other[name], default[name], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("q_heads,kv_heads", [(16, 16), (32, 8)])
def test_decode_rope_on_cuda_matches_the_pytorch_path(q_heads, kv_heads):
    """bf16 rows at head_dim 128: DMC's importance as hard_decisions gives it (the same
    roundings; a GPU sigmoid an ulp apart may move a rare value by one bf16 step), DMS's
    evictions as split_dms_channels', the rotated rows as rotate's to float32 rounding (fused
    multiply-adds)."""
    from dmc.inference.kernels import DecisionChannel, EvictionChannel, run_decode_rope
    from dmc.ops import split_dms_channels, zero_decision_channel, zero_dms_channel
    from dmc.ops.algorithm1 import hard_decisions
    from dmc.ops.rope import rotate
    from test_decode_rope import step_rows

    batch, c, offset = 64, 5.0, 2.0 ** -7
    x, _, cos, sin = (t.cuda() for t in step_rows(batch, q_heads, 128, torch.bfloat16,
                                                  channel_scale=40.0))
    out, omega = run_decode_rope(x, cos, sin, DecisionChannel(kv_heads, c, offset))
    decided = hard_decisions(x[:, :, None], x.new_zeros(batch, kv_heads, 1, 128), c, offset)
    torch.testing.assert_close(omega, decided.omega[..., 0], atol=0, rtol=2 ** -8)
    assert omega.eq(decided.omega[..., 0]).float().mean() > 0.99
    expected = zero_decision_channel(rotate(decided.query[:, :, 0].float(), cos, sin))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    plain, _ = run_decode_rope(x, cos, sin)
    torch.testing.assert_close(plain, rotate(x.float(), cos, sin), atol=1e-5, rtol=1e-5)
    x[..., -1] = x[..., -1] * 0.0025 + 0.05  # DMS logits q * 100 - 5 around 0
    out, evict = run_decode_rope(x, cos, sin, EvictionChannel(kv_heads, c, 100.0))
    channels = split_dms_channels(x[:, :, None], kv_heads, c, 100.0)
    assert torch.equal(evict, channels.alpha_logit[..., 0] > 0)
    rotated = rotate(channels.query.float(), cos[:, :, None], sin[:, :, None])
    torch.testing.assert_close(out, zero_dms_channel(rotated, kv_heads)[:, :, 0], atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("q_heads,kv_heads", [(16, 16), (32, 8)])
def test_rope_append_on_cuda_matches_the_pytorch_path(q_heads, kv_heads):
    """The vanilla write at head_dim 128 in bf16: the rotated queries as rotate's to float32
    rounding (fused multiply-adds), the stored keys within one bf16 step of rotate's rounded,
    the values exactly, nothing else of the pools touched."""
    from dmc.inference.kernels import run_rope_append
    from dmc.inference.kernels.faults import fault_counter
    from dmc.ops.rope import rotate
    from test_decode_rope import step_rows

    batch, layer, dim, pool = 64, 1, 128, 1024
    q, _, cos, sin = (t.cuda() for t in step_rows(batch, q_heads, dim, torch.bfloat16))
    k = step_rows(batch, kv_heads, dim, torch.bfloat16, seed=5)[0].cuda()
    v = torch.randn(batch, kv_heads, dim, device="cuda").to(torch.bfloat16)
    flat = torch.randperm(pool * 16, device="cuda")[:batch * 3 * kv_heads].view(batch, 3, -1)
    pages, offsets = (flat // 16).int(), (flat % 16).int()
    pools = [torch.randn(pool, 16, dim, device="cuda").to(torch.bfloat16) for _ in range(2)]
    want = [p.clone() for p in pools]
    slot = (pages[:, layer].long(), offsets[:, layer].long())
    want[0][slot] = rotate(k.float(), cos, sin).to(torch.bfloat16)
    want[1][slot] = v
    faults = fault_counter("cuda")
    got = run_rope_append(q, k, v, cos, sin, *pools, pages[:, layer], offsets[:, layer],
                          torch.arange(batch, device="cuda"), layer, 3, faults=faults)
    torch.testing.assert_close(got, rotate(q.float(), cos, sin), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pools[0].float(), want[0].float(), atol=1e-5, rtol=2 ** -7)
    assert torch.equal(pools[1], want[1]) and faults.tolist() == [0, -1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, None])
def test_dms_triton_decode_on_cuda_matches_the_gathering_path(dtype, num_splits):
    """DMS / delayed-merging decode: the Triton paged kernel with the window ring folded into its
    reduce step against the PyTorch path that gathers every head's pages, both on the GPU."""
    from dmc.inference.kernels.dms_decode import dms_decode_attention

    gen = torch.Generator().manual_seed(11)
    batch, q_heads, kv_heads, head_dim, ring, max_len = 6, 32, 8, 128, 33, 3000
    lengths = torch.randint(0, max_len + 1, (batch, kv_heads), generator=gen)
    lengths[0, 0], lengths[-1, -1] = 0, max_len  # a head of the ring alone; the longest
    paged = [t.cuda() for t in random_paged_kv(lengths, head_dim, 16, dtype, gen)]
    ring_k, ring_v = (torch.randn(batch, kv_heads, ring, head_dim, generator=gen).to("cuda", dtype)
                      for _ in range(2))
    count = torch.randint(1, ring + 1, (batch,), generator=gen).cuda()
    q = torch.randn(batch, q_heads, head_dim, generator=gen).to("cuda", torch.float32)
    args = (q, *paged[:3], paged[3], max_len, ring_k, ring_v, count, head_dim ** -0.5)
    want = dms_decode_attention(*args)
    got = dms_decode_attention(*args, use_triton=True, num_splits=num_splits)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
