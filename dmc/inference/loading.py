"""Load a model for inference from any of this project's model formats.

``load_model(path)`` accepts

* a file written by :func:`save_inference_state` (``.pt``);
* a training checkpoint folder (``state.json`` + megatron distributed checkpoint), written at any
  tensor/pipeline parallel size: it is resharded to TP = PP = 1 on load;
* a checkpoints folder (holding ``latest``) or a run folder (holding ``checkpoints/latest``):
  the newest complete checkpoint.

A checkpoint saved before the decision rows were zeroed (pretraining, zero_out) is a vanilla
model; later retrofit checkpoints are DMC models with the run's window and ``c``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dmc.megatron.runtime import DMCConfig, DMCRuntime

STATE_FORMAT = 1
MODEL_CONFIG_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                         "vocab_size")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    model_config: dict
    dmc_config: dict | None
    source: Path
    state: dict  # the checkpoint's state.json ({} for inference files)


def resolve_checkpoint(path) -> Path:
    """The checkpoint folder ``path`` names (itself, its ``latest`` or ``checkpoints/latest``)."""
    from dmc.megatron.checkpoint import STATE, latest_checkpoint

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if (path / STATE).is_file():
        return path
    for root in (path, path / "checkpoints"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise FileNotFoundError(
        f"{path} is neither a dmc checkpoint (a folder with {STATE}), a checkpoints folder with "
        f"a 'latest' pointer, a run folder with checkpoints/latest, nor an inference .pt file"
    )


def checkpoint_model_config(state: dict, source: Path) -> tuple[dict, dict | None]:
    """``(model_config, dmc_config)`` recorded in a checkpoint's ``state.json``."""
    if "model_config" not in state:
        raise ValueError(
            f"{source}/state.json has no 'model_config' (written by dmc before 2026-11-22?); "
            f"re-save it with the current trainer"
        )
    return dict(state["model_config"]), state.get("dmc_config")


def load_model(path, *, dtype: torch.dtype | None = None) -> LoadedModel:
    """Build and load the model stored at ``path`` (see the module docstring), TP = PP = 1,
    on CPU; ``dtype`` overrides the parameter dtype."""
    path = Path(path)
    if path.is_file():
        saved = load_inference_state(path)
        model_config = dict(saved["model_config"])
        if dtype is not None:
            model_config["params_dtype"] = str(dtype).removeprefix("torch.")
        model = build_model_from_config(model_config, saved["dmc_config"])
        load_plain(model, saved["state_dict"], path)
        return LoadedModel(model, model_config, saved["dmc_config"], path, {})

    from dmc.megatron.checkpoint import load_checkpoint, read_state

    source = resolve_checkpoint(path)
    model_config, dmc_config = checkpoint_model_config(read_state(source), source)
    if dtype is not None:
        model_config["params_dtype"] = str(dtype).removeprefix("torch.")
    model = build_model_from_config(model_config, dmc_config)
    try:
        state = load_checkpoint(source, model)
    except Exception as err:  # dist_checkpointing reports mismatches in many exception types
        raise ValueError(f"{source}: checkpoint does not match its model_config: {err}") from err
    return LoadedModel(model, model_config, dmc_config, source, state)


def load_plain(model: torch.nn.Module, state_dict: dict, source: Path) -> None:
    """Load ``state_dict`` into ``model``; a missing or unexpected key (but megatron's
    ``_extra_state``) is an error naming ``source``."""
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"{source}: state dict does not match the model config: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")


def build_model_from_config(model_config: dict, dmc_config: DMCConfig | dict | None = None):
    """A megatron ``GPTModel`` (TP = PP = 1) from a plain dict of hyper-parameters.

    ``model_config`` keys: ``num_layers``, ``hidden_size``, ``num_attention_heads``,
    ``ffn_hidden_size``, ``vocab_size`` (required); ``num_query_groups`` (default: heads),
    ``max_seq_length`` (4096), ``norm_epsilon`` (1e-5), ``rotary_base`` (10000.0),
    ``share_embeddings`` (False), ``rope_scaling_factor`` (None: Llama 3.x RoPE scaling off),
    ``params_dtype`` ("float32", "bfloat16" or "float16");
    any other key is passed to :func:`dmc.megatron.model.llama_transformer_config` as a
    ``TransformerConfig`` override (e.g. ``add_qkv_bias``). ``dmc_config`` (a
    :class:`DMCConfig` or its fields as a dict) makes a DMC model; None a vanilla one.
    Initialises megatron's parallel state (1 x 1) when it is not yet.
    """
    from megatron.core import parallel_state

    from dmc.megatron.model import build_gpt_model, llama_transformer_config
    from dmc.megatron.parallel import initialize_parallel

    missing = [k for k in MODEL_CONFIG_REQUIRED if k not in model_config]
    if missing:
        raise ValueError(f"model_config lacks {missing}; required: {list(MODEL_CONFIG_REQUIRED)}")
    if not parallel_state.model_parallel_is_initialized():
        initialize_parallel(1, 1)
    cfg = dict(model_config)
    vocab_size = int(cfg.pop("vocab_size"))
    max_seq_length = int(cfg.pop("max_seq_length", 4096))
    rotary_base = float(cfg.pop("rotary_base", 10000.0))
    share = bool(cfg.pop("share_embeddings", False))
    rope_scaling_factor = cfg.pop("rope_scaling_factor", None)
    dtype = cfg.pop("params_dtype", "float32")
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"model_config params_dtype must be one of {list(_DTYPES)}")
        dtype = _DTYPES[dtype]
    config = llama_transformer_config(params_dtype=dtype, **cfg)
    runtime = None
    if dmc_config is not None:
        if isinstance(dmc_config, dict):
            dmc_config = DMCConfig(**dmc_config)
        runtime = DMCRuntime(dmc_config)
        runtime.set_mode("eval")
    return build_gpt_model(config, vocab_size, max_seq_length, dmc=runtime,
                           rotary_base=rotary_base, share_embeddings=share,
                           rope_scaling_factor=rope_scaling_factor)


def save_inference_state(path, model: torch.nn.Module, model_config: dict,
                         dmc_config: DMCConfig | dict | None = None) -> None:
    """Write the single-file format that :meth:`Engine.from_file` and ``dmc generate
    --state-dict`` read (``torch.save`` of a plain dict, loadable with ``weights_only=True``)::

        {"format": 1,
         "model_config": {...},          # see build_model_from_config
         "dmc_config": {...} or None,    # DMCConfig fields; None = vanilla model
         "state_dict": {name: tensor}}   # model.state_dict(), tensors only
    """
    if isinstance(dmc_config, DMCConfig):
        dmc_config = asdict(dmc_config)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor)}
    torch.save({"format": STATE_FORMAT, "model_config": dict(model_config),
                "dmc_config": None if dmc_config is None else dict(dmc_config),
                "state_dict": state}, path)


def load_inference_state(path) -> dict:
    """Read and check a file written by :func:`save_inference_state`."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or not {"model_config", "state_dict"} <= saved.keys():
        raise ValueError(
            f"{path}: not a dmc inference state (a dict with 'model_config', 'dmc_config' and "
            f"'state_dict'; see dmc.inference.loading.save_inference_state)"
        )
    saved.setdefault("dmc_config", None)
    return saved
