"""DMS with adapter decisions (``dmc.dms_decision: adapter``, NVIDIA Model-Optimizer's
``dms_separate_alpha: true``): the eval model equals the float64 reference of NVIDIA's forward
(logit from a separate RMSNorm + linear of the layer input, no query channel zeroed); train
(hard, no noise) == eval; the zero-out phase is the vanilla model and its hand-off zeroes only
``decision_proj``; the config field validates and stays out of ``to_dict`` at its default."""
import sys
from pathlib import Path

import pytest
import torch

from dmc.megatron.attention import decision_rows, dmc_layers, zero_decision_rows_
from dmc.megatron.config import ConfigError, DMCConfig, ModelConfig
from dmc.megatron.model import build_model_from_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))
from qwen3_reference import RefConfig, RefDMS, megatron_to_hf_names, reference_logits  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "parallel_1x1")
VOCAB, SEQ, WINDOW = 80, 28, 3
ADAPTER = dict(method="dms", dms_decision="adapter", dms_window=WINDOW, c=0.0,
               dms_logit_scale=10.0, tau=1.0)


def model_config(qk_norm=True):
    return ModelConfig(num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=72, vocab_size=VOCAB, max_seq_length=64, rotary_base=1e6,
                       norm_epsilon=1e-6, init_method_std=0.15, qk_layernorm=qk_norm,
                       kv_channels=16)


def build(qk_norm=True, spread=0.1, **dms):
    """An adapter-mode DMS model (eval mode), norms drawn around 1, ``decision_proj`` of std
    ``spread`` so that hard decisions mix keeping and evicting."""
    torch.manual_seed(0)
    model = build_model_from_config(model_config(qk_norm), DMCConfig(**{**ADAPTER, **dms}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "decision_proj" in name:
                p.copy_(spread * torch.randn_like(p))
    return model.eval(), dmc_layers(model)[0].dmc


def logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None].expand_as(ids), None).double()


def nvidia_weights(model, m: ModelConfig) -> dict:
    """The model in HF names plus NVIDIA's adapter: ``dms_proj_alpha_norm`` = the input norm's
    weight, ``dms_proj_alpha`` = ``decision_proj`` (then NVIDIA's adapter equals ours)."""
    cfg = RefConfig(heads=4, groups=2, head_dim=16, eps=m.norm_epsilon, theta=m.rotary_base,
                    qk_norm=m.qk_layernorm)
    state = {k: v for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    hf = megatron_to_hf_names(state, cfg)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        hf[p + "self_attn.dms_proj_alpha_norm.weight"] = hf[p + "input_layernorm.weight"]
        hf[p + "self_attn.dms_proj_alpha.weight"] = state[
            f"decoder.layers.{i}.self_attention.decision_proj.weight"]
    return hf, cfg


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama-like"])
def test_eval_equals_nvidia_separate_alpha_reference(qk_norm):
    model, _ = build(qk_norm)
    m = model_config(qk_norm)
    weights, cfg = nvidia_weights(model, m)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    got = logits(model, ids)
    for row in range(2):
        marks = []
        want = reference_logits(weights, cfg, ids[row],
                                RefDMS(10.0, 0.0, WINDOW, separate=True), marks)
        assert (got[row] - want).abs().max() < 1e-4
        evicted = torch.stack(marks).double().mean().item()
        assert 0.2 < evicted < 0.8, evicted
        kept_all = reference_logits(weights, cfg, ids[row], RefDMS(10.0, 1e9, WINDOW, True))
        assert (got[row] - kept_all).abs().max() > 1e-2


def test_train_hard_without_noise_equals_eval_and_trains_decision_proj():
    model, runtime = build(hard=True)
    for layer in dmc_layers(model):
        layer._noise = lambda logit: torch.zeros_like(logit, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    want = logits(model, ids)
    runtime.set_mode("train")
    runtime.target_cr = 4.0
    out = model(ids, torch.arange(SEQ)[None].expand_as(ids), None)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
    out.float().logsumexp(-1).mean().backward()
    for layer in dmc_layers(model):
        assert layer.decision_proj.weight.grad.abs().max() > 0


def test_query_keeps_every_channel_and_zero_out_is_vanilla():
    """With every logit far below 0 the eval model is the vanilla model: no channel zeroed.
    Zero-out at any scale is the vanilla model; the hand-off zeroes decision_proj only."""
    model, runtime = build(c=1e4)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    evaluated = logits(model, ids)
    runtime.set_mode("vanilla")
    vanilla = logits(model, ids)
    torch.testing.assert_close(evaluated, vanilla, rtol=0, atol=1e-5)
    runtime.set_mode("zero_out")
    for scale in (1.0, 0.3, 0.0):
        runtime.zero_out_scale = scale
        torch.testing.assert_close(logits(model, ids), vanilla, rtol=0, atol=0)
    before = {n: p.clone() for n, p in model.named_parameters()}
    assert all(decision_rows(layer) == [] for layer in dmc_layers(model))
    assert zero_decision_rows_(model) == 2
    for name, param in model.named_parameters():
        assert torch.equal(param, torch.zeros_like(param) if "decision_proj" in name
                           else before[name]), name
    runtime.set_mode("eval")
    runtime.config = DMCConfig(**{**ADAPTER, "c": 5.0})
    torch.testing.assert_close(logits(model, ids), vanilla, rtol=0, atol=1e-5)  # logit -5
    runtime.config = DMCConfig(**{**ADAPTER, "dms_decision": "query"})
    with pytest.raises(ValueError, match="built for the other"):
        logits(model, ids)


def test_config_field():
    assert "dms_decision" not in DMCConfig(method="dms").to_dict()
    assert DMCConfig(**ADAPTER).to_dict()["dms_decision"] == "adapter"
    assert DMCConfig.from_dict(DMCConfig(**ADAPTER).to_dict()) == DMCConfig(**ADAPTER)
    with pytest.raises(ConfigError, match="dmc.dms_decision: 'proj' is not one of query, adapter"):
        DMCConfig(method="dms", dms_decision="proj")
    with pytest.raises(ConfigError, match="dmc.dms_decision: 'adapter' needs dmc.method: dms"):
        DMCConfig(dms_decision="adapter")
