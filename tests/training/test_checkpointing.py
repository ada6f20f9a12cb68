"""``checkpoint.load_base`` architecture check (:class:`dmc.training.checkpointing.RunCheckpoints`):
a base of another architecture fails with the fields to override, Qwen3's ``kv_channels`` and
``qk_layernorm`` included; fields ``to_dict`` leaves out at their defaults compare as defaults."""
import json

import pytest

from dmc.megatron.config import ModelConfig
from dmc.training.checkpointing import RunCheckpoints

LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=96, vocab_size=96)


def _check(tmp_path, saved: ModelConfig, ours: ModelConfig):
    (tmp_path / "state.json").write_text(json.dumps({"model_config": saved.to_dict()}))
    checkpoints = RunCheckpoints.__new__(RunCheckpoints)
    checkpoints.model_config = ours
    checkpoints._check_base_shape(tmp_path)


@pytest.mark.parametrize("saved,ours,message", [
    (dict(num_query_groups=1), {}, "model.num_query_groups is 2 but the checkpoint has 1"),
    (dict(qk_layernorm=True), {}, "model.qk_layernorm is False but the checkpoint has True"),
    ({}, dict(qk_layernorm=True), "model.qk_layernorm is True but the checkpoint has False"),
    (dict(kv_channels=32), {}, "model.kv_channels is 16 but the checkpoint has 32"),
    ({}, dict(kv_channels=8), "model.kv_channels is 8 but the checkpoint has 16"),
], ids=["query_groups", "qk_norm_saved", "qk_norm_ours", "kv_channels_saved", "kv_channels_ours"])
def test_load_base_of_another_architecture_fails(tmp_path, saved, ours, message):
    with pytest.raises(ValueError, match=message):
        _check(tmp_path, ModelConfig(**{**LLAMA, **saved}), ModelConfig(**{**LLAMA, **ours}))


def test_same_head_dim_spelled_differently_passes(tmp_path):
    """kv_channels 16 explicit == hidden 64 / 4 heads: the same architecture."""
    _check(tmp_path, ModelConfig(**LLAMA), ModelConfig(**LLAMA, kv_channels=16))
    _check(tmp_path, ModelConfig(**LLAMA, qk_layernorm=True, kv_channels=16),
           ModelConfig(**LLAMA, qk_layernorm=True))
