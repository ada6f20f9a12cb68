"""Tensor mapping between Hugging Face Llama / Qwen3 weights and megatron-core GPTModel weights
(TP = 1).

Fused QKV (megatron-core): rows grouped per query group, ``[q_1 .. q_G, k, v]`` with ``head_dim``
rows each (G = heads / groups; ``head_dim`` is ``ModelConfig.head_dim``, which Qwen3 may set
apart from hidden / heads); ``linear_fc1 = cat([gate, up])``. Names::

    model.embed_tokens                          embedding.word_embeddings
    model.layers.i.input_layernorm              decoder.layers.i.input_layernorm
    model.layers.i.self_attn.{q,k,v}_proj       decoder.layers.i.self_attention.linear_qkv
    model.layers.i.self_attn.o_proj             decoder.layers.i.self_attention.linear_proj
    model.layers.i.self_attn.{q,k}_norm         decoder.layers.i.self_attention.{q,k}_layernorm
                                                (Qwen3: ``qk_layernorm``; ``[head_dim]`` each)
    model.layers.i.self_attn.dms_decision_proj  decoder.layers.i.self_attention.decision_proj
                                                (DMS adapter decisions; ``[kv_heads, hidden]``)
    model.layers.i.post_attention_layernorm     decoder.layers.i.pre_mlp_layernorm
    model.layers.i.mlp.{gate,up}_proj           decoder.layers.i.mlp.linear_fc1
    model.layers.i.mlp.down_proj                decoder.layers.i.mlp.linear_fc2
    model.norm                                  decoder.final_layernorm
    lm_head                                     output_layer (absent when tied)
"""
from __future__ import annotations

import torch

from dmc.megatron.config import ModelConfig

IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
QK_NORMS = (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm"))  # (HF, megatron) names
DECISION_PROJ = ("self_attn.dms_decision_proj.weight", "self_attention.decision_proj.weight")


def fuse_qkv(q, k, v, heads: int, groups: int) -> torch.Tensor:
    """``q [heads * d, H]``, ``k, v [groups * d, H]`` -> ``[(heads + 2 * groups) * d, H]``."""
    dim = q.shape[0] // heads
    hidden = q.shape[1]
    q = q.reshape(groups, heads // groups, dim, hidden)
    k = k.reshape(groups, 1, dim, hidden)
    v = v.reshape(groups, 1, dim, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def split_qkv(qkv, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    per_group = heads // groups + 2
    dim = qkv.shape[0] // (groups * per_group)
    grouped = qkv.reshape(groups, per_group, dim, qkv.shape[1])
    q = grouped[:, :-2].reshape(heads * dim, -1)
    k = grouped[:, -2].reshape(groups * dim, -1)
    v = grouped[:, -1].reshape(groups * dim, -1)
    return q, k, v


def _take(state: dict, name: str, source: str) -> torch.Tensor:
    if name not in state:
        raise KeyError(f"{source}: tensor {name!r} is missing")
    return state.pop(name)


def hf_to_mcore_state(hf: dict, model_config: ModelConfig, source: str = "HF checkpoint") -> dict:
    """Full megatron state dict from a HF Llama state dict (consumed). Unknown or missing tensors
    raise :class:`KeyError`/:class:`ValueError` naming them; shapes are checked against
    ``model_config``."""
    hf = {k: v for k, v in hf.items() if not k.endswith(IGNORED_HF_SUFFIXES)}
    m = model_config
    heads, groups, hidden, dim = m.num_attention_heads, m.kv_heads, m.hidden_size, m.head_dim
    out = {"embedding.word_embeddings.weight": _take(hf, "model.embed_tokens.weight", source)}
    for i in range(m.num_layers):
        p, o = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (_take(hf, f"{p}self_attn.{n}_proj.weight", source) for n in "qkv")
        _check(f"{p}self_attn.k_proj.weight", k, (groups * dim, hidden), source)
        _check(f"{p}self_attn.q_proj.weight", q, (heads * dim, hidden), source)
        out[o + "input_layernorm.weight"] = _take(hf, p + "input_layernorm.weight", source)
        out[o + "self_attention.linear_qkv.weight"] = fuse_qkv(q, k, v, heads, groups)
        out[o + "self_attention.linear_proj.weight"] = _take(hf, p + "self_attn.o_proj.weight",
                                                             source)
        for hf_name, mcore_name in QK_NORMS if m.qk_layernorm else ():
            norm = _take(hf, f"{p}self_attn.{hf_name}.weight", source)
            _check(f"{p}self_attn.{hf_name}.weight", norm, (dim,), source)
            out[f"{o}self_attention.{mcore_name}.weight"] = norm
        if p + DECISION_PROJ[0] in hf:
            proj = _take(hf, p + DECISION_PROJ[0], source)
            _check(p + DECISION_PROJ[0], proj, (groups, hidden), source)
            out[o + DECISION_PROJ[1]] = proj
        out[o + "pre_mlp_layernorm.weight"] = _take(hf, p + "post_attention_layernorm.weight",
                                                    source)
        gate = _take(hf, p + "mlp.gate_proj.weight", source)
        up = _take(hf, p + "mlp.up_proj.weight", source)
        _check(p + "mlp.gate_proj.weight", gate, (m.ffn_hidden_size, hidden), source)
        out[o + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[o + "mlp.linear_fc2.weight"] = _take(hf, p + "mlp.down_proj.weight", source)
    out["decoder.final_layernorm.weight"] = _take(hf, "model.norm.weight", source)
    head = hf.pop("lm_head.weight", None)
    if not m.share_embeddings:
        if head is None:
            raise KeyError(f"{source}: tensor 'lm_head.weight' is missing (tie_word_embeddings "
                           f"is false)")
        out["output_layer.weight"] = head
    if hf:
        raise ValueError(f"{source}: unexpected tensors {sorted(hf)[:8]} (biases or another "
                         f"architecture?)")
    _check("model.embed_tokens.weight", out["embedding.word_embeddings.weight"],
           (m.vocab_size, hidden), source)
    return out


def mcore_to_hf_state(state: dict, model_config: ModelConfig) -> dict:
    """HF Llama (or Qwen3) state dict from a full megatron state dict (``_extra_state`` entries
    ignored)."""
    m = model_config
    heads, groups = m.num_attention_heads, m.kv_heads
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"]}
    for i in range(m.num_layers):
        p, o = f"decoder.layers.{i}.", f"model.layers.{i}."
        q, k, v = split_qkv(state[p + "self_attention.linear_qkv.weight"], heads, groups)
        gate, up = state[p + "mlp.linear_fc1.weight"].chunk(2)
        out.update({
            o + "input_layernorm.weight": state[p + "input_layernorm.weight"],
            o + "self_attn.q_proj.weight": q, o + "self_attn.k_proj.weight": k,
            o + "self_attn.v_proj.weight": v,
            o + "self_attn.o_proj.weight": state[p + "self_attention.linear_proj.weight"],
            o + "post_attention_layernorm.weight": state[p + "pre_mlp_layernorm.weight"],
            o + "mlp.gate_proj.weight": gate, o + "mlp.up_proj.weight": up,
            o + "mlp.down_proj.weight": state[p + "mlp.linear_fc2.weight"],
        })
        for hf_name, mcore_name in QK_NORMS if m.qk_layernorm else ():
            out[f"{o}self_attn.{hf_name}.weight"] = state[f"{p}self_attention.{mcore_name}.weight"]
        if p + DECISION_PROJ[1] in state:
            out[o + DECISION_PROJ[0]] = state[p + DECISION_PROJ[1]]
    out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    if not m.share_embeddings:
        out["lm_head.weight"] = state["output_layer.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _check(name, tensor, shape, source):
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{source}: {name} has shape {tuple(tensor.shape)}, config.json implies "
                         f"{tuple(shape)}")
