"""DMC with delayed merging (``dmc.merge_delay``): the dense attention over accumulated and raw
keys equals a float64 loop over Algorithm 1's cache, query by query."""
import math

import pytest
import torch

from dmc.ops import delayed_merge_attention, delayed_merge_bias, log_keep_next, partial_accumulate
from dmc.ops.reference import delayed_merge_attention_reference
from dmc.ops.rope import apply_rope, rope_inv_freq


@pytest.mark.parametrize("delay", [1, 3, 7])
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (4, 2)])
def test_hard_decisions_equal_algorithm1_query_by_query(delay, q_heads, kv_heads):
    g = torch.Generator().manual_seed(delay)
    seq, dim = 19, 8
    q = torch.randn(1, q_heads, seq, dim, generator=g, dtype=torch.float64)
    k = torch.randn(1, kv_heads, seq, dim, generator=g, dtype=torch.float64)
    v = torch.randn(1, kv_heads, seq, dim, generator=g, dtype=torch.float64)
    alpha = (torch.rand(1, kv_heads, seq, generator=g) > 0.4).double()
    alpha[..., 0] = 0
    omega = torch.rand(1, kv_heads, seq, generator=g, dtype=torch.float64) + 0.05
    inv_freq = rope_inv_freq(dim, 100.0).double()
    positions = torch.arange(seq)
    k_acc, v_acc = partial_accumulate(k, v, alpha, omega, None)
    rotate = lambda x: apply_rope(x, positions, inv_freq)  # noqa: E731
    out = delayed_merge_attention(rotate(q), rotate(k_acc), v_acc, rotate(k), v,
                                  log_keep_next(alpha), delay)
    group = q_heads // kv_heads
    for h in range(q_heads):
        want = delayed_merge_attention_reference(q[0, h], k[0, h // group], v[0, h // group],
                                                 alpha[0, h // group], omega[0, h // group],
                                                 delay, inv_freq)
        torch.testing.assert_close(out[0, h], want, rtol=1e-9, atol=1e-9)


def test_bias_entries():
    alpha = torch.tensor([[[0.0, 0.5, 0.25, 1.0, 0.0, 0.0]]], dtype=torch.float64)
    bias = delayed_merge_bias(log_keep_next(alpha), delay=2)[0, 0]
    merged, raw = bias[:, :6], bias[:, 6:]
    for i in range(6):
        for j in range(6):
            lag = i - j
            want_raw = 0.0 if 0 <= lag <= 2 else -math.inf
            keep = 1 - alpha[0, 0, j + 1].item() if j + 1 < 6 else 1.0
            want_merged = (-math.inf if lag <= 2 else 0.0 if lag == 3
                           else math.log(keep) if keep else -math.inf)
            assert raw[i, j].item() == want_raw
            assert merged[i, j].item() == pytest.approx(want_merged)


def test_soft_decisions_give_gradients_to_both_key_sets():
    g = torch.Generator().manual_seed(0)
    k_acc, v_acc, k, v = (torch.randn(1, 1, 12, 4, generator=g, requires_grad=True)
                          for _ in range(4))
    q = torch.randn(1, 1, 12, 4, generator=g)
    alpha = torch.rand(1, 1, 12, generator=g, requires_grad=True)
    out = delayed_merge_attention(q, k_acc, v_acc, k, v, log_keep_next(alpha), delay=2)
    out.sum().backward()
    for t in (k_acc, v_acc, k, v, alpha):
        assert t.grad is not None and t.grad.abs().sum() > 0


def test_delay_must_be_positive():
    with pytest.raises(ValueError, match="delay must be >= 1"):
        delayed_merge_bias(torch.zeros(1, 1, 4), delay=0)


@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (4, 2)])
def test_flex_equals_dense(q_heads, kv_heads):
    g = torch.Generator().manual_seed(5)
    seq, dim = 40, 16
    q = torch.randn(2, q_heads, seq, dim, generator=g)
    k_acc, v_acc, k, v = (torch.randn(2, kv_heads, seq, dim, generator=g) for _ in range(4))
    alpha = torch.rand(2, kv_heads, seq, generator=g)
    alpha[alpha > 0.7] = 1.0
    args = (q, k_acc, v_acc, k, v, log_keep_next(alpha), 5)
    torch.testing.assert_close(delayed_merge_attention(*args, backend="flex"),
                               delayed_merge_attention(*args, backend="dense"),
                               rtol=1e-5, atol=1e-5)
