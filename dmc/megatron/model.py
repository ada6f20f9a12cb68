"""Building Llama-family GPT models on megatron-core (vanilla, GQA or DMC): the model factories.

:func:`build_model` makes the model a :class:`~dmc.megatron.config.ModelConfig` describes (the
trainer, loading, conversion and the baselines call it); :func:`build_model_from_config` also
takes the configs as the dicts that checkpoints and inference files record.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from dmc.megatron.compat import CPU_CONFIG_OVERRIDES, cuda_available
from dmc.megatron.config import DMCConfig, ModelConfig
from dmc.megatron.layer_spec import dmc_layer_spec, vanilla_layer_spec
from dmc.megatron.parallel import initialize_parallel
from dmc.megatron.runtime import DMCRuntime

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def llama_transformer_config(
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    ffn_hidden_size: int,
    num_query_groups: int | None = None,
    norm_epsilon: float = 1e-5,
    params_dtype: torch.dtype = torch.float32,
    init_method_std: float = 0.02,
    **overrides,
) -> TransformerConfig:
    """A Llama-style :class:`TransformerConfig` (RMSNorm, SwiGLU, no biases, no dropout).

    Tensor/pipeline sizes come from megatron's initialised parallel state. Without CUDA the
    CUDA-only fusions are turned off and weights are initialised on the CPU.
    """
    kwargs = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups or num_attention_heads,
        ffn_hidden_size=ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=init_method_std,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=params_dtype,
    )
    if not cuda_available():
        kwargs.update(CPU_CONFIG_OVERRIDES)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(
    config: TransformerConfig,
    vocab_size: int,
    max_seq_length: int,
    dmc: DMCRuntime | None = None,
    rotary_base: float = 10000.0,
    share_embeddings: bool = False,
    backend: str = "local",
    rope_scaling_factor: float | None = None,
) -> GPTModel:
    """A GPTModel for this pipeline stage; DMC attention when ``dmc`` is given.
    ``rope_scaling_factor``: Llama 3.x RoPE frequency scaling (None = plain RoPE). The layer spec
    has per-head q/k RMSNorms when ``config.qk_layernorm`` is set (Qwen3)."""
    qk_norm = bool(config.qk_layernorm)
    spec = (dmc_layer_spec(dmc, backend, qk_layernorm=qk_norm) if dmc is not None
            else vanilla_layer_spec(backend, qk_layernorm=qk_norm))
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=share_embeddings,
        position_embedding_type="rope",
        rotary_base=rotary_base,
        rope_scaling=rope_scaling_factor is not None,
        rope_scaling_factor=8.0 if rope_scaling_factor is None else rope_scaling_factor,
    )
    _cast_parameters(model, config.params_dtype)
    if cuda_available():
        model = model.cuda()
    return model


def _cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every parameter in ``dtype``, as megatron's ``Float16Module`` leaves a bf16/fp16 model:
    the local spec's RMSNorm (``torch.nn.RMSNorm``) ignores ``params_dtype`` and makes float32
    weights, which megatron's bf16 optimizer keeps apart from the bf16 ones, and its sharded
    state dict then maps optimizer states to the wrong parameters (seen on an H200: "Param id 10
    does not match any model sharded param" at the first checkpoint). Buffers (the float64
    compression counters) keep their dtype."""
    for param in model.parameters():
        if param.dtype != dtype:
            param.data = param.data.to(dtype)


def build_model(model: ModelConfig, dmc: DMCRuntime | None = None,
                params_dtype: torch.dtype | None = None, **overrides) -> GPTModel:
    """The GPTModel (this pipeline stage) ``model`` describes; DMC attention when ``dmc`` is
    given. ``params_dtype`` overrides ``model.params_dtype``; ``overrides`` are
    :class:`TransformerConfig` fields (e.g. ``add_qkv_bias=True``). ``model.vocab_size`` must
    be set. ``model.qk_layernorm`` and ``model.kv_channels`` become the TransformerConfig fields
    of the same names (megatron-core then normalises each query and key head before RoPE, in
    ``SelfAttention.get_query_key_value_tensors``). The TransformerConfig is the returned
    model's ``config``."""
    if model.vocab_size is None:
        raise ValueError("build_model: model.vocab_size is None; set it (e.g. from the data)")
    dtype = params_dtype or DTYPES[model.params_dtype or "float32"]
    config = llama_transformer_config(
        model.num_layers, model.hidden_size, model.num_attention_heads, model.ffn_hidden_size,
        num_query_groups=model.num_query_groups, norm_epsilon=model.norm_epsilon,
        params_dtype=dtype, init_method_std=model.init_method_std,
        **{"qk_layernorm": model.qk_layernorm, "kv_channels": model.head_dim, **overrides})
    return build_gpt_model(config, model.vocab_size, model.max_seq_length, dmc=dmc,
                           rotary_base=model.rotary_base, share_embeddings=model.share_embeddings,
                           rope_scaling_factor=model.rope_scaling_factor)


def build_model_from_config(model_config: ModelConfig | dict,
                            dmc_config: DMCConfig | dict | None = None, **overrides) -> GPTModel:
    """An eval-ready model (TP = PP = 1 unless megatron's parallel state is already set up)
    from a :class:`ModelConfig` and a :class:`DMCConfig` (a DMC model, its runtime in ``eval``
    mode; None = vanilla), each also accepted as its ``to_dict`` form. ``overrides``: as
    :func:`build_model`. Initialises megatron's parallel state (1 x 1) when it is not yet."""
    model_config, dmc_config = ModelConfig.of(model_config), DMCConfig.of(dmc_config)
    if not parallel_state.model_parallel_is_initialized():
        initialize_parallel(1, 1)
    runtime = None
    if dmc_config is not None:
        runtime = DMCRuntime(dmc_config)
        runtime.set_mode("eval")
    return build_model(model_config, runtime, **overrides)
