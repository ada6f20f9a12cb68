"""NVIDIA's released DMS checkpoints (Hugging Face folders of NVIDIA Model-Optimizer
``experimental/dms``, e.g. ``nvidia/Qwen3-8B-DMS-8x``) -> this project's checkpoint
(``dmc convert nvidia-dms``).

Input: a Qwen3 (or Llama) ``config.json`` with NVIDIA's ``dms_*`` fields
(``models/qwen3/configuration_qwen3_dms.py``) and safetensors (sharded with an index or not)
holding Qwen3's tensor names. In the borrowed-channel mode (``dms_separate_alpha: false``; DMS
paper arXiv 2506.05345 Sec. 3.1, reusing DMC's borrowed neuron) there is no extra tensor: the
eviction logit of KV group g is ``q_norm(q_proj(x))[first query head of g, -1] *
dms_alpha_scale - dms_initial_alpha_offset``, read before RoPE, that channel zeroed before and
after RoPE (``dms/core.py::prepare_attention_input``). That is exactly our
:class:`~dmc.megatron.dms_attention.DMSSelfAttention` on a ``qk_layernorm`` model (the logit is
taken from ``get_query_key_value_tensors``, after ``q_layernorm``), so the weights map as a
plain Qwen3 (:func:`dmc.convert.mapping.hf_to_mcore_state`) and the settings as::

    dms_alpha_scale            -> dmc.dms_logit_scale
    dms_initial_alpha_offset   -> dmc.c
    dms_window_size            -> dmc.dms_window (unchanged, see below)
    dms_tau                    -> dmc.tau
    (training)                 -> dmc.hard = false, dmc.hard_loss = true

Window: in NVIDIA's training mask (``dms/attention.py::dms_attn_train_mode``) key j, marked by
the decision of token j + 1, is penalised only for queries i with ``i - j > dms_window_size``;
its inference cache is built with a window of ``dms_window_size + 1``
(``Qwen3ForCausalLMDMS.get_cache``) and keeps key j visible while ``i < j + window``
(``dms/attention_prefill.py``), i.e. again ``i - j <= dms_window_size``. Ours
(:func:`dmc.ops.mask.bias_from_log_keep` with ``delay = dms_window``) hides a marked key for
``i - j > dms_window``, so the value is copied as is. Decisions in our eval model and engine
are hard (``logit > 0``), as in NVIDIA's cache-based inference.

Separate adapter (``dms_separate_alpha: true``, same ``prepare_attention_input``): per layer
an RMSNorm ``dms_proj_alpha_norm`` (weight ``g_a``, eps ``rms_norm_eps``) and a linear
``dms_proj_alpha`` (``W_a [kv_heads, hidden]``) of the layer input ``h`` (before
``input_layernorm``) give ``logit = dms_proj_alpha(dms_proj_alpha_norm(h)) * dms_alpha_scale -
dms_initial_alpha_offset`` per KV head; the query keeps every channel. Both norms are RMSNorms
of the same ``h`` with the same eps, so ``dms_proj_alpha_norm(h) = input_layernorm(h) * g_a /
g_in`` elementwise and the adapter is one linear map of the attention input with weight
``W_a * (g_a / g_in)`` (:func:`fold_separate_alpha`), our ``decision_proj`` with
``dmc.dms_decision: adapter`` (:class:`~dmc.megatron.dms_attention.DMSSelfAttention`). This
needs ``g_in != 0`` everywhere (else :class:`UnsupportedModelError` naming the layer); the fold
is computed in float64 and rounded once to the checkpoint's dtype.

``hard_loss``: NVIDIA's loss counts straight-through rounded decisions while the attention
uses the soft ones, as for their DMC models. ``dms_cr`` (documentation only upstream) is
recorded as ``target_cr``. Inference-engine settings (``dms_paged_attention_block_size``,
``dms_compile_limit``, ``dms_manual_inference_mode``, ``dms_chunked_prefill``,
``dms_preallocate_for_tokens``) do not change the model and are ignored.

``dms_disable_eviction: true`` (``prepare_attention_input`` computes everything as above and
then replaces the decisions by zeros and their logits by -1000): in the borrowed-channel mode
the first query head of each KV group still loses its last channel before and after RoPE, so
the model is not a vanilla Qwen3; it converts as the same DMS model with ``dmc.c`` =
:data:`NEVER_EVICT_C`, whose logits never reach 0 (checked from the weights:
:func:`check_never_evicts`; :class:`UnsupportedModelError` otherwise), and no ``target_cr``.
Our config has no switch for "decisions off" (``dmc.dms_decision`` is "query" or "adapter"),
and an infinite ``c`` would be written as ``Infinity``, not JSON, into ``state.json`` and an
exported ``config.json``; hence a finite offset. The eval model, the engine and the HF export
then keep every token, as NVIDIA's model does. With ``dms_separate_alpha: true`` the
query keeps every channel and the adapter only feeds the zeroed decisions: that model is a
vanilla Qwen3 (``dmc_config`` None, the adapter dropped). The summary's ``note`` says which.

Rejected (:class:`~dmc.convert.hf_config.UnsupportedModelError`, naming the field):
``dms_alpha_per: "layer"``
(one decision per layer shared by its KV heads), and what :func:`model_config_from_hf`
rejects.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from dmc.convert.from_hf import convert_hf_folder
from dmc.convert.hf_config import UnsupportedModelError, model_config_from_hf
from dmc.convert.hf_io import read_hf_config
from dmc.megatron.config import ConfigError, DMCConfig, ModelConfig

ALPHA_PER_ACCEPTED = ("head",)
SEPARATE_ALPHA_ACCEPTED = (False, True)
ALPHA, ALPHA_NORM = "self_attn.dms_proj_alpha.weight", "self_attn.dms_proj_alpha_norm.weight"
DMS_SUFFIX = "DMS"  # NVIDIA's class names: Qwen3ForCausalLMDMS, Qwen3ConfigDMS
# dmc.c of a dms_disable_eviction model: no logit q * dms_alpha_scale - c reaches 0
NEVER_EVICT_C = 1e9
DISABLED_NOTES = {  # by "converted as vanilla"
    False: f"dms_disable_eviction is true: converted as DMS with c={NEVER_EVICT_C:g}, whose "
           f"decisions never fire (no eviction); the borrowed query channel stays zeroed, as in "
           f"NVIDIA's forward",
    True: "dms_disable_eviction is true: converted as a vanilla model (no eviction; the "
          "separate adapter is dropped)"}


def configs_from_nvidia(cfg: dict, source: str = "config.json"
                        ) -> tuple[ModelConfig, DMCConfig | None]:
    """``(model_config, dmc_config)`` of an NVIDIA DMS ``config.json`` dict; ``dmc_config`` is
    None for a vanilla model (``dms_disable_eviction`` with ``dms_separate_alpha``), and has
    ``c = NEVER_EVICT_C`` for ``dms_disable_eviction`` with the borrowed channel (see the
    module docstring). Raises :class:`UnsupportedModelError` naming the field for what does
    not convert exactly."""
    if "dms_window_size" not in cfg and "dms_alpha_scale" not in cfg:
        raise UnsupportedModelError(
            f"{source}: no dms_window_size / dms_alpha_scale: not an NVIDIA DMS checkpoint "
            f"(convert a plain Hugging Face model with `dmc convert hf-to-mcore`)")
    if cfg.get("dms_separate_alpha", False) not in SEPARATE_ALPHA_ACCEPTED:
        raise UnsupportedModelError(
            f"{source}: dms_separate_alpha={cfg['dms_separate_alpha']!r} is not supported; "
            f"accepted: {list(SEPARATE_ALPHA_ACCEPTED)}")
    if cfg.get("dms_alpha_per", "head") not in ALPHA_PER_ACCEPTED:
        raise UnsupportedModelError(
            f"{source}: dms_alpha_per={cfg['dms_alpha_per']!r} is not supported; accepted: "
            f"{list(ALPHA_PER_ACCEPTED)}")
    archs = [a.removesuffix(DMS_SUFFIX) for a in cfg.get("architectures") or []]
    base = {k: v for k, v in cfg.items() if k not in ("architectures", "auto_map")}
    model_config = model_config_from_hf(dict(base, architectures=archs), source)
    separate = cfg.get("dms_separate_alpha", False)
    disabled = cfg.get("dms_disable_eviction", False)
    if disabled and separate:
        return model_config, None
    offset = NEVER_EVICT_C if disabled else cfg.get("dms_initial_alpha_offset", 5.0)
    try:
        dmc_config = DMCConfig(
            method="dms", dms_window=cfg.get("dms_window_size", 512),
            dms_logit_scale=float(cfg.get("dms_alpha_scale", 100.0)), c=float(offset),
            tau=float(cfg.get("dms_tau", 0.1)), hard=False, hard_loss=True,
            dms_decision="adapter" if separate else "query")
    except ConfigError as err:
        raise UnsupportedModelError(f"{source}: {err} (from the dms_* fields)") from err
    return model_config, dmc_config


def logit_bound(weights: dict, model: ModelConfig, layer: int) -> float:
    """An upper bound of ``|q[first head of a KV group, -1]|`` before RoPE in ``layer``
    (HF names): an RMSNorm output's element is at most ``sqrt(width)`` times its weight's
    (``x_i^2 <= sum x^2``), so with ``q_norm`` it is ``sqrt(head_dim) * |q_norm.weight[-1]|``,
    without it ``sqrt(hidden) * sum_i |q_proj[row, i] * input_layernorm.weight[i]|``."""
    p, d = f"model.layers.{layer}.", model.head_dim
    if model.qk_layernorm:
        return d ** 0.5 * weights[p + "self_attn.q_norm.weight"][-1].double().abs().item()
    group = model.num_attention_heads // model.kv_heads
    rows = torch.arange(model.kv_heads) * group * d + d - 1
    scaled = (weights[p + "self_attn.q_proj.weight"][rows].double()
              * weights[p + "input_layernorm.weight"].double()[None])
    return model.hidden_size ** 0.5 * scaled.abs().sum(-1).max().item()


def check_never_evicts(weights: dict, model: ModelConfig, dmc: DMCConfig, source: str) -> dict:
    """``weights`` unchanged, after checking that no borrowed-channel logit ``q[..., -1] *
    dms_logit_scale - c`` can reach 0 (:func:`logit_bound`, with a factor 2 for rounding in
    low precision), which a ``dms_disable_eviction`` model needs (module docstring)."""
    for i in range(model.num_layers):
        reach = logit_bound(weights, model, i) * dmc.dms_logit_scale
        if 2 * reach >= dmc.c:
            raise UnsupportedModelError(
                f"{source}: dms_disable_eviction=true: layer {i}'s |q[..., -1]| * "
                f"dms_alpha_scale may reach {reach:.3g}, so the offset c={dmc.c:g} cannot keep "
                f"every decision at 0 (accepted: at most c / 2)")
    return weights


def fold_separate_alpha(weights: dict, num_layers: int, source: str,
                        vanilla: bool = False) -> dict:
    """``weights`` (HF names, consumed) with each layer's ``dms_proj_alpha`` and
    ``dms_proj_alpha_norm`` replaced by ``self_attn.dms_decision_proj.weight = W_a * (g_a /
    g_in)[None, :]`` (see the module docstring), in ``W_a``'s dtype; ``vanilla``
    (``dms_disable_eviction``): only removed."""
    for i in range(num_layers):
        p = f"model.layers.{i}."
        missing = [p + n for n in (ALPHA, ALPHA_NORM) if p + n not in weights]
        if missing:
            raise KeyError(f"{source}: dms_separate_alpha is true but tensor {missing[0]!r} "
                           f"is missing")
        w_a, g_a = weights.pop(p + ALPHA), weights.pop(p + ALPHA_NORM)
        if vanilla:
            continue
        g_in = weights[p + "input_layernorm.weight"].double()
        if not (g_in != 0).all():
            raise UnsupportedModelError(
                f"{source}: layer {i}: input_layernorm.weight has zeros, so "
                f"dms_proj_alpha_norm cannot be folded into a projection of the attention "
                f"input (it needs input_layernorm.weight != 0 everywhere)")
        folded = w_a.double() * (g_a.double() / g_in)[None, :]
        weights[p + "self_attn.dms_decision_proj.weight"] = folded.to(w_a.dtype)
    return weights


def nvidia_dms_to_mcore(hf_folder, out_folder, *, tp: int = 1, pp: int = 1,
                        dtype: str | None = None) -> dict:
    """Converts NVIDIA's DMS folder ``hf_folder`` into ``out_folder`` (must not exist or be
    empty), copying its tokenizer files and writing ``model.yaml``. ``dtype``: cast the weights
    (default: keep); ``tp``/``pp``: the layout to save at. Returns a summary (``model_config``,
    ``dmc_config``, ``tokenizer``, ``yaml``, and ``note`` for a model converted as vanilla)."""
    hf_folder = Path(hf_folder)
    if not hf_folder.is_dir():
        raise FileNotFoundError(f"NVIDIA DMS folder {hf_folder} does not exist")
    cfg = read_hf_config(hf_folder)
    model_config, dmc_config = configs_from_nvidia(cfg, str(hf_folder / "config.json"))
    disabled = bool(cfg.get("dms_disable_eviction", False))
    target = None if disabled else cfg.get("dms_cr")
    prepare = None
    if cfg.get("dms_separate_alpha", False):
        prepare = partial(fold_separate_alpha, num_layers=model_config.num_layers,
                          source=str(hf_folder), vanilla=dmc_config is None)
    elif disabled:
        prepare = partial(check_never_evicts, model=model_config, dmc=dmc_config,
                          source=str(hf_folder))
    summary = convert_hf_folder(
        hf_folder, out_folder, model_config, dmc_config, tp=tp, pp=pp, dtype=dtype,
        source={"format": "nvidia-dms", "path": str(hf_folder)},
        what=f"NVIDIA DMS checkpoint {hf_folder}",
        extra={"target_cr": float(target) if target else None}, prepare=prepare)
    if disabled:
        summary["note"] = DISABLED_NOTES[dmc_config is None]
    return summary
