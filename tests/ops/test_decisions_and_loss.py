import math

import pytest
import torch

from dmc.ops import (
    CRSchedule,
    compression_loss,
    compression_loss_from_sums,
    gumbel_sigmoid,
    relaxed_decisions,
    split_decision_channels,
    straight_through_round,
    zero_decision_channel,
)
from dmc.ops.reference import compression_loss_reference


@pytest.mark.parametrize("logit", [-5.0, -1.0, 0.0, 0.7, 3.0])
def test_gumbel_calibration(logit):
    g = torch.Generator().manual_seed(123)
    alpha = gumbel_sigmoid(torch.full((100_000,), logit), tau=0.1, generator=g)
    frac = (alpha > 0.5).double().mean().item()
    assert abs(frac - torch.sigmoid(torch.tensor(logit)).item()) < 0.01


@pytest.mark.parametrize("hard", [False, True])
def test_relaxed_decisions_against_a_float64_loop(hard):
    """Eq. 8's alpha (alpha_0 = 0) and App. H's log(1 - alpha_{j+1}) (0 for the last key),
    value by value against float64 (computed in float32); under ``hard`` the rounded values
    with the soft gradients."""
    gen = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(2, 3, 17, generator=gen, dtype=torch.float64)).requires_grad_()
    noise = torch.randn(2, 3, 17, generator=gen, dtype=torch.float64)
    alpha, log_keep = relaxed_decisions(logits, noise, 0.5, hard)
    for b, h in ((b, h) for b in range(2) for h in range(3)):
        for j in range(17):
            soft = 1 / (1 + math.exp(-(float(logits[b, h, j]) + float(noise[b, h, j])) / 0.5))
            want = float(soft > 0.5) if hard else soft
            assert float(alpha[b, h, j]) == pytest.approx(0.0 if j == 0 else want, rel=1e-6,
                                                          abs=1e-7)
            if j + 1 < 17:
                nxt = 1 / (1 + math.exp(-(float(logits[b, h, j + 1])
                                          + float(noise[b, h, j + 1])) / 0.5))
                nxt = float(nxt > 0.5) if hard else nxt
                assert float(log_keep[b, h, j]) == pytest.approx(
                    math.log1p(-nxt) if nxt < 1 else -math.inf, rel=1e-5, abs=1e-6)
            else:
                assert float(log_keep[b, h, j]) == 0
    soft_alpha = torch.sigmoid((logits + noise) / 0.5)
    grad = torch.autograd.grad(alpha[..., 1:].sum(), logits)[0]
    want = torch.autograd.grad(soft_alpha[..., 1:].sum(), logits)[0]
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


def test_eq8_keeps_float64_in_float64():
    """Eq. 8's sample, App. H's log(1 - alpha) and the training forward's decisions computed in
    float64 for float64 logits (they went through float32: gradcheck failed), float32 for
    lower precisions."""
    from dmc.ops import log_one_minus_gumbel_sigmoid

    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 3, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    noise = torch.randn(2, 3, 9, generator=gen, dtype=torch.float64)
    for fn in (lambda x: gumbel_sigmoid(x, 0.1, noise=noise),
               lambda x: log_one_minus_gumbel_sigmoid(x, 0.1, noise),
               lambda x: relaxed_decisions(x, noise, 0.1)):
        assert torch.autograd.gradcheck(fn, (logits,))
    alpha, log_keep = relaxed_decisions(logits, noise, 0.1)
    assert alpha.dtype == log_keep.dtype == torch.float64
    alpha, log_keep = relaxed_decisions(logits.bfloat16(), noise.float(), 0.1)
    assert (alpha.dtype, log_keep.dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_log_one_minus_gumbel_sigmoid_against_float64(dtype):
    """log(1 - alpha) of Eq. 8's sample, alpha = sigmoid((x + noise) / tau), computed stably
    (App. H), equals float64 log1p(-sigmoid((x + noise) / tau)) with the same noise."""
    from dmc.ops import log_one_minus_gumbel_sigmoid

    gen = torch.Generator().manual_seed(8)
    # |(x + noise) / tau| <= 15, where float64 1 - sigmoid keeps ~9 significant digits
    logits = (3 * torch.randn(4, 25, generator=gen, dtype=torch.float64)).clamp(-6, 6).to(dtype)
    uniform = torch.rand(4, 25, generator=gen, dtype=torch.float64).clamp(0.01, 0.99)
    noise = uniform.logit().to(dtype)  # Logistic(0, 1)
    want = torch.log1p(-torch.sigmoid((logits.double() + noise.double()) / 0.7))
    got = log_one_minus_gumbel_sigmoid(logits, 0.7, noise)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-6 if dtype == torch.float32 else 1e-8,
                               atol=1e-7 if dtype == torch.float32 else 1e-12)
    # the same sample as gumbel_sigmoid's: exp() of it is 1 - alpha
    torch.testing.assert_close(got.exp(), 1 - gumbel_sigmoid(logits, 0.7, noise=noise))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_importance_is_floored_at_omega_min(dtype):
    """omega = max(sigmoid(omega_logit + c) + offset, OMEGA_MIN) (Sec. 3.2, the floor keeping
    Eq. 9's running weight z > 0), against float64 math, logits that reach the floor included."""
    from dmc.ops import importance
    from dmc.ops.decisions import OMEGA_MIN

    logits = [-300.0, -60.0, -20.0, -19.0, -14.5, -5.0, 0.0, 2.0]  # sigmoid(-15) = 3.1e-7
    for offset in (0.0, 2**-7):
        got = importance(torch.tensor(logits, dtype=dtype), 5.0, offset)
        want = [max(1 / (1 + math.exp(-(x + 5.0))) + offset, OMEGA_MIN) for x in logits]
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-6, atol=0)
        if offset == 0.0:
            assert got[:4].eq(torch.tensor(OMEGA_MIN, dtype=dtype)).all()  # at the floor


