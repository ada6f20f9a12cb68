import pytest
import torch

from dmc.ops import partial_accumulate
from dmc.ops import accumulate
from dmc.ops.accumulate import WindowedSum, WindowWeights, window_weights
from dmc.ops.reference import compressed_cache_reference, partial_accumulate_reference


def _inputs(batch=2, heads=3, seq=17, dim=5, seed=0, hard=False):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, heads, seq, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, heads, seq, dim, generator=g, dtype=torch.float64)
    alpha = torch.rand(batch, heads, seq, generator=g, dtype=torch.float64)
    if hard:
        alpha = (alpha > 0.5).double()
    omega = torch.rand(batch, heads, seq, generator=g, dtype=torch.float64) + 0.05
    return k, v, alpha, omega


@pytest.mark.parametrize("window", [None, 1, 4, 12, 17, 40])
def test_matches_float64_reference(window):
    k, v, alpha, omega = _inputs()
    k_ref, v_ref = partial_accumulate_reference(k, v, alpha, omega, window)
    k_out, v_out = partial_accumulate(k, v, alpha, omega, window)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(v_out, v_ref, rtol=1e-10, atol=1e-12)


def test_window_at_least_seq_equals_exact_scan():
    k, v, alpha, omega = _inputs(seq=9)
    exact = partial_accumulate(k, v, alpha, omega, None)
    for window in (9, 10, 100):
        windowed = partial_accumulate(k, v, alpha, omega, window)
        torch.testing.assert_close(windowed[0], exact[0], rtol=1e-12, atol=1e-12)


def test_window_one_is_identity():
    k, v, alpha, omega = _inputs()
    k_out, v_out = partial_accumulate(k, v, alpha, omega, 1)
    torch.testing.assert_close(k_out, k)
    torch.testing.assert_close(v_out, v)


def test_first_alpha_is_ignored():
    k, v, alpha, omega = _inputs()
    alpha_changed = alpha.clone()
    alpha_changed[..., 0] = 1.0 - alpha[..., 0]
    for window in (None, 4):
        torch.testing.assert_close(
            partial_accumulate(k, v, alpha, omega, window)[0],
            partial_accumulate(k, v, alpha_changed, omega, window)[0],
        )


