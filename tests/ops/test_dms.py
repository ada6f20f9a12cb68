"""DMS's delayed-eviction mask and borrowed decision channel against float64 references."""
import math

import pytest
import torch

from dmc.ops import (dmc_attention, dms_attention_bias, log_keep_next, split_dms_channels,
                     zero_dms_channel)
from dmc.ops.reference import attention_bias_reference, dms_attention_bias_reference


@pytest.mark.parametrize("window", [0, 1, 3, 20])
def test_dms_bias_equals_reference(window):
    g = torch.Generator().manual_seed(0)
    alpha = torch.rand(2, 3, 11, generator=g, dtype=torch.float64)
    alpha[alpha > 0.7] = 1.0
    torch.testing.assert_close(dms_attention_bias(alpha, window),
                               dms_attention_bias_reference(alpha, window))


def test_dms_bias_with_no_delay_is_dmc_bias():
    alpha = torch.rand(1, 2, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(dms_attention_bias(alpha, 0), attention_bias_reference(alpha))


def test_dms_eviction_timing():
    """Key 2 marked by alpha[3] = 1 stays visible to queries 2..2+w, then disappears."""
    alpha = torch.zeros(1, 1, 10, dtype=torch.float64)
    alpha[0, 0, 3] = 1.0
    bias = dms_attention_bias(alpha, 4)[0, 0]
    assert all(bias[i, 2] == 0 for i in range(2, 7))
    assert all(math.isinf(bias[i, 2]) for i in range(7, 10))
    assert (bias[:, 3] != -math.inf).sum() == 7  # key 3 is never evicted


@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_dms_attention_matches_float64(backend):
    g = torch.Generator().manual_seed(2)
    b, hq, hk, s, d, w = 2, 4, 2, 20, 8, 5
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (hq, hk, hk))
    alpha = torch.rand(b, hk, s, generator=g, dtype=torch.float64)
    alpha[alpha > 0.6] = 1.0
    out = dmc_attention(q, k, v, log_keep_next(alpha), backend=backend, delay=w)
    bias = dms_attention_bias_reference(alpha, w).repeat_interleave(2, 1)
    scores = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(d)
    ref = (scores + bias).softmax(-1) @ v.double().repeat_interleave(2, 1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_split_dms_channels_borrows_first_query_head_of_each_group():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 5, 4, generator=g, dtype=torch.float64)
    out = split_dms_channels(q, kv_heads=2, c=5.0, scale=100.0)
    torch.testing.assert_close(out.alpha_logit, q[:, [0, 3], :, -1] * 100.0 - 5.0)
    expected = q.clone()
    expected[:, [0, 3], :, -1] = 0
    torch.testing.assert_close(out.query, expected)
    half = zero_dms_channel(q, 2, scale=0.5)
    torch.testing.assert_close(half[:, 3, :, -1], q[:, 3, :, -1] * 0.5)
    torch.testing.assert_close(half[:, 4], q[:, 4])