def test_gumbel_reproducible_and_hard_straight_through():
    logits = torch.randn(64, requires_grad=True)
    a1 = gumbel_sigmoid(logits, 0.1, torch.Generator().manual_seed(7))
    a2 = gumbel_sigmoid(logits, 0.1, torch.Generator().manual_seed(7))
    torch.testing.assert_close(a1, a2)
    hard = gumbel_sigmoid(logits, 0.1, torch.Generator().manual_seed(7), hard=True)
    assert set(hard.detach().unique().tolist()) <= {0.0, 1.0}
    torch.testing.assert_close(hard.detach(), (a1.detach() > 0.5).float())
    hard.sum().backward()
    soft_grad = torch.autograd.grad(
        gumbel_sigmoid(logits, 0.1, torch.Generator().manual_seed(7)).sum(), logits
    )[0]
    torch.testing.assert_close(logits.grad, soft_grad)
    with pytest.raises(ValueError, match="tau"):
        gumbel_sigmoid(logits, 0.0)


def test_split_decision_channels_mha_and_gqa():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 8, generator=g)
    k = torch.randn(2, 3, 5, 8, generator=g)
    out = split_decision_channels(q, k, c=5.0)
    torch.testing.assert_close(out.alpha_logit, k[..., -1] - 5.0)
    group_mean = q[..., -1].reshape(2, 3, 2, 5).mean(2)
    torch.testing.assert_close(out.omega, torch.sigmoid(group_mean + 5.0))
    assert (out.query[..., -1] == 0).all() and (out.key[..., -1] == 0).all()
    torch.testing.assert_close(out.query[..., :-1], q[..., :-1])
    torch.testing.assert_close(out.key[..., :-1], k[..., :-1])
    with pytest.raises(ValueError, match="multiple"):
        split_decision_channels(torch.randn(1, 5, 2, 4), torch.randn(1, 2, 2, 4))


def test_omega_offset_is_added_after_the_sigmoid():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64), torch.randn(1, 2, 6, 8)
    out = split_decision_channels(q, k.double(), c=5.0, omega_offset=2**-7)
    want = torch.sigmoid(q[..., -1].reshape(1, 2, 2, 6).mean(2) + 5.0) + 2**-7
    torch.testing.assert_close(out.omega, want, rtol=0, atol=1e-15)


def test_straight_through_round_value_and_gradient():
    alpha = torch.tensor([0.1, 0.49, 0.51, 0.97], requires_grad=True)
    hard = straight_through_round(alpha)
    assert hard.tolist() == [0.0, 0.0, 1.0, 1.0]
    (hard * torch.arange(4.0)).sum().backward()
    torch.testing.assert_close(alpha.grad, torch.arange(4.0))


