"""Load a model for inference from any of this project's model formats.

``load_model(path)`` accepts

* a file written by :func:`~dmc.inference.engine.save_inference_state` (``.pt``);
* a training checkpoint folder (``state.json`` + megatron distributed checkpoint), written at any
  tensor/pipeline parallel size: it is resharded to TP = PP = 1 on load;
* a checkpoints folder (holding ``latest``) or a run folder (holding ``checkpoints/latest``):
  the newest complete checkpoint.

A checkpoint saved before the decision rows were zeroed (pretraining, zero_out) is a vanilla
model; later retrofit checkpoints are DMC models with the run's window and ``c``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dmc.inference.engine import build_model_from_config, load_inference_state


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
        _load_plain(model, saved["state_dict"], path)
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


def _load_plain(model: torch.nn.Module, state_dict: dict, source: Path) -> None:
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"{source}: state dict does not match the model config: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")

