"""A slow, float64 Qwen3 forward written from the formulas (test helper only): Llama plus a
per-head RMSNorm of q and k before RoPE and an explicit head_dim, optionally with NVIDIA's DMS
(Model-Optimizer ``experimental/dms``, ``dms/core.py::prepare_attention_input`` and the
delayed-eviction mask of ``dms/attention.py``) with hard decisions ``logit > 0``.

Weights use the Hugging Face names (``model.layers.i.self_attn.q_proj.weight``...)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RefConfig:
    heads: int
    groups: int
    head_dim: int
    eps: float
    theta: float
    qk_norm: bool = True


@dataclass
class RefDMS:
    """``logit = q_norm(q)[first head of group, -1] * scale - offset`` (``separate``: from
    ``dms_proj_alpha(dms_proj_alpha_norm(h)) * scale - offset`` instead, ``h`` the layer input
    before ``input_layernorm``: NVIDIA's own norm and weights, not the converter's folded
    projection; the query then keeps every channel); key j is dropped for queries i with
    ``i - j > window`` when ``logit_{j+1} > 0``."""
    scale: float
    offset: float
    window: int
    separate: bool = False


def rms(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def rope(x, theta):
    """Rotate-half RoPE of ``x [seq, heads, dim]`` at positions 0..seq-1."""
    seq, _, dim = x.shape
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None]
    angles = torch.cat([angles, angles], -1)[:, None, :]
    rotated = torch.cat([-x[..., dim // 2:], x[..., :dim // 2]], -1)
    return x * torch.cos(angles) + rotated * torch.sin(angles)


def reference_logits(weights: dict, cfg: RefConfig, tokens: torch.Tensor,
                     dms: RefDMS | None = None, marks: list | None = None) -> torch.Tensor:
    """Logits ``[seq, vocab]`` of one sequence ``tokens [seq]`` (float64). With ``dms``,
    ``marks`` (if given) receives each layer's eviction marks ``[groups, seq]`` bool."""
    w = {k: v.double() for k, v in weights.items()}
    seq, d, group = tokens.shape[0], cfg.head_dim, cfg.heads // cfg.groups
    x = w["model.embed_tokens.weight"][tokens]
    layers = 1 + max(int(k.split(".")[2]) for k in w if k.startswith("model.layers."))
    for i in range(layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"], cfg.eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(seq, cfg.heads, d)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(seq, cfg.groups, d)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(seq, cfg.groups, d)
        if cfg.qk_norm:
            q = rms(q, w[p + "self_attn.q_norm.weight"], cfg.eps)
            k = rms(k, w[p + "self_attn.k_norm.weight"], cfg.eps)
        visible = torch.ones(seq, seq, dtype=torch.bool).tril()[None].repeat(cfg.groups, 1, 1)
        if dms is not None:
            if dms.separate:
                a = rms(x, w[p + "self_attn.dms_proj_alpha_norm.weight"], cfg.eps)
                logit = a @ w[p + "self_attn.dms_proj_alpha.weight"].T * dms.scale - dms.offset
            else:
                logit = q[:, ::group, -1] * dms.scale - dms.offset  # [seq, groups]
                q = q.clone()
                q[:, ::group, -1] = 0
            q, k = rope(q, cfg.theta), rope(k, cfg.theta)
            if not dms.separate:
                q[:, ::group, -1] = 0
            marked = torch.zeros(cfg.groups, seq, dtype=torch.bool)
            marked[:, :-1] = (logit[1:] > 0).T  # logit_{j+1} marks key j
            if marks is not None:
                marks.append(marked)
            distance = torch.arange(seq)[:, None] - torch.arange(seq)[None]
            visible &= ~(marked[:, None, :] & (distance > dms.window)[None])
        else:
            q, k = rope(q, cfg.theta), rope(k, cfg.theta)
        out = torch.zeros(seq, cfg.heads, d, dtype=torch.float64)
        for head in range(cfg.heads):
            g = head // group
            scores = q[:, head] @ k[:, g].T / d ** 0.5
            scores = scores.masked_fill(~visible[g], float("-inf"))
            out[:, head] = torch.softmax(scores, -1) @ v[:, g]
        x = x + out.reshape(seq, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"], cfg.eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return rms(x, w["model.norm.weight"], cfg.eps) @ head.T


def megatron_to_hf_names(state: dict, cfg: RefConfig) -> dict:
    """A megatron GPTModel state dict (TP = 1) in HF names, split by plain reshapes: fused QKV
    rows are ``[q_1 .. q_G, k, v]`` per KV group, ``linear_fc1 = [gate; up]``."""
    group, d = cfg.heads // cfg.groups, cfg.head_dim
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["decoder.final_layernorm.weight"]}
    if "output_layer.weight" in state:
        out["lm_head.weight"] = state["output_layer.weight"]
    layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("decoder.layers."))
    for i in range(layers):
        s, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = state[s + "self_attention.linear_qkv.weight"]
        qkv = qkv.reshape(cfg.groups, group + 2, d, -1)
        out[p + "self_attn.q_proj.weight"] = qkv[:, :group].reshape(cfg.heads * d, -1)
        out[p + "self_attn.k_proj.weight"] = qkv[:, group].reshape(cfg.groups * d, -1)
        out[p + "self_attn.v_proj.weight"] = qkv[:, group + 1].reshape(cfg.groups * d, -1)
        out[p + "self_attn.o_proj.weight"] = state[s + "self_attention.linear_proj.weight"]
        out[p + "input_layernorm.weight"] = state[s + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = state[s + "pre_mlp_layernorm.weight"]
        gate, up = state[s + "mlp.linear_fc1.weight"].chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = state[s + "mlp.linear_fc2.weight"]
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = state[s + "self_attention.q_layernorm.weight"]
            out[p + "self_attn.k_norm.weight"] = state[s + "self_attention.k_layernorm.weight"]
    return out
