"""Hugging Face ``config.json`` <-> this project's :class:`~dmc.megatron.config.ModelConfig` and
:class:`~dmc.megatron.config.DMCConfig` (the ``dmc_*`` fields of the exported DMC model).
Supported: Llama-family decoders (RMSNorm, SwiGLU, rotate-half RoPE, no
biases), MHA or GQA, tied or untied embeddings, an explicit ``head_dim``, ``rope_theta`` and
Llama 3.x RoPE scaling with megatron-core's fixed low/high frequency factors (1, 4) and original
context (8192); and Qwen3 (``Qwen3ForCausalLM``: Llama plus a per-head RMSNorm of queries and
keys before RoPE, ``ModelConfig.qk_layernorm``), without sliding-window layers or biases.
"""
from __future__ import annotations

from dmc.megatron.config import DMCConfig, ModelConfig

ARCHITECTURE_OF = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}  # by model_type
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_OF.values())
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURE_OF)
# What transformers gives a field that config.json leaves out (LlamaConfig / Qwen3Config
# __init__ defaults, read in transformers 5.23); head_dim None = hidden_size / heads.
HF_DEFAULTS = {
    "llama": {"head_dim": None, "max_position_embeddings": 2048, "num_key_value_heads": None},
    "qwen3": {"head_dim": 128, "max_position_embeddings": 32768, "num_key_value_heads": 32},
}
# megatron-core's Llama 3 scaling hard-codes these (rotary_pos_embedding._apply_scaling)
MCORE_LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
DMC_ARCHITECTURE = "DMCLlamaForCausalLM"
DMC_MODEL_TYPE = "dmc_llama"
DMS_ARCHITECTURE = "DMSLlamaForCausalLM"
DMS_MODEL_TYPE = "dms_llama"


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture or settings this converter cannot map exactly."""


def _rope_settings(cfg: dict, source: str) -> tuple[float, float | None]:
    """``(rotary_base, llama3 scaling factor or None)`` from either config style, read as
    transformers 5 reads it (``PreTrainedConfig.convert_rope_params_to_dict``): the RoPE
    parameters are ``rope_scaling`` when set, else ``rope_parameters`` (transformers 4 wrote
    only ``rope_scaling`` + ``rope_theta``), and ``rope_theta`` comes from those parameters,
    else from the top level, else 10000 (both configs' default)."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(scaling, dict):
        raise UnsupportedModelError(
            f"{source}: rope_scaling / rope_parameters must be an object "
            f"{{\"rope_type\": ..., ...}} or null, got {scaling!r}")
    theta = scaling.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"{source}: rope type {rope_type!r} is not supported; accepted: default, llama3")
    for key, want in MCORE_LLAMA3_SCALING.items():
        if float(scaling.get(key, want)) != want:
            raise UnsupportedModelError(
                f"{source}: llama3 rope scaling needs {key}={want} (megatron-core's fixed value), "
                f"got {scaling.get(key)}")
    return float(theta), float(scaling["factor"])


def _field(cfg: dict, model_type: str, key: str):
    """``cfg[key]``, or transformers' default for ``model_type`` (:data:`HF_DEFAULTS`) when
    config.json leaves the field out."""
    return cfg[key] if key in cfg else HF_DEFAULTS[model_type][key]


