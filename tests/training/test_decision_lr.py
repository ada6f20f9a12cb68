"""``optim.decision_lr_mult`` scales the retrofit's update of the decision rows (a DMS adapter's
``decision_proj``), nothing else."""
import pytest
import torch

from dmc.megatron.attention import decision_rows, dmc_layers
from dmc.training.config import ConfigError, load_config
from dmc.training.trainer import Trainer

from conftest import tiny_overrides
from tiny_models import decision_rows as reference_decision_rows

STEPS = {"schedule.zero_out_steps": 1, "schedule.retrofit_steps": 2,
         "schedule.solidify_steps": 0, "checkpoint.save_interval": 0}


ADAPTER = {"dmc.method": "dms", "dmc.dms_window": 8, "dmc.dms_decision": "adapter"}


def _qkv_weights(trainer):
    """Per layer: (its decision weight concatenated under its qkv weight, the decision rows)."""
    out = []
    for layer in dmc_layers(trainer.module):
        qkv, adapter = layer.linear_qkv.weight.detach(), getattr(layer, "decision_proj", None)
        if adapter is None:
            out.append((qkv.clone(), decision_rows(layer)))
        else:
            rows = list(range(qkv.shape[0], qkv.shape[0] + adapter.weight.shape[0]))
            out.append((torch.cat([qkv, adapter.weight.detach()]), rows))
    return out


def _trainer(tiny_data, run_dir, mult, method, steps=STEPS):
    overrides = tiny_overrides(tiny_data, run_dir, **steps, **method,
                               **{"optim.decision_lr_mult": mult})
    return Trainer(load_config([], overrides), "retrofit")


@pytest.mark.parametrize("method", [{}, ADAPTER], ids=["dmc", "dms-adapter"])
def test_decision_rows_move_mult_times_as_far_in_the_retrofit(tiny_data, tmp_path, method):
    plain = _trainer(tiny_data, tmp_path / "a", 1.0, method)
    scaled = _trainer(tiny_data, tmp_path / "b", 3.0, method)
    for trainer in (plain, scaled):
        trainer.run(stop_after=1)  # the zero-out step: no scaling
    for (a, _), (b, _) in zip(_qkv_weights(plain), _qkv_weights(scaled)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for trainer in (plain, scaled):
        trainer.run(stop_after=1)  # zeroes the decision rows, then the first retrofit step
    for (a, rows), (b, _) in zip(_qkv_weights(plain), _qkv_weights(scaled)):
        others = [r for r in range(a.shape[0]) if r not in rows]
        torch.testing.assert_close(a[others], b[others], rtol=0, atol=0)
        assert a[rows].abs().max() > 0  # the rows started at zero: the update is the weight
        torch.testing.assert_close(b[rows], 3.0 * a[rows], rtol=1e-5, atol=1e-7)


def test_zero_out_updates_of_the_decision_rows_are_not_scaled(tiny_data, tmp_path):
    """Inside a zero-out of 2 steps (no hand-off yet) the multiplier leaves the first step's
    update of the decision rows alone: the weights after step 0 equal the unscaled run's."""
    steps = {**STEPS, "schedule.zero_out_steps": 2}
    plain = _trainer(tiny_data, tmp_path / "a", 1.0, {}, steps)
    scaled = _trainer(tiny_data, tmp_path / "b", 3.0, {}, steps)
    start = _qkv_weights(plain)
    for trainer in (plain, scaled):
        trainer.run(stop_after=1)
        assert trainer.step == 1 and trainer.plan.at(0).mode == "zero_out"
    for (a, rows), (b, _), (a0, _) in zip(_qkv_weights(plain), _qkv_weights(scaled), start):
        assert (a[rows] - a0[rows]).abs().max() > 0  # the rows did train in step 0
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_scaled_update_reaches_both_the_main_copy_and_the_bf16_model_weight():
    """With megatron's float16 optimizer layout (a bf16 weight, its float32 ``main_param``
    stepped and copied back) the decision rows of both copies end at w + mult * update (a
    float64 reference), the other rows at w + update."""
    from dmc.megatron.model import build_model_from_config
    from dmc.training.decision_lr import DecisionUpdateScale

    torch.manual_seed(0)
    model = build_model_from_config(
        dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=96, vocab_size=96, max_seq_length=64), {"window": 4})
    layers = dmc_layers(model)
    for layer in layers:
        weight = layer.linear_qkv.weight
        weight.data = weight.data.to(torch.bfloat16)
        weight.main_param = weight.detach().float().clone()
    scale = DecisionUpdateScale(model, 3.0)
    updates = [torch.randn_like(l.linear_qkv.weight.main_param) * 1e-2 for l in layers]
    before = [l.linear_qkv.weight.main_param.double().clone() for l in layers]
    with scale.around_step():  # the optimizer's step on the main copy, then its copy back
        for layer, update in zip(layers, updates):
            weight = layer.linear_qkv.weight
            weight.main_param += update
            weight.data.copy_(weight.main_param)
    for layer, update, old in zip(layers, updates, before):
        weight, rows = layer.linear_qkv.weight, reference_decision_rows(layer)
        mult = torch.ones(weight.shape[0], 1, dtype=torch.float64)
        mult[rows] = 3.0
        want = old + mult * update.double()
        torch.testing.assert_close(weight.main_param.double(), want, rtol=0, atol=1e-6)
        assert weight.dtype == torch.bfloat16
        torch.testing.assert_close(weight.detach(), weight.main_param.to(torch.bfloat16),
                                   rtol=0, atol=0)
        torch.testing.assert_close(weight.double(), want, rtol=2**-8, atol=1e-6)


def test_a_non_positive_multiplier_is_refused(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match="optim.decision_lr_mult"):
        load_config([], tiny_overrides(tiny_data, tmp_path, **{"optim.decision_lr_mult": 0}))
