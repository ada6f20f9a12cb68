"""The typed model configuration: one :class:`ModelConfig` (the architecture) and one
:class:`DMCConfig` (the DMC settings), shared by training, checkpoints, loading, conversion,
baselines and the Hugging Face config mapping.

Plain Python (no torch, no megatron import), so that ``dmc.training.config`` loads without
torch and ``dmc.inference`` / ``dmc.convert`` use it without importing ``dmc.training``.
``to_dict`` gives what checkpoints, inference files and reports record; ``from_dict`` reads it
back, dicts written by older versions (fewer fields) included. A bad value raises
:class:`ConfigError` naming the field and the accepted values.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from dataclasses import dataclass

METHODS = ("dmc", "dms")
DMS_DECISIONS = ("query", "adapter")  # where DMS reads its eviction logit
DMS_ONLY = ("method", "dms_window", "dms_logit_scale", "dms_decision")  # a DMC model omits them
PRIORS = ("global", "local")  # dmc.ops.PRIORS, spelled out to keep torch unimported
CR_LOSS_GRADS = ("model", "decisions")
ATTENTION_BACKENDS = ("auto", "dense", "flex", "flex-transposed", "flex-channel")
ACCUMULATE_BACKENDS = ("auto", "torch", "triton")
# the DMC fields with a fixed set of values (besides ``method``), checked by DMCConfig
DMC_CHOICES = {"prior": PRIORS, "attention_backend": ATTENTION_BACKENDS,
               "accumulate_backend": ACCUMULATE_BACKENDS, "cr_loss_grad": CR_LOSS_GRADS}
PARAMS_DTYPES = ("float32", "bfloat16", "float16")
# ModelConfig fields that to_dict leaves out at these (default) values
OPTIONAL_MODEL_FIELDS = {"params_dtype": None, "qk_layernorm": False, "kv_channels": None}


class ConfigError(ValueError):
    """A bad configuration key or value (the CLI exits with status 2)."""


def check_type(key: str, value, hint):
    """``value`` as the annotated type ``hint`` (``int``, ``float``, ``bool``, ``str``, or one
    of them ``| None``): an integral float becomes an int, an integer or a numeric string a
    float; anything else (a bool for a number, a string for a bool, NaN) raises ConfigError
    naming ``key``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if value is None:
        raise ConfigError(f"{key}: null is not allowed (expected {hint.__name__})")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{key}: expected a finite number, got {value!r}")
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {hint}")


def _check_field_types(config, section: str) -> None:
    """Each field of the dataclass instance ``config`` through :func:`check_type`, in place."""
    for name, hint in typing.get_type_hints(type(config)).items():
        setattr(config, name, check_type(f"{section}.{name}", getattr(config, name), hint))


def _fields_from(cls, values: dict, what: str) -> dict:
    """``values`` as keyword arguments of ``cls``; an unknown key is a ConfigError."""
    if not isinstance(values, dict):
        raise ConfigError(f"{what}: expected a mapping, got {values!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"unknown key {what}.{unknown[0]}; accepted keys under {what}: "
                          f"{', '.join(sorted(names))}")
    return dict(values)


