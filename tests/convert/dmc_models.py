"""Tiny DMC megatron checkpoints for the conversion tests."""
import torch

from dmc.convert.mcore_io import write_checkpoint
from dmc.inference import build_model_from_config
from dmc.megatron.attention import dmc_layers
from tiny_models import decision_rows

VOCAB = 96


def model_config(groups, max_seq=96):
    return dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                ffn_hidden_size=96, vocab_size=VOCAB, max_seq_length=max_seq,
                init_method_std=0.05)


def spread_decisions(model, std=0.4):
    """Redraws the decision rows (q[..., -1], k[..., -1]) with std ``std`` so that the hard
    decisions mix appends and merges."""
    for layer in dmc_layers(model):
        rows = decision_rows(layer)
        with torch.no_grad():
            weight = layer.linear_qkv.weight
            weight[rows] = torch.randn_like(weight[rows]) * std


def tiny_dmc(groups, window, c=-1.0, seed=0, omega_offset=0.0):
    """``(model, model_config, dmc_config)``: an eval-mode DMC megatron model."""
    torch.manual_seed(seed)
    cfg = model_config(groups)
    dmc = {"window": window, "tau": 0.1, "c": c, "hard": False, "omega_offset": omega_offset}
    model = build_model_from_config(cfg, dmc).eval()
    spread_decisions(model)
    return model, cfg, dmc


def full_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def save_tiny(model, cfg, dmc, folder, **extra):
    return write_checkpoint(folder, full_state(model), cfg, dmc, extra=extra)


def megatron_logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None].expand_as(ids), None)


def tiny_dms(groups, window, c=0.0, seed=0, adapter=False):
    """``(model, model_config, dmc_config)``: an eval-mode DMS megatron model (hard decisions;
    the borrowed channel's logit ``q[..., -1] * 100 - c`` mixes keeps and evictions).
    ``adapter``: adapter decisions (``dms_decision: adapter``), ``decision_proj`` of std 0.01."""
    torch.manual_seed(seed)
    cfg = model_config(groups)
    dms = {"method": "dms", "dms_window": window, "c": c, "tau": 0.1, "hard": False}
    if adapter:
        dms["dms_decision"] = "adapter"
    model = build_model_from_config(cfg, dms).eval()
    for layer in dmc_layers(model) if adapter else ():
        with torch.no_grad():
            layer.decision_proj.weight.normal_(0.0, 0.01)
    return model, cfg, dms


def check_hf_roundtrip(hf, hf_dir, tmp_path, ids):
    """Converts the saved ``hf`` folder ``hf_dir`` to megatron (``tmp_path / "mc"``): our logits
    equal HF's to 1e-5; back to HF (``tmp_path / "back"``): every tensor bit-identical and the
    reloaded model's logits equal. Returns ``(hf_to_mcore's info, the exported config.json)``."""
    import json

    import transformers
    from safetensors.torch import load_file

    from dmc.convert import hf_to_mcore, mcore_to_hf
    from dmc.convert.hf_io import read_hf_weights
    from dmc.inference.loading import load_model

    info = hf_to_mcore(hf_dir, tmp_path / "mc")
    with torch.no_grad():
        want = hf(ids).logits
    got = megatron_logits(load_model(tmp_path / "mc").model, ids)
    diff = (got - want).abs().max().item()
    print(f"max |logit diff| HF {type(hf).__name__} vs megatron: {diff:.2e}")
    assert diff < 1e-5
    mcore_to_hf(tmp_path / "mc", tmp_path / "back")
    original = read_hf_weights(hf_dir)
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(reloaded) is type(hf)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, want)
    return info, json.loads((tmp_path / "back" / "config.json").read_text())
