"""HF Llama <-> megatron-core: logits of a tiny random LlamaForCausalLM equal our megatron model's
after hf_to_mcore, HF -> mcore -> HF is bit-exact, a TP=2 save loads and matches, bad input
fails clearly."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dmc.convert import UnsupportedModelError, hf_to_mcore  # noqa: E402
from dmc.inference.loading import load_model  # noqa: E402
from dmc_models import check_hf_roundtrip, megatron_logits  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "parallel_1x1")
VOCAB, SEQ = 96, 24


def tiny_hf(groups=4, tie=False, rope_scaling=None, seed=0):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=groups, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=tie,
        rope_theta=500000.0 if rope_scaling else 10000.0, rope_scaling=rope_scaling,
        initializer_range=0.2)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def tokens(seed=1, batch=2):
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("groups,tie,scaling,shard", [
    (4, False, None, None), (2, True, None, "20KB"), (2, False, LLAMA3, None)],
    ids=["mha", "gqa-tied-sharded", "gqa-llama3"])
def test_hf_to_mcore_logits_and_roundtrip(tmp_path, groups, tie, scaling, shard):
    hf = tiny_hf(groups, tie, scaling)
    kwargs = {"max_shard_size": shard} if shard else {}
    hf.save_pretrained(tmp_path / "hf", **kwargs)
    if shard:
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    info, _ = check_hf_roundtrip(hf, tmp_path / "hf", tmp_path, tokens())
    assert info["model_config"]["num_query_groups"] == groups


def test_bin_weights_and_tp2_save(tmp_path):
    hf = tiny_hf(groups=2)
    folder = tmp_path / "hf"
    folder.mkdir()
    hf.config.to_json_file(folder / "config.json")
    torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    hf_to_mcore(folder, tmp_path / "mc2", tp=2)
    state = json.loads((tmp_path / "mc2" / "state.json").read_text())
    assert state["tp"] == 2 and state["kind"] == "converted"
    ids = tokens(seed=3)
    with torch.no_grad():
        want = hf(ids).logits
    got = megatron_logits(load_model(tmp_path / "mc2").model, ids)
    diff = (got - want).abs().max().item()
    print(f"max |logit diff| HF vs megatron saved at TP=2: {diff:.2e}")
    assert diff < 1e-5


def test_tied_embeddings_pp2_save(tmp_path):
    """Tied embeddings under pipeline parallelism: the last stage's own output weight (megatron's
    copy of the embedding) is written from the embedding, and the model reads as HF's."""
    hf = tiny_hf(groups=2, tie=True)
    hf.save_pretrained(tmp_path / "hf")
    hf_to_mcore(tmp_path / "hf", tmp_path / "mc", pp=2)
    ids = tokens(seed=3)
    with torch.no_grad():
        want = hf(ids).logits
    got = megatron_logits(load_model(tmp_path / "mc").model, ids)
    assert (got - want).abs().max().item() < 1e-5


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_to_mcore(tmp_path, tmp_path / "out")
    hf = tiny_hf()
    hf.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    bad = dict(cfg, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(UnsupportedModelError, match="architecture"):
        hf_to_mcore(tmp_path / "hf", tmp_path / "out")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=80)))
    with pytest.raises(ValueError, match="gate_proj.weight has shape"):
        hf_to_mcore(tmp_path / "hf", tmp_path / "out2")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        hf_to_mcore(tmp_path / "hf", tmp_path / "out3")
    hf.save_pretrained(tmp_path / "hf3")
    with pytest.raises(ValueError, match="not divisible by tp=3"):
        hf_to_mcore(tmp_path / "hf3", tmp_path / "out4", tp=3)


def test_a_config_without_optional_fields_reads_as_transformers_reads_it():
    """Fields config.json may leave out default to what transformers' LlamaConfig or
    Qwen3Config gives them (rms_norm_eps 1e-6; max_position_embeddings 2048 for Llama, 32768 for
    Qwen3; Qwen3's head_dim 128, not hidden / heads, and num_key_value_heads 32), so the
    converted model is the one HF loads from the same file."""
    from dmc.convert.hf_config import model_config_from_hf

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4).to_dict()
    for key in ("rms_norm_eps", "max_position_embeddings", "head_dim"):
        del cfg[key]
    model, hf = model_config_from_hf(cfg), transformers.LlamaConfig(**cfg)
    assert model.norm_epsilon == hf.rms_norm_eps == 1e-6
    assert model.max_seq_length == hf.max_position_embeddings == 2048
    assert model.head_dim == hf.head_dim == 16

    qwen3 = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                     num_hidden_layers=2, num_attention_heads=32).to_dict()
    for key in ("max_position_embeddings", "head_dim", "num_key_value_heads"):
        del qwen3[key]
    model, hf = model_config_from_hf(qwen3), transformers.Qwen3Config(**qwen3)
    assert model.head_dim == hf.head_dim == 128 and model.kv_channels == 128
    assert model.max_seq_length == hf.max_position_embeddings == 32768
    assert model.kv_heads == hf.num_key_value_heads == 32
    with pytest.raises(UnsupportedModelError, match=r"num_key_value_heads=32 \(transformers' "):
        model_config_from_hf(dict(qwen3, num_attention_heads=4))


ROPE_CASES = {  # config.json's RoPE fields (Llama), written by transformers 4 or 5 or by hand
    "v5-parameters": {"rope_parameters": dict(LLAMA3, rope_theta=500000.0)},
    "v5-parameters-top-level-theta": {"rope_parameters": LLAMA3, "rope_theta": 500000.0},
    "v4-scaling": {"rope_scaling": LLAMA3, "rope_theta": 500000.0},
    "scaling-over-parameters": {"rope_scaling": LLAMA3, "rope_parameters": {
        "rope_type": "default", "rope_theta": 500000.0}},
    "v5-default": {"rope_parameters": {"rope_type": "default"}, "rope_theta": 20000.0},
    "none": {},
}


@pytest.mark.parametrize("fields", ROPE_CASES.values(), ids=ROPE_CASES)
def test_rope_fields_read_as_transformers_reads_them(fields):
    """``rope_scaling`` (when set) or ``rope_parameters`` give the RoPE type and factor, their
    ``rope_theta`` or else the top-level one the base: transformers 5's
    ``convert_rope_params_to_dict``, e.g. llama3 scaling inside ``rope_parameters`` with the
    theta beside it is kept."""
    from dmc.convert.hf_config import model_config_from_hf

    cfg = dict(transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4).to_dict(),
               max_position_embeddings=16384)
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        cfg.pop(key, None)
    cfg.update(json.loads(json.dumps(fields)))
    model = model_config_from_hf(json.loads(json.dumps(cfg)))
    hf = transformers.LlamaConfig(**cfg).rope_parameters
    assert model.rotary_base == hf["rope_theta"]
    assert model.rope_scaling_factor == (hf["factor"] if hf["rope_type"] == "llama3" else None)
