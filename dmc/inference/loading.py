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

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from dmc.megatron.config import DMCConfig, ModelConfig

STATE_FORMAT = 1


@dataclass
class LoadedModel:
    model: torch.nn.Module
    model_config: ModelConfig
    dmc_config: DMCConfig | None  # None = vanilla model
    source: Path
    state: dict  # the checkpoint's state.json ({} for inference files)

    @property
    def dtype(self) -> str:
        """Its weights' dtype, e.g. ``"bfloat16"`` (an engine's cache holds keys and values in
        it)."""
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")


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


def saved_configs(saved: dict, source: Path) -> tuple[ModelConfig, DMCConfig | None]:
    """``(model_config, dmc_config)`` that a checkpoint's ``state.json`` or an inference file
    records (as ``to_dict`` dicts)."""
    if "model_config" not in saved:
        raise ValueError(
            f"{source}: no 'model_config' (a checkpoint written by dmc before 2026-11-22?); "
            f"re-save it with the current trainer"
        )
    dmc_config = saved.get("dmc_config")
    return (ModelConfig.from_dict(saved["model_config"]),
            None if dmc_config is None else DMCConfig.from_dict(dmc_config))


def saved_dmc_config(path) -> DMCConfig | None:
    """The DMC config the model at ``path`` was saved with (its ``method``: "dmc" or "dms"),
    None for a vanilla model; read without building the model."""
    from dmc.megatron.checkpoint import read_state

    path = Path(path)
    saved = load_inference_state(path) if path.is_file() else read_state(resolve_checkpoint(path))
    dmc_config = saved.get("dmc_config")
    return None if dmc_config is None else DMCConfig.from_dict(dmc_config)


def find_tokenizer(checkpoint: Path, state: dict) -> Path | None:
    """The tokenizer of a checkpoint: the checkpoint folder itself (converted checkpoints), else
    the run's prepared data (``data.path`` of its config; a relative path is tried from the
    working directory, then from each folder above the checkpoint, as the run was launched from
    one of them). None when neither holds one."""
    from dmc.data.tokenizer import has_tokenizer

    if Path(checkpoint).is_dir() and has_tokenizer(checkpoint):
        return Path(checkpoint)
    data_path = ((state.get("config") or {}).get("data") or {}).get("path")
    if not data_path:
        return None
    data_path = Path(data_path)
    places = [data_path] if data_path.is_absolute() else (
        [data_path] + [above / data_path for above in Path(checkpoint).resolve().parents])
    return next((p for p in places if has_tokenizer(p)), None)


def model_tokenizer(path) -> Path | None:
    """:func:`find_tokenizer` of the model at ``path`` (a checkpoint, checkpoints or run folder);
    None for an inference file, which records no data."""
    from dmc.megatron.checkpoint import read_state

    if Path(path).is_file():
        return None
    checkpoint = resolve_checkpoint(path)
    return find_tokenizer(checkpoint, read_state(checkpoint))


def load_model(path, *, dtype: torch.dtype | None = None) -> LoadedModel:
    """Build and load the model stored at ``path`` (see the module docstring), TP = PP = 1,
    on CPU; ``dtype`` overrides the parameter dtype."""
    from dmc.megatron.model import build_model_from_config

    path = Path(path)
    if path.is_file():
        saved = load_inference_state(path)
        model_config, dmc_config = saved_configs(saved, path)
    else:
        from dmc.megatron.checkpoint import read_state

        source = resolve_checkpoint(path)
        model_config, dmc_config = saved_configs(read_state(source), source / "state.json")
    if dtype is not None:
        model_config = dataclasses.replace(model_config,
                                           params_dtype=str(dtype).removeprefix("torch."))
    model = build_model_from_config(model_config, dmc_config)
    if path.is_file():
        load_plain(model, saved["state_dict"], path)
        return LoadedModel(model, model_config, dmc_config, path, {})

    from dmc.megatron.checkpoint import load_checkpoint

    try:
        state = load_checkpoint(source, model, contents=False)  # sizes: no hashing per load
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


def save_inference_state(path, model: torch.nn.Module, model_config: ModelConfig | dict,
                         dmc_config: DMCConfig | dict | None = None) -> None:
    """Write the single-file format that :meth:`Engine.from_file` and ``dmc generate
    --state-dict`` read (``torch.save`` of a plain dict, loadable with ``weights_only=True``)::

        {"format": 1,
         "model_config": {...},          # ModelConfig.to_dict()
         "dmc_config": {...} or None,    # DMCConfig.to_dict(); None = vanilla model
         "state_dict": {name: tensor}}   # model.state_dict(), tensors only

    The configs may be given typed or as dicts (checked by their ``from_dict``).
    """
    model_config, dmc_config = ModelConfig.of(model_config), DMCConfig.of(dmc_config)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor)}
    torch.save({"format": STATE_FORMAT, "model_config": model_config.to_dict(),
                "dmc_config": None if dmc_config is None else dmc_config.to_dict(),
                "state_dict": state}, path)


def load_inference_state(path) -> dict:
    """Read and check a file written by :func:`save_inference_state`."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # not a torch file, or one holding more than tensors and dicts
        raise ValueError(f"{path}: not a dmc inference state ({type(err).__name__} from "
                         f"torch.load); accepted: a .pt file written by "
                         f"dmc.inference.loading.save_inference_state, a checkpoint folder or a "
                         f"run folder") from err
    if not isinstance(saved, dict) or not {"model_config", "state_dict"} <= saved.keys():
        raise ValueError(
            f"{path}: not a dmc inference state (a dict with 'model_config', 'dmc_config' and "
            f"'state_dict'; see dmc.inference.loading.save_inference_state)"
        )
    if saved.get("format", STATE_FORMAT) != STATE_FORMAT:
        raise ValueError(f"{path}: inference state format {saved['format']!r}; this dmc reads "
                         f"format {STATE_FORMAT} (written by save_inference_state)")
    saved.setdefault("dmc_config", None)
    return saved
