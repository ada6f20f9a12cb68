"""The typed model and DMC configs check each value's type where they are built: a dict read
from an inference file or a converted model's config is held to what a YAML run config is."""
import numpy as np
import pytest

from dmc.megatron.config import ConfigError, DMCConfig, ModelConfig


@pytest.mark.parametrize("cls, values, message", [
    (ModelConfig, {"qk_layernorm": "false"}, "model.qk_layernorm: expected true or false"),
    (ModelConfig, {"num_layers": 2.5}, "model.num_layers: expected an integer, got 2.5"),
    (ModelConfig, {"rotary_base": "ten"}, "model.rotary_base: expected a number, got 'ten'"),
    (ModelConfig, {"share_embeddings": 1}, "model.share_embeddings: expected true or false"),
    (ModelConfig, {"num_layers": None}, "model.num_layers: null is not allowed"),
    (DMCConfig, {"tau": float("nan")}, "dmc.tau: expected a finite number, got nan"),
    (DMCConfig, {"c": float("inf")}, "dmc.c: expected a finite number"),
    (DMCConfig, {"window": True}, "dmc.window: expected an integer, got True"),
    (DMCConfig, {"hard": "false"}, "dmc.hard: expected true or false"),
    (DMCConfig, {"prior": 1}, "dmc.prior: expected a string, got 1"),
])
def test_a_value_of_the_wrong_type_names_its_field(cls, values, message):
    with pytest.raises(ConfigError, match=message):
        cls.from_dict(values)
    with pytest.raises(ConfigError, match=message):
        cls(**values)


def test_numbers_become_the_annotated_type():
    """An integral float for an int field, an integer or a numeric string for a float field,
    and numpy scalars (a converted model's config) read as Python's int and float."""
    model = ModelConfig.from_dict({"num_layers": 2.0, "rotary_base": "5e5",
                                   "hidden_size": np.int64(64), "norm_epsilon": np.float32(1e-6)})
    assert (model.num_layers, model.rotary_base, model.hidden_size) == (2, 500000.0, 64)
    assert type(model.num_layers) is int and type(model.hidden_size) is int
    assert type(model.rotary_base) is float and type(model.norm_epsilon) is float
    dmc = DMCConfig.from_dict({"tau": "0.1", "c": 5, "window": None})
    assert (dmc.tau, dmc.c, dmc.window) == (0.1, 5.0, None) and type(dmc.c) is float
    assert ModelConfig.from_dict(model.to_dict()) == model
