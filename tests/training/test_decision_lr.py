"""``optim.decision_lr_mult`` scales the retrofit's update of the decision rows (a DMS adapter's
``decision_proj``), nothing else."""
import pytest
import torch

from dmc.megatron.attention import decision_rows, dmc_layers
from dmc.training.config import ConfigError, load_config
from dmc.training.trainer import Trainer

from conftest import tiny_overrides

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


def _trainer(tiny_data, run_dir, mult, method):
    overrides = tiny_overrides(tiny_data, run_dir, **STEPS, **method,
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


def test_a_non_positive_multiplier_is_refused(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match="optim.decision_lr_mult"):
        load_config([], tiny_overrides(tiny_data, tmp_path, **{"optim.decision_lr_mult": 0}))
