"""``attention_backend: "flex-transposed"``: the gradient of the DMC / DMS / delayed-merging
bias from a swapped FlexAttention forward (:mod:`dmc.ops.flex_bias_grad`) == the dense path's
autograd gradient. On the CPU FlexAttention has no backward, so queries, keys and values are
constants here and only ``log_keep`` needs a gradient: the swapped pass (forwards only) runs
eagerly; the whole flex backward is compared on CUDA in test_mask_gpu.py."""
import pytest
import torch

from dmc.ops import dmc_attention, log_keep_next, log_keep_next_from_logits
from dmc.megatron.config import ATTENTION_BACKENDS
from dmc.ops.attention import BACKENDS, delayed_merge_attention
from flex_reference import reference_flex


def _inputs(batch, q_heads, kv_heads, seq, dim, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, seq, dim, generator=gen)
    k, v = (torch.randn(batch, kv_heads, seq, dim, generator=gen) for _ in range(2))
    logits = 4.0 * torch.randn(batch, kv_heads, seq, generator=gen)  # some decisions near 0, 1
    grad_out = torch.randn(batch, q_heads, seq, dim, generator=gen)
    return [t.to(dtype) for t in (q, k, v, grad_out)] + [logits]


def _bias_gradient(attend, logits, grad_out):
    leaf = logits.clone().requires_grad_()
    attend(log_keep_next_from_logits(leaf)).backward(grad_out)
    return leaf.grad


@pytest.mark.parametrize("q_heads,kv_heads,seq,delay", [
    (2, 2, 40, 0),    # DMC
    (4, 2, 200, 0),   # GQA, more than one 128-token block
    (3, 1, 150, 5),   # DMS with an eviction window of 5
    (2, 2, 30, 29),   # a window past the sequence: no pair carries the bias
])
def test_dmc_and_dms_bias_gradient_equals_dense(q_heads, kv_heads, seq, delay):
    q, k, v, grad_out, logits = _inputs(2, q_heads, kv_heads, seq, 16, seed=seq + delay)
    grads = [_bias_gradient(lambda lk: dmc_attention(q, k, v, lk, backend=backend, delay=delay),
                            logits, grad_out)
             for backend in ("flex-transposed", "dense")]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)
    assert grads[1].abs().sum() > 0 or delay >= seq - 1


@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (4, 1)])
def test_delayed_merge_bias_gradient_equals_dense(q_heads, kv_heads):
    q, k, v, grad_out, logits = _inputs(1, q_heads, kv_heads, 70, 16, seed=q_heads)
    k_acc, v_acc = 0.5 * k, 0.5 * v + 0.1
    grads = [_bias_gradient(lambda lk: delayed_merge_attention(q, k_acc, v_acc, k, v, lk, 3,
                                                               backend=backend),
                            logits, grad_out)
             for backend in ("flex-transposed", "dense")]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)


def test_hard_decisions_give_a_finite_gradient():
    """Merges with alpha = 1 make ``log_keep`` -inf (keys no later query sees): the swapped
    pass gives those pairs probability 0, a key with only such pairs a zero row, no NaN."""
    q, k, v, grad_out, _ = _inputs(1, 4, 2, 30, 16, seed=5)
    alpha = torch.rand(1, 2, 30, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    alpha[..., 5:12] = 1.0
    log_keep = log_keep_next(alpha).float()
    assert torch.isneginf(log_keep).sum() == 14
    grads = []
    for backend in ("flex-transposed", "dense"):
        leaf = log_keep.clone().requires_grad_()
        dmc_attention(q, k, v, leaf, backend=backend).backward(grad_out)
        grads.append(leaf.grad)
    assert torch.isfinite(grads[0]).all()
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)


def test_bf16_bias_gradient_close_to_float32():
    """bf16 queries, keys and values (the swapped pass runs in their dtype): the gradient within
    a few percent of the float32 dense one."""
    q, k, v, grad_out, logits = _inputs(2, 4, 2, 130, 32, seed=7)
    want = _bias_gradient(lambda lk: dmc_attention(q, k, v, lk, backend="dense"), logits,
                          grad_out)
    q16, k16, v16 = (t.bfloat16() for t in (q, k, v))
    got = _bias_gradient(lambda lk: dmc_attention(q16, k16, v16, lk, backend="flex-transposed"),
                         logits, grad_out.bfloat16())
    assert float((got - want).norm() / want.norm()) < 3e-2