def model_config_from_hf(cfg: dict, source: str = "config.json") -> ModelConfig:
    """The :class:`ModelConfig` of a HF Llama or Qwen3 ``config.json`` dict; raises
    :class:`UnsupportedModelError` naming the field for anything that would not convert exactly.
    Fields left out read as transformers reads them (:data:`HF_DEFAULTS`, ``rms_norm_eps``
    1e-6). ``kv_channels`` is set only where ``head_dim`` differs from ``hidden_size / heads``."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURE_OF or (archs and archs[0] != ARCHITECTURE_OF[model_type]):
        raise UnsupportedModelError(
            f"{source}: architecture {archs or model_type!r} is not supported; accepted: "
            f"{list(SUPPORTED_ARCHITECTURES)} (model_type {list(SUPPORTED_MODEL_TYPES)})")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size", "vocab_size") if k not in cfg]
    if missing:
        raise UnsupportedModelError(f"{source}: missing fields {missing}")
    checks = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,),
              "pretraining_tp": (1,), "use_sliding_window": (False,)}
    for key, accepted in checks.items():
        if key in cfg and cfg[key] not in accepted:
            raise UnsupportedModelError(
                f"{source}: {key}={cfg[key]!r} is not supported; accepted: {list(accepted)}")
    other_layers = sorted(set(cfg.get("layer_types") or []) - {"full_attention"})
    if other_layers:
        raise UnsupportedModelError(f"{source}: layer_types {other_layers} are not supported; "
                                    f"accepted: ['full_attention']")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = _field(cfg, model_type, "head_dim")
    if head_dim is None and hidden % heads:
        raise UnsupportedModelError(
            f"{source}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
            f"and head_dim is not given")
    groups = _field(cfg, model_type, "num_key_value_heads") or heads
    if heads % groups:
        default = "" if "num_key_value_heads" in cfg else f" (transformers' {model_type} default)"
        raise UnsupportedModelError(
            f"{source}: num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={groups}{default}")
    theta, scaling = _rope_settings(cfg, source)
    return ModelConfig(
        num_layers=cfg["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=groups, ffn_hidden_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_seq_length=_field(cfg, model_type, "max_position_embeddings"),
        rotary_base=theta, norm_epsilon=cfg.get("rms_norm_eps", 1e-6),  # LlamaConfig's default
        share_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling_factor=scaling, qk_layernorm=model_type == "qwen3",
        kv_channels=None if head_dim in (None, hidden // heads) else int(head_dim))


def hf_config_from_model_config(model: ModelConfig, dtype: str, dmc: DMCConfig | None = None,
                                dmc_extra: dict | None = None,
                                token_ids: dict | None = None) -> dict:
    """A ``config.json`` dict: ``LlamaForCausalLM`` or, with ``model.qk_layernorm``,
    ``Qwen3ForCausalLM`` (``dmc`` None), the exported DMC model
    (:class:`dmc.convert.hf_modeling_dmc.DMCLlamaConfig`: ``dmc``'s settings as its ``dmc_*``
    fields, ``dmc_merge_delay`` only under delayed merging) or, for ``dmc.method == "dms"``,
    the exported DMS model
    (:class:`dmc.convert.hf_modeling_dms.DMSLlamaConfig`: ``dms_window``, ``dms_c``,
    ``dms_logit_scale``, ``dms_channel``, and ``dms_decision`` for adapter decisions), plus
    ``dmc_extra``, e.g. the target and measured CR
    and ``auto_map``. The exported DMC / DMS models of a model with ``qk_layernorm`` or
    ``kv_channels`` also get ``qk_norm`` and ``head_dim`` (absent otherwise, as before).
    ``token_ids``: the shipped tokenizer's ``bos_token_id`` / ``eos_token_id`` /
    ``pad_token_id`` (:func:`dmc.convert.to_hf.special_token_ids`), written as they are:
    ``PretrainedConfig`` fields that ``GenerationConfig.from_model_config`` copies, so that
    ``generate()`` stops at the end-of-sequence token."""
    heads = model.num_attention_heads
    cfg = {
        "hidden_size": model.hidden_size, "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers, "num_attention_heads": heads,
        "num_key_value_heads": model.kv_heads, "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_seq_length, "rms_norm_eps": model.norm_epsilon,
        "rope_theta": model.rotary_base, "tie_word_embeddings": model.share_embeddings,
        "torch_dtype": dtype, "use_cache": True, **(token_ids or {}),
    }
    scaling = model.rope_scaling_factor
    llama3 = None if scaling is None else dict(MCORE_LLAMA3_SCALING, factor=scaling)
    if dmc is None:
        model_type = "qwen3" if model.qk_layernorm else "llama"
        cfg.update(architectures=[ARCHITECTURE_OF[model_type]], model_type=model_type,
                   hidden_act="silu", attention_bias=False, head_dim=model.head_dim)
        if model.qk_layernorm:
            cfg.update(use_sliding_window=False, sliding_window=None,
                       max_window_layers=model.num_layers,
                       layer_types=["full_attention"] * model.num_layers)
        else:
            cfg["mlp_bias"] = False
        if llama3 is not None:
            cfg["rope_scaling"] = dict(llama3, rope_type="llama3")
        return cfg
    if model.qk_layernorm or model.kv_channels is not None:
        cfg.update(qk_norm=model.qk_layernorm, head_dim=model.head_dim)
    if dmc.method == "dms":
        cfg.update(architectures=[DMS_ARCHITECTURE], model_type=DMS_MODEL_TYPE,
                   rope_llama3_scaling=llama3, dms_window=dmc.dms_window, dms_c=dmc.c,
                   dms_logit_scale=dmc.dms_logit_scale, dms_channel="last", **(dmc_extra or {}))
        if dmc.dms_decision != "query":
            cfg["dms_decision"] = dmc.dms_decision
        return cfg
    cfg.update(architectures=[DMC_ARCHITECTURE], model_type=DMC_MODEL_TYPE,
               rope_llama3_scaling=llama3, dmc_window=dmc.window, dmc_c=dmc.c,
               dmc_omega_offset=dmc.omega_offset, dmc_channel="last", **(dmc_extra or {}))
    if dmc.merge_delay:
        cfg["dmc_merge_delay"] = dmc.merge_delay
    return cfg