@pytest.mark.parametrize("cap", [None, 1.5, 8.0])
@pytest.mark.parametrize("prior", ["global", "local"])
@pytest.mark.parametrize("cr", [1.0, 2.0, 4.0, 8.0])
def test_compression_loss_equals_reference(cr, prior, cap):
    alpha = torch.rand(3, 2, 4, 11, generator=torch.Generator().manual_seed(int(cr)),
                       dtype=torch.float64) ** 0.3  # many heads above 1.5x
    want = compression_loss_reference(alpha, cr, prior, cap)
    got = compression_loss(alpha, cr, prior, cap).item()
    assert got == pytest.approx(want, abs=1e-12)
    if cap == 1.5:
        assert got > compression_loss(alpha, cr, prior).item()


@pytest.mark.parametrize("prior", ["global", "local"])
def test_bf16_alpha_is_summed_in_float32(prior):
    """bf16 decisions (as trained) give a float32 loss equal to Eq. 10's float64 reference of
    the same bf16 values: the kept-slot sums run in float32, not bf16."""
    alpha = torch.rand(2, 2, 2, 700, generator=torch.Generator().manual_seed(9)).bfloat16()
    got = compression_loss(alpha, 4.0, prior, head_cr_cap=1.5)
    assert got.dtype == torch.float32
    want = compression_loss_reference(alpha.double(), 4.0, prior, 1.5)
    assert want > 0.1 and got.item() == pytest.approx(want, abs=1e-6)


def test_head_cap_penalises_only_heads_above_the_cap():
    # layer 0's heads keep 50% (2x), layer 1's keep 5% (20x): the global 2x hinge is met
    # (27.5% kept), a cap of 8x pushes layer 1's heads back up to 12.5% kept
    alpha = _two_sequences(0.0, 0.0)
    with torch.no_grad():
        alpha[:, 0], alpha[:, 1] = 0.5, 0.95
    assert compression_loss(alpha, 2.0).item() == pytest.approx(0.0, abs=1e-12)
    loss = compression_loss(alpha, 2.0, head_cr_cap=8.0)
    assert loss.item() == pytest.approx((0.125 - 0.05) / 2, abs=1e-12)
    loss.backward()
    assert (alpha.grad[:, 0] == 0).all() and (alpha.grad[:, 1] > 0).all()
    with pytest.raises(ValueError, match="head_cr_cap"):
        compression_loss(alpha, 2.0, head_cr_cap=1.0)


@pytest.mark.parametrize("prior", ["global", "local"])
def test_head_balance_equals_reference(prior):
    alpha = torch.rand(2, 3, 4, 7, generator=torch.Generator().manual_seed(3),
                       dtype=torch.float64)
    plain = compression_loss(alpha, 2.0, prior).item()
    got = compression_loss(alpha, 2.0, prior, head_balance_weight=0.7).item()
    assert got == pytest.approx(compression_loss_reference(alpha, 2.0, prior, None, 0.7),
                                abs=1e-12)
    assert got > plain + 1e-3


def test_head_balance_pulls_each_head_towards_its_layers_mean():
    # layer 0: heads at 0.2, 0.2, 0.8 at every token (mean 0.4); layer 1: every head at 0.5
    alpha = _two_sequences(0.0, 0.0)
    with torch.no_grad():
        alpha[:, 0] = torch.tensor([0.2, 0.2, 0.8], dtype=torch.float64)[:, None]
        alpha[:, 1] = 0.5
    hinge = compression_loss(alpha, 1.0)
    loss = compression_loss(alpha, 1.0, head_balance_weight=2.0)
    # |deviations| per token of layer 0: 0.2 + 0.2 + 0.4 over 2 layers x 3 heads
    assert (loss - hinge).item() == pytest.approx(2.0 * 0.8 / 6, abs=1e-12)
    loss.backward()
    grad = alpha.grad[0, 0, :, 0]
    # descent moves the outlier down and the others up, per token (2 layers x 3 heads x 10)
    scale = 2.0 / (2 * 6 * 10)
    torch.testing.assert_close(grad, torch.tensor([-2 / 3, -2 / 3, 4 / 3],
                                                  dtype=torch.float64) * scale)
    assert alpha.grad[:, 1].abs().max() == 0  # an even layer costs nothing (sign(0) = 0)


