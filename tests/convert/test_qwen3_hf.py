"""HF Qwen3 <-> megatron-core (per-head q/k RMSNorm, head_dim != hidden / heads): a tiny random
Qwen3ForCausalLM's logits equal our model's after hf_to_mcore, HF -> mcore -> HF is bit-exact,
Qwen3-style DMS and DMC models export to remote-code folders that match our eval model and the
engine, and unsupported Qwen3 settings fail naming the field."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dmc.convert import UnsupportedModelError, hf_to_mcore, mcore_to_hf  # noqa: E402
from dmc.inference import Engine, SamplingParams, build_model_from_config  # noqa: E402
from dmc_models import (  # noqa: E402
    check_hf_logits, check_hf_roundtrip, save_tiny, spread_decisions)

pytestmark = pytest.mark.usefixtures("one_thread", "parallel_1x1")
VOCAB, SEQ = 80, 24


def tiny_qwen3(groups=2, tie=False, seed=0):
    """2 layers, hidden 48, 4 heads of head_dim 16 (not 48 / 4), random norm weights."""
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=groups, head_dim=16,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        rope_theta=1e6, initializer_range=0.2)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def tokens(seed=1, batch=2, n=SEQ):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("groups,tie", [(2, False), (4, True)], ids=["gqa", "mha-tied"])
def test_qwen3_logits_and_roundtrip(tmp_path, groups, tie):
    hf = tiny_qwen3(groups, tie)
    hf.save_pretrained(tmp_path / "hf")
    info, config = check_hf_roundtrip(hf, tmp_path / "hf", tmp_path, tokens())
    assert info["model_config"]["qk_layernorm"] is True
    assert info["model_config"]["kv_channels"] == 16
    assert "qk_layernorm: true" in (tmp_path / "mc" / "model.yaml").read_text()
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 16


def test_llama_with_explicit_head_dim(tmp_path):
    """A Llama whose head_dim (16) is not hidden / heads (12): kv_channels, no q/k norm."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        initializer_range=0.2)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    hf.save_pretrained(tmp_path / "hf")
    info, config = check_hf_roundtrip(hf, tmp_path / "hf", tmp_path, tokens())
    assert info["model_config"]["kv_channels"] == 16 and "qk_layernorm" not in info["model_config"]
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 16


def qwen3_compressed(dmc: dict, seed=0):
    """An eval-mode Qwen3-style DMC or DMS megatron model with random q/k norm weights."""
    cfg = dict(num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2,
               ffn_hidden_size=72, vocab_size=VOCAB, max_seq_length=96, rotary_base=1e6,
               norm_epsilon=1e-6, init_method_std=0.1, qk_layernorm=True, kv_channels=16)
    torch.manual_seed(seed)
    model = build_model_from_config(cfg, dmc).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    if dmc.get("method", "dmc") == "dmc":
        spread_decisions(model)
    return model, cfg


@pytest.mark.parametrize("dmc", [
    {"method": "dms", "dms_window": 3, "c": 5.0, "tau": 0.1},
    {"window": 4, "tau": 0.1, "c": -1.0}], ids=["dms", "dmc"])
def test_qwen3_compressed_export_matches_megatron_and_engine(tmp_path, dmc):
    model, cfg = qwen3_compressed(dmc)
    save_tiny(model, cfg, dmc, tmp_path / "mc")
    info = mcore_to_hf(tmp_path / "mc", tmp_path / "hf",
                       cr_tokens=tokens(seed=5, batch=1, n=48)[0].tolist())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["qk_norm"] is True and config["head_dim"] == 16
    assert info["measured_cr"] > 1.2  # decisions really compress
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                           trust_remote_code=True).eval()
    ids = tokens(seed=2, n=40)
    check_hf_logits(hf, model, ids, 25, f"Qwen3 {config['architectures'][0]}")

    prompt = ids[0, :13].tolist()
    result = Engine(model, max_batch=1, max_seq_len=64).generate(
        [prompt], SamplingParams(max_new_tokens=12))[0]
    ids_1 = torch.tensor([prompt])
    out = hf.generate(ids_1, attention_mask=torch.ones_like(ids_1), max_new_tokens=12,
                      do_sample=False, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == result.tokens


@pytest.mark.parametrize("field,value", [("use_sliding_window", True), ("attention_bias", True),
                                         ("layer_types", ["sliding_attention"] * 2)])
def test_unsupported_qwen3_settings(tmp_path, field, value):
    tiny_qwen3().save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **{field: value})))
    with pytest.raises(UnsupportedModelError, match=field):
        hf_to_mcore(tmp_path / "hf", tmp_path / "out")
