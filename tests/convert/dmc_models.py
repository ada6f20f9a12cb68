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