def _two_sequences(first, second, layers=2, heads=3, seq=10):
    """``[2, layers, heads, seq]`` float64 alphas, constant per sequence."""
    alpha = torch.empty(2, layers, heads, seq, dtype=torch.float64)
    alpha[0], alpha[1] = first, second
    return alpha.requires_grad_(True)


def test_hinge_is_per_sequence():
    # sequence 0 keeps 90% of its tokens (above the 2x target), sequence 1 keeps 10% (below):
    # the micro-batch as a whole keeps exactly 50%, so a hinge on the batch sum would be 0
    alpha = _two_sequences(0.1, 0.9)
    loss = compression_loss(alpha, 2.0)
    assert loss.item() == pytest.approx(compression_loss_reference(alpha, 2.0), abs=1e-12)
    assert loss.item() == pytest.approx((0.9 - 0.5) / 2, abs=1e-12)
    kept = (1 - alpha.detach()).sum()
    assert compression_loss_from_sums(kept[None], alpha.numel(), 2.0).item() == 0.0
    loss.backward()
    per_sequence = alpha[0].numel()
    torch.testing.assert_close(alpha.grad[0], torch.full_like(alpha[0], -1 / (2 * per_sequence)))
    assert (alpha.grad[1] == 0).all()


def test_local_prior_hinges_each_layer():
    alpha = _two_sequences(0.0, 0.0)
    with torch.no_grad():
        alpha[:, 0], alpha[:, 1] = 0.1, 0.9  # layer 0 keeps 90%, layer 1 keeps 10%
    assert compression_loss(alpha, 2.0, "global").item() == pytest.approx(0.0, abs=1e-12)
    local = compression_loss(alpha, 2.0, "local")
    assert local.item() == pytest.approx((0.9 - 0.5) / 2, abs=1e-12)
    assert local.item() == pytest.approx(compression_loss_reference(alpha, 2.0, "local"),
                                         abs=1e-12)


def test_partial_sums_of_a_pipeline_stage_add_up():
    alpha = torch.rand(3, 4, 2, 9, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    kept = (1 - alpha).sum(dim=(2, 3))  # [batch, layers]
    stages = [compression_loss_from_sums(kept[:, i:i + 2], 18, 3.0, num_groups=4)
              for i in (0, 2)]
    assert sum(stages).item() == pytest.approx(compression_loss(alpha, 3.0, "local").item(),
                                               abs=1e-12)


def test_compression_loss_is_one_sided_and_differentiable():
    alpha = torch.full((1, 1, 1, 100), 0.9, requires_grad=True)
    assert compression_loss(alpha, 2.0).item() == 0.0
    low = torch.full((1, 1, 1, 100), 0.1, requires_grad=True)
    loss = compression_loss(low, 2.0)
    assert loss.item() == pytest.approx(0.9 - 0.5)
    loss.backward()
    torch.testing.assert_close(low.grad, torch.full_like(low, -1 / 100))
    with pytest.raises(ValueError, match="target_cr"):
        compression_loss(low, 0.5)
    with pytest.raises(ValueError, match="prior"):
        compression_loss(low, 2.0, "layer")


def test_cr_schedule():
    sched = CRSchedule(target_cr=4.0, steps=100, start_step=10)
    assert sched(0) == 1.0 and sched(10) == 1.0
    assert sched(60) == pytest.approx(2.5)
    assert sched(110) == 4.0 and sched(10_000) == 4.0
    assert CRSchedule(2.0, 0)(0) == 2.0
    with pytest.raises(ValueError, match="target_cr"):
        CRSchedule(0.5, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeroing_the_channel_by_a_mask_equals_the_slices(dtype):
    """zero_decision_channel's mask product gives the values of the slice-and-cat form bit for
    bit (signed zeros included) and the same gradient: the last channel's zeroed, the rest
    passed through."""
    x = torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(5)).to(dtype)
    x[0, 0, 0, -1] = -2.0  # a negative channel gives -0.0 both ways
    got_x = x.clone().requires_grad_()
    want_x = x.clone().requires_grad_()
    got = zero_decision_channel(got_x)
    want = torch.cat([want_x[..., :-1], want_x[..., -1:] * 0.0], dim=-1)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert got.dtype == dtype and torch.equal(got.view(bits), want.view(bits))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    got.backward(grad)
    want.backward(grad)
    assert torch.equal(got_x.grad, want_x.grad) and got_x.grad[..., -1].eq(0).all()
