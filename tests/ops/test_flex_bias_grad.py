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


@pytest.mark.parametrize("is_cuda,aux,expected", [
    (True, True, (True, True)),     # CUDA: flex-transposed (the fastest on an H100)
    (True, False, (True, False)),   # a torch without return_aux: flex
    (False, True, (False, False)),  # CPU: dense
])
def test_auto_backend_choice(monkeypatch, is_cuda, aux, expected):
    from types import SimpleNamespace

    import dmc.ops.attention as attention

    monkeypatch.setattr(attention, "_has_return_aux", lambda: aux)
    query = SimpleNamespace(shape=(1, 4, 8, 16), is_cuda=is_cuda)
    key = SimpleNamespace(shape=(1, 2, 8, 16))
    assert attention._settings("dmc_attention", query, key, None, "auto") == (0.25, *expected)
