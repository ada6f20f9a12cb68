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
    """Fields config.json may leave out default to what transformers' LlamaConfig gives them
    (rms_norm_eps 1e-6), so the converted model is the one HF loads from the same file."""
    from dmc.convert.hf_config import model_config_from_hf

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4).to_dict()
    del cfg["rms_norm_eps"]
    model = model_config_from_hf(cfg)
    assert model.norm_epsilon == transformers.LlamaConfig(**cfg).rms_norm_eps == 1e-6