def test_without_a_gradient_the_output_is_flex():
    q, k, v, _, logits = _inputs(1, 2, 2, 20, 16, seed=3)
    log_keep = log_keep_next_from_logits(logits)
    torch.testing.assert_close(dmc_attention(q, k, v, log_keep, backend="flex-transposed"),
                               dmc_attention(q, k, v, log_keep, backend="flex"))


def test_the_config_accepts_every_attention_backend():
    """``DMCConfig`` (torch-free) keeps its own list of ``dmc_attention``'s backends."""
    assert ATTENTION_BACKENDS == BACKENDS


@pytest.mark.parametrize("is_cuda,aux,zero_key_channel,expected", [
    (True, True, True, (True, "channel")),       # CUDA, DMC's keys: flex-channel
    (True, True, False, (True, "transposed")),   # CUDA, other keys (DMS): flex-transposed
    (True, False, True, (True, "atomic")),       # a torch without return_aux: flex
    (False, True, True, (False, "atomic")),      # CPU: dense
])
def test_auto_backend_choice(monkeypatch, is_cuda, aux, zero_key_channel, expected):
    from types import SimpleNamespace

    import dmc.ops.attention as attention

    monkeypatch.setattr(attention, "_has_return_aux", lambda: aux)
    query = SimpleNamespace(shape=(1, 4, 8, 16), is_cuda=is_cuda)
    key = SimpleNamespace(shape=(1, 2, 8, 16))
    assert attention._settings("dmc_attention", query, key, None, "auto",
                               zero_key_channel) == (0.25, *expected)


# ``"flex-channel"``: the bias gradient read from the keys' gradient in their zero last channel
# less the visible pairs that carry no bias. FlexAttention has no backward on the CPU, so the
# construction (:func:`channel_bias_attention`) runs here around a float64 attention with the
# bias detached, against autograd through the bias itself; on CUDA with FlexAttention in
# test_mask_gpu.py and test_attention_gpu.py.

def _detached_bias_attention(masks, log_keep, scale):
    """``(query, key, value) -> (out, lse)`` in float64 under ``bias_from_masks(log_keep
    detached)``: what FlexAttention computes in the channel backend."""
    from dmc.ops.mask import bias_from_masks

    def attend(query, key, value):
        group = query.shape[1] // key.shape[1]
        bias = bias_from_masks(log_keep.detach(), *masks).repeat_interleave(group, dim=1)
        scores = query @ key.repeat_interleave(group, dim=1).transpose(-1, -2) * scale + bias
        lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse[..., None]) @ value.repeat_interleave(group, dim=1), lse

    return attend


def _reference_attention(query, key, value, log_keep, masks, scale):
    from dmc.ops.mask import bias_from_masks

    group = query.shape[1] // key.shape[1]
    bias = bias_from_masks(log_keep, *masks).repeat_interleave(group, dim=1)
    scores = query @ key.repeat_interleave(group, dim=1).transpose(-1, -2) * scale + bias
    return torch.softmax(scores, dim=-1) @ value.repeat_interleave(group, dim=1)


def _channel_case(kind, q_heads, kv_heads, seq, delay, seed, log_keep=None):
    """float64 inputs whose keys end in a zero channel, the masks of ``kind`` ("dmc" with
    ``delay`` 0, "dms" with window ``delay``, "delayed" merging) and their unweighted lags."""
    from dmc.ops.mask import bias_masks, delayed_log_keep, delayed_merge_masks

    gen = torch.Generator().manual_seed(seed)
    keys = 2 * seq if kind == "delayed" else seq
    q = torch.randn(2, q_heads, seq, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, kv_heads, keys, 16, generator=gen, dtype=torch.float64)
    k[..., -1] = 0
    v = torch.randn(2, kv_heads, keys, 16, generator=gen, dtype=torch.float64)
    if log_keep is None:
        logits = 4.0 * torch.randn(2, kv_heads, seq, generator=gen, dtype=torch.float64)
        log_keep = log_keep_next_from_logits(logits).double()
    grad_out = torch.randn(2, q_heads, seq, 16, generator=gen, dtype=torch.float64)
    if kind == "delayed":  # the bias over [accumulated | raw] keys
        masks, offsets, over_keys = delayed_merge_masks(seq, delay), (delay + 1,), delayed_log_keep
    else:
        masks, offsets, over_keys = bias_masks(seq, delay=delay), range(delay + 1), lambda x: x
    return q, k, v, log_keep, over_keys, masks, offsets, grad_out


