import pytest
import torch

from dmc.ops import CRSchedule, compression_loss, gumbel_sigmoid, split_decision_channels
from dmc.ops.reference import compression_loss_reference


@pytest.mark.parametrize("logit", [-5.0, -1.0, 0.0, 0.7, 3.0])
def test_gumbel_calibration(logit):
    g = torch.Generator().manual_seed(123)
    alpha = gumbel_sigmoid(torch.full((100_000,), logit), tau=0.1, generator=g)
    frac = (alpha > 0.5).double().mean().item()
    assert abs(frac - torch.sigmoid(torch.tensor(logit)).item()) < 0.01


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


@pytest.mark.parametrize("cr", [1.0, 2.0, 4.0, 8.0])
def test_compression_loss_equals_reference(cr):
    alpha = torch.rand(3, 2, 4, 11, generator=torch.Generator().manual_seed(int(cr)), dtype=torch.float64)
    assert compression_loss(alpha, cr).item() == pytest.approx(compression_loss_reference(alpha, cr), abs=1e-12)


def test_compression_loss_is_one_sided_and_differentiable():
    alpha = torch.full((100,), 0.9, requires_grad=True)
    assert compression_loss(alpha, 2.0).item() == 0.0
    low = torch.full((100,), 0.1, requires_grad=True)
    loss = compression_loss(low, 2.0)
    assert loss.item() == pytest.approx(0.9 - 0.5)
    loss.backward()
    torch.testing.assert_close(low.grad, torch.full((100,), -1 / 100))
    with pytest.raises(ValueError, match="target_cr"):
        compression_loss(low, 0.5)


def test_cr_schedule():
    sched = CRSchedule(target_cr=4.0, steps=100, start_step=10)
    assert sched(0) == 1.0 and sched(10) == 1.0
    assert sched(60) == pytest.approx(2.5)
    assert sched(110) == 4.0 and sched(10_000) == 4.0
    assert CRSchedule(2.0, 0)(0) == 2.0
    with pytest.raises(ValueError, match="target_cr"):
        CRSchedule(0.5, 10)