@dataclass
class ModelConfig:
    """Llama-family architecture. ``vocab_size`` None = taken from the prepared data (training
    only; a saved model records it). ``num_query_groups`` None = one per attention head.
    ``rope_scaling_factor``: Llama 3.x RoPE frequency scaling (None = off). ``params_dtype``: the
    dtype the weights are stored in (None = float32; training sets it from ``precision``).
    ``qk_layernorm``: a per-head RMSNorm on queries and keys after the projection and before RoPE
    (Qwen3's ``q_norm`` / ``k_norm``). ``kv_channels``: the head dimension (megatron-core's name;
    None = ``hidden_size // num_attention_heads``; Qwen3 sets it explicitly, e.g. 128 for a
    1024-wide model with 16 heads)."""

    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 8
    num_query_groups: int | None = None
    ffn_hidden_size: int = 688
    vocab_size: int | None = None
    max_seq_length: int = 4096
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    share_embeddings: bool = False
    rope_scaling_factor: float | None = None
    params_dtype: str | None = None
    qk_layernorm: bool = False
    kv_channels: int | None = None

    def __post_init__(self):
        _check_field_types(self, "model")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "max_seq_length", "rotary_base", "norm_epsilon", "num_query_groups",
                     "vocab_size", "init_method_std"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"model.{name}: must be > 0, got {value!r}")
        if self.rope_scaling_factor is not None and self.rope_scaling_factor < 1:
            raise ConfigError(f"model.rope_scaling_factor: must be null (no RoPE scaling) or "
                              f">= 1, got {self.rope_scaling_factor!r}")
        if self.kv_channels is not None:
            if (not isinstance(self.kv_channels, int) or self.kv_channels <= 0
                    or self.kv_channels % 2):
                raise ConfigError(f"model.kv_channels: must be null or an even integer > 0 "
                                  f"(RoPE rotates channel pairs), got {self.kv_channels!r}")
        elif self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.num_attention_heads ({self.num_attention_heads})")
        if self.num_attention_heads % self.kv_heads:
            raise ConfigError(
                f"model.num_query_groups ({self.kv_heads}) must divide "
                f"model.num_attention_heads ({self.num_attention_heads})")
        if self.params_dtype is not None and self.params_dtype not in PARAMS_DTYPES:
            raise ConfigError(f"model.params_dtype: {self.params_dtype!r} is not one of "
                              f"{', '.join(PARAMS_DTYPES)}")

    @property
    def kv_heads(self) -> int:
        """KV heads (query groups) per layer."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Channels per attention head: ``kv_channels``, else ``hidden_size // heads``."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        """The fields as a plain dict; ``params_dtype``, ``qk_layernorm`` and ``kv_channels``
        only when not at their defaults, so dicts (and their hashes) of models without them
        read as before those fields existed."""
        out = dataclasses.asdict(self)
        for name, default in OPTIONAL_MODEL_FIELDS.items():
            if out[name] == default:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        return cls(**_fields_from(cls, values, "model"))

    @classmethod
    def of(cls, value: ModelConfig | dict) -> ModelConfig:
        """``value`` itself, or :meth:`from_dict` of a dict (APIs that take either)."""
        return cls.from_dict(value) if isinstance(value, dict) else value


@dataclass
class DMCConfig:
    """Static DMC settings (defaults: Sec. 4 of the paper and NVIDIA's recipe).

    method: "dmc" (Dynamic Memory Compression: append or merge) or "dms" (Dynamic Memory
        Sparsification, Łańcucki et al. 2025: a token marked for eviction stays visible for
        ``dms_window`` more tokens, then is dropped). The decision, noise, hard/soft and CR-loss
        settings below apply to both; ``window``, ``omega_offset`` only to DMC.
    dms_window: DMS's eviction delay w (NVIDIA Model-Optimizer's ``dms_window_size``, 512; scale
        it down with the context of a small model).
    dms_logit_scale: DMS's eviction logit is ``q[..., -1] * dms_logit_scale - c`` (NVIDIA's
        ``dms_alpha_scale``, 100; :func:`dmc.ops.split_dms_channels`).
    dms_decision: where DMS reads that logit: "query" (the borrowed query channel above, DMS
        paper Sec. 3.1) or "adapter" (a separate linear map of the attention input to one
        logit per KV head, ``decision_proj``, times ``dms_logit_scale`` minus ``c``; the query
        keeps every channel: NVIDIA Model-Optimizer's ``dms_separate_alpha: true``,
        :class:`dmc.megatron.dms_attention.DMSSelfAttention`). ``to_dict`` leaves out "query".
    window: partial-accumulation window w (None = exact scan; 12 in the paper).
    tau: Gumbel-sigmoid temperature. c: decision/importance offset.
    hard: straight-through hard decisions in training, in the attention (mask and accumulation)
        and in the loss (soft relaxation otherwise, as in the paper).
    hard_loss: straight-through hard decisions in the CR loss only, soft ones in the attention:
        NVIDIA's released training code (``hard=False, hard_loss=True``). Off: the paper's
        soft relaxation.
    prior: "global" (Eq. 10: one hinge over all layers) or "local" (App. G: one per layer).
    head_cr_cap: None (the paper) or the largest CR one KV head may reach before a second hinge
        pushes it back (:func:`dmc.ops.head_cap_loss_from_sums`, not in the paper). A training
        setting, not part of the model (``to_dict`` leaves it out).
    head_balance_weight: 0 (DMC) or the weight of DMC-C's balance term (App. E, Eq. 13 with the
        mean over heads: :func:`dmc.ops.head_balance_loss`), added to Eq. 10 so that the heads
        of a layer compress alike (the paper's "constrained" variant, which lets a cache store
        a layer's heads as padded tensors). Measured on the 4-layer benchmark model
        (docs/results/ablations.md "Ablations of DMC 4x"): at 1 no head merges, 0.05-0.25 track the
        target. A training setting (``to_dict`` leaves it out).
    cr_loss_grad: where the CR loss's gradient goes. "model" (the paper and NVIDIA's code): through
        k[..., -1] into every weight below it. "decisions" (not in the paper): only into the
        decision rows of ``linear_qkv`` (the layer input is detached on the loss's path; forward
        values unchanged), so the hinge cannot bend the rest of the model while the decisions
        lag the target (docs/results/ablations.md "Ablations of DMC 4x"); DMC with the local layer
        spec and no q/k norm only. A training setting (``to_dict`` leaves it out).
    omega_offset: added to omega = sigmoid(q[..., -1] + c); 2^-7 reproduces NVIDIA's models
        (see :func:`dmc.ops.importance`), 0 is the paper's.
    attention_backend: "auto" (on CUDA flex-channel for DMC, flex-transposed for DMS; dense on
        CPU), "dense", "flex", "flex-transposed" (FlexAttention with the decisions' gradient
        through the mask from a swapped forward instead of atomic adds) or "flex-channel" (that
        gradient from FlexAttention's own key gradient in DMC's zeroed decision channel: no
        second pass; DMC only), :mod:`dmc.ops.flex_bias_grad`: how the training attention is
        computed, not part of the model (``to_dict`` leaves it out).
    accumulate_backend: "auto" (Triton on CUDA, PyTorch elsewhere), "torch" or "triton": how
        the training forward computes Eq. 9's window-grouped sums (the PyTorch path
        :func:`dmc.ops.accumulate.windowed_accumulate`, or the fused kernels of
        :mod:`dmc.megatron.window_sum_kernels`; "triton" on the CPU needs
        ``TRITON_INTERPRET=1``), in training and in the engine's prefill; not part of the model
        (``to_dict`` leaves it out).
    compile_elementwise: ``torch.compile`` the elementwise math of a train or eval forward
        (the decisions from their channels, Eq. 8 with App. H's log(1 - alpha), and RoPE
        without the decision channels; :meth:`dmc.megatron.attention.DMCSelfAttention._fused`),
        some thirty small operations a layer fused into a few kernels on CUDA, with values equal
        to rounding (not bit for bit: the fused kernels round once, at their end). Compiled at
        the first forward (seconds; once more, as dynamic, where a shape changes); a C++
        compiler is needed on the CPU. Not part of the model (``to_dict`` leaves it out); off
        by default until a GPU run measures it (``benchmarks/train_step.py --compile``).
    merge_delay: 0 (the paper's DMC) or d >= 1: DMC with delayed merging, not in the paper
        (DMS's delayed eviction carried over to DMC; docs/results/merge_delay.md "DMC with delayed
        merging"): a query sees its last d + 1 tokens as they are and the earlier ones through the
        merged slots (:func:`dmc.ops.delayed_merge_bias`). The paged engine serves it
        (:class:`dmc.inference.delayed_cache.DelayedMergeCache`) and the Hugging Face export carries
        it (``dmc_merge_delay``). ``to_dict`` leaves out 0.
    """

    window: int | None = 12
    tau: float = 0.1
    c: float = 5.0
    hard: bool = False
    hard_loss: bool = False
    prior: str = "global"
    head_cr_cap: float | None = None
    head_balance_weight: float = 0.0
    cr_loss_grad: str = "model"
    omega_offset: float = 0.0
    attention_backend: str = "auto"
    accumulate_backend: str = "auto"
    compile_elementwise: bool = False
    method: str = "dmc"
    dms_window: int = 512
    dms_logit_scale: float = 100.0
    dms_decision: str = "query"
    merge_delay: int = 0

    def __post_init__(self):
        _check_field_types(self, "dmc")
        if self.method not in METHODS:
            raise ConfigError(f"dmc.method: {self.method!r} is not one of {', '.join(METHODS)}")
        if self.dms_decision not in DMS_DECISIONS:
            raise ConfigError(f"dmc.dms_decision: {self.dms_decision!r} is not one of "
                              f"{', '.join(DMS_DECISIONS)}")
        if self.dms_decision != "query" and self.method != "dms":
            raise ConfigError(f"dmc.dms_decision: {self.dms_decision!r} needs dmc.method: dms "
                              f"(DMC reads its decisions from the borrowed channels: query)")
        if not isinstance(self.dms_window, int) or self.dms_window < 0:
            raise ConfigError(f"dmc.dms_window: must be an integer >= 0, got {self.dms_window!r}")
        if not isinstance(self.merge_delay, int) or self.merge_delay < 0:
            raise ConfigError(f"dmc.merge_delay: must be an integer >= 0 (0 = the paper's DMC), "
                              f"got {self.merge_delay!r}")
        if self.merge_delay and self.method != "dmc":
            raise ConfigError(f"dmc.merge_delay: needs dmc.method: dmc (DMS delays its "
                              f"evictions with dmc.dms_window), got {self.method!r}")
        if self.dms_logit_scale <= 0:
            raise ConfigError(f"dmc.dms_logit_scale: must be > 0, got {self.dms_logit_scale!r}")
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ConfigError(f"dmc.window: must be null or >= 1, got {self.window!r}")
        if self.tau <= 0:
            raise ConfigError(f"dmc.tau: must be > 0, got {self.tau!r}")
        if self.head_cr_cap is not None and not self.head_cr_cap > 1:
            raise ConfigError(f"dmc.head_cr_cap: must be null or > 1, got {self.head_cr_cap!r}")
        if not self.head_balance_weight >= 0:
            raise ConfigError(f"dmc.head_balance_weight: must be >= 0 (0 = off), got "
                              f"{self.head_balance_weight!r}")
        if self.omega_offset < 0:
            raise ConfigError(f"dmc.omega_offset: must be >= 0, got {self.omega_offset!r}")
        if self.attention_backend == "flex-channel" and self.method != "dmc":
            raise ConfigError(f"dmc.attention_backend: 'flex-channel' needs dmc.method: dmc (it "
                              f"reads the gradient from the keys' zeroed decision channel, "
                              f"which DMS keys do not have), got {self.method!r}")
        if self.cr_loss_grad == "decisions" and self.method != "dmc":
            raise ConfigError(f"dmc.cr_loss_grad: 'decisions' needs dmc.method: dmc, got "
                              f"{self.method!r}")
        for name, choices in DMC_CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(f"dmc.{name}: {getattr(self, name)!r} is not one of "
                                  f"{', '.join(choices)}")

    def to_dict(self) -> dict:
        """The settings that define the model (what checkpoints and inference files record).
        A DMC model's dict leaves out the DMS fields (and ``method``), so it reads as it did
        before DMS existed, and a DMS model's leaves out ``dms_decision`` at "query", so it
        reads as before that field existed; :meth:`from_dict` restores the defaults."""
        skip = {"attention_backend", "accumulate_backend", "compile_elementwise", "head_cr_cap",
                "head_balance_weight", "cr_loss_grad"}
        if self.method != "dms":
            skip |= set(DMS_ONLY)
        if self.dms_decision == "query":
            skip.add("dms_decision")
        if not self.merge_delay:
            skip.add("merge_delay")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(DMCConfig)
                if f.name not in skip}

    @classmethod
    def from_dict(cls, values: dict) -> DMCConfig:
        """From :meth:`to_dict` or any subset of the fields (the rest keep their defaults);
        ``seed``, which inference files written before 2026-11-23 record, is the noise seed of
        a training run (:class:`dmc.megatron.runtime.DMCRuntime`), not a model setting."""
        values = {k: v for k, v in values.items() if k != "seed"}
        return cls(**_fields_from(cls, values, "dmc"))

    @classmethod
    def of(cls, value: DMCConfig | dict | None) -> DMCConfig | None:
        """``value`` itself (None: a vanilla model), or :meth:`from_dict` of a dict."""
        return cls.from_dict(value) if isinstance(value, dict) else value