def _channel_gradients(q, k, v, log_keep, over_keys, masks, offsets, grad_out, channel):
    from dmc.ops.flex_bias_grad import channel_bias_attention

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, log_keep)]
    q_, k_, v_, lk_ = leaves
    scale = 0.25
    if channel:
        out = channel_bias_attention(_detached_bias_attention(masks, over_keys(lk_), scale),
                                     q_, k_, v_, lk_, scale, offsets)
    else:
        out = _reference_attention(q_, k_, v_, over_keys(lk_), masks, scale)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("kind,q_heads,kv_heads,seq,delay", [
    ("dmc", 2, 2, 40, 0),
    ("dmc", 4, 2, 33, 0),       # GQA
    ("delayed", 2, 2, 30, 3),   # DMC with delayed merging: the open slot at i - j = d + 1
    ("delayed", 4, 1, 25, 1),
    ("dms", 3, 1, 24, 5),       # a band of 6 unweighted lags (DMS's keys would need the zero)
    ("dms", 2, 2, 12, 20),      # a window past the sequence: no pair carries the bias
])
def test_channel_bias_gradient_equals_autograd_through_the_bias(kind, q_heads, kv_heads, seq,
                                                                 delay):
    case = _channel_case(kind, q_heads, kv_heads, seq, delay, seed=seq + delay)
    got = _channel_gradients(*case, channel=True)
    want = _channel_gradients(*case, channel=False)
    for name, g, w in zip(("output", "dq", "dk", "dv", "dlog_keep"), got, want):
        if name in ("dq", "dk"):  # the queries' last channel meets zeros: it gets no gradient,
            assert torch.equal(g[..., -1], torch.zeros_like(g[..., -1])), name  # nor the keys'
            g, w = g[..., :-1], w[..., :-1]
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=name)
    assert want[4].abs().sum() > 0 or delay >= seq - 1


