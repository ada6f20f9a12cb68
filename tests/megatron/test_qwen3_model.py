"""Qwen3-style models on megatron-core (per-head q/k RMSNorm before RoPE, explicit head_dim
``kv_channels`` != hidden / heads): the vanilla and the DMS eval-mode forward equal a float64
reference written from the formulas (DMS: the decision logit is read after q_norm and before
RoPE, as in NVIDIA Model-Optimizer's ``prepare_attention_input``); bad kv_channels fail."""
import sys
from pathlib import Path

import pytest
import torch

from dmc.megatron.config import ConfigError, DMCConfig, ModelConfig
from dmc.megatron.model import build_model_from_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))
from qwen3_reference import RefConfig, RefDMS, megatron_to_hf_names, reference_logits  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "parallel_1x1")
VOCAB, SEQ = 80, 28


def qwen3_config(**overrides):
    """hidden 48, 4 query heads in 2 KV groups of head_dim 16 (48 / 4 = 12 would be Llama's)."""
    return ModelConfig(**{**dict(
        num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=72, vocab_size=VOCAB, max_seq_length=64, rotary_base=1e6,
        norm_epsilon=1e-6, init_method_std=0.15, qk_layernorm=True, kv_channels=16),
        **overrides})


def build(model_config, dmc=None, seed=0):
    torch.manual_seed(seed)
    model = build_model_from_config(model_config, dmc).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def ref_config(m: ModelConfig) -> RefConfig:
    return RefConfig(heads=m.num_attention_heads, groups=m.kv_heads, head_dim=m.head_dim,
                     eps=m.norm_epsilon, theta=m.rotary_base, qk_norm=m.qk_layernorm)


def logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None].expand_as(ids), None)[0].double()


def state_of(model):
    return {k: v for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "head_dim-only"])
def test_vanilla_forward_matches_reference(qk_norm):
    m = qwen3_config(qk_layernorm=qk_norm)
    model = build(m)
    layer = model.decoder.layers[0].self_attention
    assert layer.hidden_size_per_attention_head == 16
    assert isinstance(layer.q_layernorm, torch.nn.RMSNorm) == qk_norm
    assert tuple(layer.linear_qkv.weight.shape) == ((4 + 2 * 2) * 16, 48)
    ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(1))
    cfg = ref_config(m)
    want = reference_logits(megatron_to_hf_names(state_of(model), cfg), cfg, ids)
    diff = (logits(model, ids[None]) - want).abs().max().item()
    print(f"max |logit diff| megatron vs float64 reference (qk_norm={qk_norm}): {diff:.2e}")
    assert diff < 1e-4


def test_dms_logit_is_read_after_q_norm():
    """The eval-mode DMS model (hard decisions, window 3) equals the reference that reads the
    logit from q_norm(q); reading it before q_norm would give other decisions and logits."""
    m = qwen3_config()
    dms = DMCConfig(method="dms", dms_window=3, c=5.0, dms_logit_scale=100.0)
    model = build(m, dms)
    cfg = ref_config(m)
    weights = megatron_to_hf_names(state_of(model), cfg)
    ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(2))
    want = reference_logits(weights, cfg, ids, RefDMS(scale=100.0, offset=5.0, window=3))
    got = logits(model, ids[None])
    diff = (got - want).abs().max().item()
    print(f"max |logit diff| DMS eval vs reference: {diff:.2e}")
    assert diff < 1e-4
    no_eviction = reference_logits(weights, cfg, ids, RefDMS(100.0, 1e9, window=3))
    assert (got - no_eviction).abs().max() > 1e-2  # tokens really were evicted
    # the logit of the un-normalised query differs: a test that could tell the two apart
    layer = model.decoder.layers[0].self_attention
    with torch.no_grad():
        h = model.decoder.layers[0].input_layernorm(
            model.embedding(input_ids=ids[None], position_ids=torch.arange(SEQ)[None]))
        mixed, _ = layer.linear_qkv(h)
        raw_q = mixed.view(SEQ, 2, 4, 16)[:, :, 0, -1]  # first q head of each group
        normed, _, _ = layer.get_query_key_value_tensors(h)
        assert not torch.allclose(raw_q, normed[:, 0, ::2, -1])


@pytest.mark.parametrize("value", [0, -4, 7, 2.5])
def test_bad_kv_channels(value):
    with pytest.raises(ConfigError, match="model.kv_channels"):
        qwen3_config(kv_channels=value)


def test_to_dict_omits_defaults():
    plain = ModelConfig(vocab_size=10)
    assert "qk_layernorm" not in plain.to_dict() and "kv_channels" not in plain.to_dict()
    m = qwen3_config()
    assert m.to_dict()["kv_channels"] == 16 and m.to_dict()["qk_layernorm"] is True
    assert ModelConfig.from_dict(m.to_dict()) == m and m.head_dim == 16
    assert ModelConfig(hidden_size=48, num_attention_heads=5, kv_channels=8).head_dim == 8