def test_hard_decisions_reproduce_algorithm1_segment_means():
    k, v, alpha, omega = _inputs(batch=1, heads=2, seq=23, hard=True, seed=3)
    k_out, v_out = partial_accumulate(k, v, alpha, omega, None)
    for h in range(2):
        keys, values, slot_of_token = compressed_cache_reference(
            k[0, h], v[0, h], alpha[0, h], omega[0, h]
        )
        for t in range(23):
            torch.testing.assert_close(k_out[0, h, t], keys[t][slot_of_token[t]])
            torch.testing.assert_close(v_out[0, h, t], values[t][slot_of_token[t]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_close_to_float64(dtype):
    k, v, alpha, omega = _inputs(seq=30)
    k_ref, _ = partial_accumulate_reference(k, v, alpha, omega, 12)
    k_out, _ = partial_accumulate(k.to(dtype), v.to(dtype), alpha.to(dtype), omega.to(dtype), 12)
    assert k_out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(k_out.double(), k_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("window", [None, 4])
def test_gradients_match_reference_and_flow_to_decisions(window):
    k, v, alpha, omega = _inputs(batch=1, heads=2, seq=8, dim=3, seed=5)
    leaves = [t.clone().requires_grad_() for t in (k, v, alpha, omega)]
    k_out, v_out = partial_accumulate(*leaves, window)
    ((k_out * 1.3).sum() + (v_out**2).sum()).backward()
    ref_leaves = [t.clone().requires_grad_() for t in (k, v, alpha, omega)]
    k_ref, v_ref = partial_accumulate_reference(*ref_leaves, window)
    ((k_ref * 1.3).sum() + (v_ref**2).sum()).backward()
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-10)
    assert leaves[2].grad[..., 1:].abs().sum() > 0
    assert leaves[3].grad.abs().sum() > 0


@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("seq", [4, 5, 11])
def test_exact_scan_over_several_chunks(seq, hard, monkeypatch):
    """The exact form carries its sums across chunks (made 4 tokens long here, so that the
    float64 reference stays quick: one chunk, one more token, two and a remainder): values and
    gradients == the reference; hard decisions (alpha exactly 0 inside chunks and on their
    borders) == Algorithm 1's means."""
    monkeypatch.setattr(accumulate, "SCAN_CHUNK", 4)
    k, v, alpha, omega = _inputs(batch=1, heads=2, seq=seq, dim=3, seed=seq, hard=hard)
    if hard:
        alpha[..., 3::4] = 0.0  # a slot opens on a chunk's last token
        alpha[..., 4::4] = 0.0  # and on a chunk's first
    leaves = [t.clone().requires_grad_() for t in (k, v, alpha, omega)]
    ref_leaves = [t.clone().requires_grad_() for t in (k, v, alpha, omega)]
    outputs = partial_accumulate(*leaves, None), partial_accumulate_reference(*ref_leaves, None)
    for k_out, v_out in outputs:
        ((k_out * 1.3).sum() + (v_out**2).sum()).backward()
    for got, want in zip(outputs[0], outputs[1]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-10)
    assert leaves[2].grad[..., 1:].abs().sum() > 0
    if hard:
        keys, _, slot_of_token = compressed_cache_reference(k[0, 1], v[0, 1], alpha[0, 1],
                                                            omega[0, 1])
        for t in range(seq):
            torch.testing.assert_close(outputs[0][0][0, 1, t], keys[t][slot_of_token[t]])


def test_exact_scan_float32_over_long_segments():
    """float32 sums carried unnormalised over 2048 tokens (32 chunks of the default
    ``SCAN_CHUNK``), decisions near 1 (segments thousands of tokens long): within 1e-5 of the
    float64 scan."""
    assert accumulate.SCAN_CHUNK == 64
    gen = torch.Generator().manual_seed(11)
    k, v = (torch.randn(1, 2, 2048, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    alpha = 1 - 1e-3 * torch.rand(1, 2, 2048, generator=gen, dtype=torch.float64)
    omega = torch.rand(1, 2, 2048, generator=gen, dtype=torch.float64) + 0.05
    want = partial_accumulate(k, v, alpha, omega, None)
    got = partial_accumulate(k.float(), v.float(), alpha.float(), omega.float(), None)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_bad_shapes_name_the_expected_layout():
    k, v, alpha, omega = _inputs()
    with pytest.raises(ValueError, match=r"\[batch, heads, seq\]"):
        partial_accumulate(k, v, alpha[..., :-1], omega)
    with pytest.raises(ValueError, match="window"):
        partial_accumulate(k, v, alpha, omega, 0)


def test_windowed_sum_gradients_float64():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 9, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    coeff = torch.randn(1, 2, 9, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(WindowedSum.apply, (x, coeff))
    shifted = sum(coeff[..., o, None] * torch.cat([x.new_zeros(1, 2, o, 3), x[:, :, :9 - o]], 2)
                  for o in range(4))
    torch.testing.assert_close(WindowedSum.apply(x, coeff), shifted)


def test_window_weights_gradients_float64():
    """The weights' backward (products recomputed from alpha and omega) against autograd
    through :func:`window_weights` and gradcheck."""
    gen = torch.Generator().manual_seed(6)
    alpha = torch.rand(2, 3, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    omega = (torch.rand(2, 3, 11, generator=gen, dtype=torch.float64) + 0.1).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, o: WindowWeights.apply(a, o, 4), (alpha, omega))
    grad = torch.randn(2, 3, 11, 4, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(WindowWeights.apply(alpha, omega, 4), (alpha, omega), grad)
    want = torch.autograd.grad(window_weights(alpha, omega, 4), (alpha, omega), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_window_one_trains():
    """Window 1 (each token its own slot's whole sum): the backward runs (alpha takes no
    gradient) and the keys' gradient passes through unchanged."""
    k = torch.randn(1, 2, 7, 4, requires_grad=True)
    alpha = torch.rand(1, 2, 7, requires_grad=True)
    omega = (torch.rand(1, 2, 7) + 0.1).requires_grad_()
    k_acc, v_acc = partial_accumulate(k, k, alpha, omega, window=1)
    (k_acc + v_acc).sum().backward()
    torch.testing.assert_close(k.grad, torch.full_like(k, 2.0))
    assert alpha.grad is None or not alpha.grad.any()


def saved_for_backward(window: int, dim: int = 64) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of one window-grouped
    accumulation of 256 keys and values of ``dim`` channels (2 heads)."""
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, 256, dim, generator=gen, requires_grad=True) for _ in range(2))
    alpha = torch.rand(1, 2, 256, generator=gen, requires_grad=True)
    omega = (torch.rand(1, 2, 256, generator=gen) + 0.1).requires_grad_()
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = partial_accumulate(k, v, alpha, omega, window=window)
    del outputs  # kept alive until every storage is counted: freed ones could be reused
    return sum(storages.values())


def test_window_does_not_multiply_the_memory_kept_for_backward():
    """The shifted copies of the keys and values are recomputed in the backward, not kept:
    window 12 keeps less than 1.5x the keys and values themselves (written as shifted products
    it kept ~12x)."""
    keys_and_values = 2 * 256 * 64 * 4 * 2
    assert saved_for_backward(12) < 1.5 * keys_and_values


def test_window_weights_keep_only_their_inputs_and_output():
    """Besides the keys and values, the backward keeps the weights ``[1, 2, 256, 12]`` and two
    ``[1, 2, 256]`` tensors (alpha with its first entry zeroed, omega), not the ~2 x 12 partial
    products of the weights (at 4 channels those would weigh twice the keys and values)."""
    per_head_token = 2 * 256 * 4
    kept = saved_for_backward(12, dim=4) - 2 * 4 * per_head_token
    assert kept <= (12 + 2) * per_head_token


def test_bf16_keys_and_values_are_summed_in_float32_and_kept_as_they_come():
    """bf16 k, v: the window-grouped sums equal float32 ones on the same rounded inputs, the
    gradients come back in bf16, and autograd keeps k and v in bf16 (not float32 copies)."""
    gen = torch.Generator().manual_seed(4)
    k, v = (torch.randn(1, 2, 64, 16, generator=gen).bfloat16().requires_grad_()
            for _ in range(2))
    alpha, omega = torch.rand(1, 2, 64, generator=gen), torch.rand(1, 2, 64, generator=gen) + 0.1
    k_acc, v_acc = partial_accumulate(k, v, alpha, omega, window=12)
    k32, v32 = (t.detach().float().requires_grad_() for t in (k, v))
    k_want, v_want = partial_accumulate(k32, v32, alpha, omega, window=12)
    assert k_acc.dtype == torch.bfloat16
    torch.testing.assert_close(k_acc.float(), k_want.bfloat16().float())
    torch.testing.assert_close(v_acc.float(), v_want.bfloat16().float())
    (k_acc.float().sum() + v_acc.float().sum()).backward()
    (k_want.sum() + v_want.sum()).backward()
    assert k.grad.dtype == torch.bfloat16
    torch.testing.assert_close(k.grad.float(), k32.grad.bfloat16().float())
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        partial_accumulate(k, v, alpha, omega, window=12)
    assert not any(t.dtype == torch.float32 and t.shape == k.shape for t in kept)