def test_channel_bias_gradient_with_hard_merges_is_finite():
    alpha = torch.rand(2, 2, 30, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    alpha[..., 5:12] = 1.0
    log_keep = log_keep_next(alpha)
    assert torch.isneginf(log_keep).sum() == 28
    case = _channel_case("dmc", 4, 2, 30, 0, seed=8, log_keep=log_keep)
    got = _channel_gradients(*case, channel=True)
    want = _channel_gradients(*case, channel=False)
    assert torch.isfinite(got[4]).all()
    torch.testing.assert_close(got[4], want[4], rtol=1e-9, atol=1e-11)


def test_flex_channel_needs_keys_with_a_zero_channel():
    q, k, v, _, logits = _inputs(1, 2, 2, 20, 16, seed=3)
    with pytest.raises(ValueError, match="flex-channel.*zero_key_channel=True"):
        dmc_attention(q, k, v, log_keep_next_from_logits(logits), backend="flex-channel")


def test_without_a_gradient_flex_channel_is_flex():
    q, k, v, _, logits = _inputs(1, 4, 2, 20, 16, seed=4)
    k[..., -1] = 0
    log_keep = log_keep_next_from_logits(logits)
    torch.testing.assert_close(
        dmc_attention(q, k, v, log_keep, backend="flex-channel", zero_key_channel=True),
        dmc_attention(q, k, v, log_keep, backend="flex"))


def test_channel_bias_gradient_in_bf16_close_to_float64():
    """bf16 queries, keys, values and output gradient (the attention computed in float64 and
    returned in bf16, its key gradient rounded to bf16 as FlexAttention's is; the products of
    :func:`unweighted_pairs_gradient` in bf16): the bias gradient within 2% of float64's."""
    q, k, v, log_keep, over_keys, masks, offsets, grad_out = _channel_case("dmc", 4, 2, 64, 0,
                                                                           seed=9)
    want = _channel_gradients(q, k, v, log_keep, over_keys, masks, offsets, grad_out,
                              channel=False)[4]
    attend64 = _detached_bias_attention(masks, log_keep, 0.25)

    def attend(query, key, value):
        out, lse = attend64(query.double(), key.double(), value.double())
        return out.to(query.dtype), lse.float()

    from dmc.ops.flex_bias_grad import channel_bias_attention

    leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    leaf = log_keep.float().requires_grad_()
    channel_bias_attention(attend, *leaves, leaf, 0.25, offsets).backward(grad_out.bfloat16())
    assert float((leaf.grad.double() - want).norm() / want.norm()) < 2e-2


@pytest.mark.parametrize("backend", ["flex-channel", "flex-transposed", "flex"])
@pytest.mark.parametrize("delay", [0, 3], ids=["dmc", "delayed"])
def test_every_flex_backend_wired_end_to_end(monkeypatch, backend, delay):
    """``dmc_attention`` / ``delayed_merge_attention`` through ``_flex`` with FlexAttention
    replaced by :func:`flex_reference.reference_flex` (FlexAttention has no CPU backward):
    the output and the gradients of queries, keys, values and decision logits equal the dense
    path's. Checks on the CPU what the GPU tests check of the wiring (score_mod, block masks,
    the detached bias, the unweighted lags, ``lse``); the kernels themselves are
    FlexAttention's."""
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "flex_attention", reference_flex)
    gen = torch.Generator().manual_seed(11 + delay)
    q = torch.randn(2, 4, 40, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 40, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    k[..., -1] = 0
    logits = 4.0 * torch.randn(2, 2, 40, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(2, 4, 40, 16, generator=gen, dtype=torch.float64)

    def run(name):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, logits)]
        # float32-rounded as the flex paths carry it (float64 logits now stay float64)
        log_keep = log_keep_next_from_logits(leaves[3].float()).double()
        channel = dict(zero_key_channel=True)
        if delay:
            out = delayed_merge_attention(leaves[0], leaves[1], leaves[2], 0.5 * leaves[1],
                                          0.5 * leaves[2] + 0.1, log_keep, delay,
                                          backend=name, **channel)
        else:
            out = dmc_attention(*leaves[:3], log_keep, backend=name, **channel)
        out.backward(grad_out)
        return [out.detach()] + [t.grad for t in leaves]

    # flex and flex-transposed carry the bias (and the swapped pass its sums) in float32
    tol = dict(rtol=1e-7, atol=1e-9) if backend == "flex-channel" else dict(rtol=1e-5, atol=1e-6)
    for name, got, want in zip(("output", "dq", "dk", "dv", "dlogits"), run(backend),
                               run("dense")):
        if name == "dk" and backend == "flex-channel":  # the keys' zero channel: no gradient
            assert not got[..., -1].any()
            got, want = got[..., :-1], want[..., :-1]
        torch.testing.assert_close(got, want, **tol, msg=name)


def test_row_dot_sums_bf16_products_in_float32():
    """row_dot on bf16: each product rounded once to bf16 (exact in float32 before rounding),
    then summed in float32, equal to a float64 sum of those rounded products; broadcasting as
    the swapped pass uses it ([.., 1, keys, d] against [.., group, keys, d])."""
    from dmc.ops.flex_bias_grad import row_dot

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 1, 40, 256, generator=gen).bfloat16()
    y = torch.randn(2, 3, 4, 40, 256, generator=gen).bfloat16()
    got = row_dot(x, y)
    products = (x.double() * y.double()).bfloat16()  # what x * y gives in bf16
    want = products.double().sum(-1)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 4, 40)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    assert torch.equal(row_dot(x.double(), y.double(), torch.float64),
                       (x.double() * y.double()).sum(-1))
