"""Layer specs: vanilla (MHA or GQA, the GQA baseline included), DMC and DMS.

``backend="local"`` uses megatron-core's own modules (CPU and GPU) with a fused causal core
attention (:mod:`dmc.megatron.core_attention`); ``backend="te"`` uses
Transformer Engine's (GPU, optional extra). The DMC spec only swaps the self-attention module
for :class:`~dmc.megatron.attention.DMCSelfAttention` (``dmc.method: dmc``) or
:class:`~dmc.megatron.dms_attention.DMSSelfAttention` (``dmc.method: dms``) and hands it the
shared runtime.
"""
from __future__ import annotations

import copy

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from dmc.megatron.attention import DMCSelfAttention
from dmc.megatron.core_attention import use_sdpa
from dmc.megatron.dms_attention import DMSSelfAttention
from dmc.megatron.runtime import DMCRuntime

BACKENDS = ("local", "te")
ATTENTION_CLASSES = {"dmc": DMCSelfAttention, "dms": DMSSelfAttention}  # by dmc.method


def vanilla_layer_spec(backend: str = "local", qk_layernorm: bool = False) -> ModuleSpec:
    """Llama-style layer (RMSNorm, SwiGLU MLP, RoPE attention); MHA or GQA follows
    ``num_query_groups`` of the transformer config. ``qk_layernorm``: per-head RMSNorm of
    queries and keys before RoPE (Qwen3's ``q_norm`` / ``k_norm``; megatron-core's
    ``q_layernorm`` / ``k_layernorm`` submodules, the config's ``normalization``)."""
    if backend == "local":
        return use_sdpa(get_gpt_layer_local_spec(normalization="RMSNorm",
                                                 qk_layernorm=qk_layernorm))
    if backend == "te":
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    raise ValueError(f"layer spec backend must be one of {BACKENDS}, got {backend!r}")


def gqa_layer_spec(backend: str = "local", qk_layernorm: bool = False) -> ModuleSpec:
    """The up-trained GQA baseline is a vanilla model with fewer query groups."""
    return vanilla_layer_spec(backend, qk_layernorm)


def dmc_layer_spec(runtime: DMCRuntime, backend: str = "local",
                   qk_layernorm: bool = False) -> ModuleSpec:
    """The vanilla spec with the attention of ``runtime.config.method``
    (:data:`ATTENTION_CLASSES`); every layer built from it shares ``runtime`` (one runtime per
    model). With ``qk_layernorm`` the decision channel is read after the q/k norm (and before
    RoPE), since the attention classes take q, k, v from ``get_query_key_value_tensors``."""
    spec = copy.deepcopy(vanilla_layer_spec(backend, qk_layernorm))
    attention = spec.submodules.self_attention
    attention.module = ATTENTION_CLASSES[runtime.config.method]
    attention.params = {"attn_mask_type": AttnMaskType.causal, "dmc": runtime}
    return spec
