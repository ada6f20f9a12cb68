import pytest
import torch

from dmc.ops.dense_attention import mask_layout, masked_bias_attention
from dmc.ops.mask import bias_from_masks, bias_masks, delayed_merge_masks


def _reference(query, key, value, log_keep, weighted, visible, scale):
    """Float64 softmax(q k^T * scale + bias) v with the whole bias built, through autograd."""
    group = query.shape[1] // key.shape[1]
    bias = bias_from_masks(log_keep.double(), weighted, visible).repeat_interleave(group, 1)
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = query.double() @ key.double().transpose(-1, -2) * scale + bias
    return scores.softmax(-1) @ value.double()


def _inputs(batch, q_heads, kv_heads, queries, keys, dim, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(batch, q_heads, queries, dim, generator=g, dtype=dtype),
               torch.randn(batch, kv_heads, keys, dim, generator=g, dtype=dtype),
               torch.randn(batch, kv_heads, keys, dim, generator=g, dtype=dtype),
               -3 * torch.rand(batch, kv_heads, keys, generator=g, dtype=dtype)]
    tensors[3][tensors[3] < -2.7] = float("-inf")  # alpha_{j+1} = 1: a merged-away slot
    return [t.requires_grad_() for t in tensors]


MASKS = {
    "dmc": lambda seq: bias_masks(seq),
    "dms window 5": lambda seq: bias_masks(seq, delay=5),
    "delayed merge 3": lambda seq: delayed_merge_masks(seq, 3),
    "last queries": lambda seq: bias_masks(seq, q_len=seq // 2 + 3),
}


@pytest.mark.parametrize("masks", MASKS, ids=list(MASKS))
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (6, 2)])
def test_equals_float64_reference_over_several_blocks(masks, q_heads, kv_heads):
    weighted, visible = MASKS[masks](300)  # 300 queries: three blocks of 128
    inputs = _inputs(2, q_heads, kv_heads, visible.shape[0], visible.shape[1], 16, seed=3)
    out = masked_bias_attention(*inputs, mask_layout(weighted, visible), 0.3)
    expected = _reference(*inputs, weighted, visible, 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(expected, inputs, grad)
    for name, a, b in zip(("query", "key", "value", "log_keep"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("masks", MASKS, ids=list(MASKS))
def test_gradcheck_with_small_blocks(masks):
    """Blocks of 6 queries, any gap of 2 keys or more skipped (delayed merging's keys in two
    ranges per block)."""
    weighted, visible = MASKS[masks](20)
    q, k, v, log_keep = _inputs(1, 4, 2, visible.shape[0], visible.shape[1], 4, seed=5)
    log_keep = log_keep.detach().clamp_min(-2.5).requires_grad_()  # finite for finite differences
    layout = mask_layout(weighted, visible, query_block=6, min_gap=2)
    assert len(layout.spans) >= 3  # several blocks
    two_ranges = sum(span[5] < span[6] for span in layout.spans)
    assert two_ranges >= 2 if masks.startswith("delayed") else two_ranges == 0
    assert torch.autograd.gradcheck(
        lambda *x: masked_bias_attention(*x, layout, 0.5), (q, k, v, log_keep))


def test_a_block_of_delayed_merging_skips_the_keys_none_of_its_queries_sees():
    """Delayed merging (delay 3) over 300 queries in blocks of 128: each block takes its
    accumulated keys up to ``end - 4`` and its raw keys ``[start - 3, end)`` of the second half,
    not the accumulated keys past its queries; DMC's causal blocks keep one range."""
    seq, delay = 300, 3
    layout = mask_layout(*delayed_merge_masks(seq, delay), query_block=128)
    for a, e, lo, mid, hi, lo2, hi2 in layout.spans:
        assert (lo, hi) == (0, e - delay - 1) and lo <= mid <= hi
        assert (lo2, hi2) == (seq + max(a - delay, 0), seq + e)
    causal = mask_layout(*bias_masks(seq), query_block=128)
    assert all(span[5] == span[6] and span[4] == span[1] for span in causal.spans)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_inputs_keep_their_dtype_and_match(dtype, tolerance):
    """float32 or bf16 queries, keys and values (computed in float32 either way): the output
    and every gradient in the inputs' dtypes, equal to float64 on the same rounded inputs."""
    weighted, visible = bias_masks(200, delay=0)
    inputs = _inputs(1, 4, 2, 200, 200, 8, seed=7, dtype=torch.float32)
    inputs[:3] = [t.detach().to(dtype).requires_grad_() for t in inputs[:3]]
    out = masked_bias_attention(*inputs, mask_layout(weighted, visible), 0.35)
    assert out.dtype == dtype
    expected = _reference(*inputs, weighted, visible, 0.35)
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(8)).to(dtype)
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(expected, inputs, grad.double())  # the same rounded gradient
    for tensor, a, b in zip(inputs, got, want):
        assert a.dtype == tensor.dtype
        torch.testing.assert_close(a.double(), b.double(), rtol=tolerance, atol=tolerance)


def test_output_is_laid_out_as_megatron_reads_it():
    """The output ``[batch, heads, queries, dim]`` is ``[queries, batch, heads, dim]`` in
    memory: megatron's output projection takes it as a view, so the backward keeps one copy."""
    weighted, visible = bias_masks(40)
    inputs = _inputs(2, 4, 2, 40, 40, 8, seed=2, dtype=torch.float32)
    out = masked_bias_attention(*inputs, mask_layout(weighted, visible, query_block=16), 0.25)
    assert out.shape == (2, 4, 40, 8)
    assert out.permute(2, 0, 1, 3).is_contiguous()


def test_autograd_keeps_no_seq_by_seq_tensor():
    """What the backward keeps besides the two boolean [queries, keys] masks (shared by every
    batch row, head and layer) grows with the sequence, not its square: 1024 queries of 2 heads
    of 16 channels keep less than a quarter of one [1, 2, 1024, 1024] float32 score tensor."""
    weighted, visible = bias_masks(1024)
    inputs = _inputs(1, 2, 2, 1024, 1024, 16, seed=9, dtype=torch.float32)
    kept = []

    def pack(tensor):
        if tensor.dtype != torch.bool:
            kept.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        masked_bias_attention(*inputs, mask_layout(weighted, visible), 0.25)
    assert sum(kept) < 2 * 1024 * 1024 * 4 / 4
