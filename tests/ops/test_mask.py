import math

import pytest
import torch

from dmc.ops import dmc_attention, dmc_attention_bias, log_keep_next, log_keep_next_from_logits
from dmc.ops.reference import attention_bias_reference


def test_bias_equals_reference_soft_and_hard():
    g = torch.Generator().manual_seed(0)
    alpha = torch.rand(2, 3, 9, generator=g, dtype=torch.float64)
    alpha[0, 0, 4] = 1.0
    alpha[1, 2, 1] = 0.0
    torch.testing.assert_close(dmc_attention_bias(alpha), attention_bias_reference(alpha))


def test_bias_pattern():
    alpha = torch.tensor([[[0.3, 0.5, 1.0, 0.0]]], dtype=torch.float64)
    bias = dmc_attention_bias(alpha)[0, 0]
    assert torch.all(torch.diagonal(bias) == 0)
    assert torch.all(torch.isneginf(bias.triu(1)[torch.triu(torch.ones(4, 4), 1).bool()]))
    assert bias[2, 0] == pytest.approx(math.log(0.5))
    assert bias[3, 0] == pytest.approx(math.log(0.5))
    assert torch.isneginf(bias[2, 1]) and torch.isneginf(bias[3, 1])
    assert bias[3, 2] == 0.0


def test_log_keep_from_logits_is_stable():
    logits = torch.tensor([[[0.0, 3.0, 200.0, -200.0]]])
    got = log_keep_next_from_logits(logits)
    assert torch.isfinite(got).all()
    assert got[0, 0, 1] == pytest.approx(-200.0, rel=1e-6)
    want = log_keep_next(torch.sigmoid(logits.double()))[..., :1].float()
    torch.testing.assert_close(got[..., :1], want)


def _dense_reference(q, k, v, alpha):
    group = q.shape[1] // k.shape[1]
    bias = attention_bias_reference(alpha).repeat_interleave(group, 1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    return scores.softmax(-1) @ v.double()


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_dmc_attention_matches_float64(q_heads, kv_heads, backend):
    g = torch.Generator().manual_seed(1)
    b, s, d = 2, 24, 16
    q = torch.randn(b, q_heads, s, d, generator=g)
    k = torch.randn(b, kv_heads, s, d, generator=g)
    v = torch.randn(b, kv_heads, s, d, generator=g)
    alpha = torch.rand(b, kv_heads, s, generator=g, dtype=torch.float64)
    alpha[alpha > 0.8] = 1.0
    out = dmc_attention(q, k, v, log_keep_next(alpha), backend=backend)
    torch.testing.assert_close(out.double(), _dense_reference(q, k, v, alpha), rtol=1e-5, atol=1e-5)


def test_dmc_attention_rejects_unknown_backend():
    x = torch.zeros(1, 1, 2, 4)
    with pytest.raises(ValueError, match="dense"):
        dmc_attention(x, x, x, torch.zeros(1, 1, 2), backend="sdpa")


@pytest.mark.parametrize("seq,q_len,delay", [(9, 3, 0), (9, 1, 0), (10, 4, 2), (7, 7, 1)])
def test_bias_masks_of_the_last_queries_against_explicit_loops(seq, q_len, delay):
    """The queries are the last q_len positions i = seq - q_len + r: key j weighted by
    log(1 - alpha_{j+1}) when i - j > delay, seen unweighted when 0 <= i - j <= delay, masked
    (-inf) when j > i; bias_from_log_keep's rows are those of the full bias."""
    from dmc.ops.mask import bias_from_log_keep, bias_masks

    weighted, visible = bias_masks(seq, q_len, delay)
    log_keep = -torch.rand(2, 3, seq, generator=torch.Generator().manual_seed(4),
                           dtype=torch.float64)
    bias = bias_from_log_keep(log_keep, q_len, delay)
    assert weighted.shape == visible.shape == (q_len, seq)
    assert bias.shape == (2, 3, q_len, seq)
    for r in range(q_len):
        i = seq - q_len + r
        for j in range(seq):
            assert bool(weighted[r, j]) == (i - j > delay)
            assert bool(visible[r, j]) == (j <= i)
            want = (log_keep[..., j] if i - j > delay
                    else torch.zeros(2, 3, dtype=torch.float64) if j <= i
                    else torch.full((2, 3), -math.inf, dtype=torch.float64))
            assert torch.equal(bias[..., r, j], want)
    assert torch.equal(bias, bias_from_log_keep(log_keep, None, delay)[..., -q_len:, :])
