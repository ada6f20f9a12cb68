"""This project's checkpoint folders from and to full (TP = 1) megatron state dicts.

A converted checkpoint is what :func:`dmc.megatron.checkpoint.save_checkpoint` writes, without
optimizer or RNG state: ``state.json`` (``kind: "converted"``, ``model_config``, ``dmc_config``)
plus a megatron distributed checkpoint of ``{"model": model.sharded_state_dict()}``. It is saved
from a ``tp x pp`` layout (``torchrun`` with gloo for more than one rank); megatron reshards it on
load, so ``dmc.inference.load_model`` and ``checkpoint.load_base`` of any layout read it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from dmc.megatron.config import DMCConfig, ModelConfig
from dmc.megatron.parallel import torchrun_command

COLUMN_PARALLEL = ("linear_qkv.weight", "linear_fc1.weight", "output_layer.weight",
                   "word_embeddings.weight", "decision_proj.weight")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


def tp_shard(name: str, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This TP rank's part of a full tensor: column-parallel weights split along dim 0 (fc1 per
    gate/up half), row-parallel along dim 1, everything else replicated."""
    if world == 1 or full.dim() == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(world)[rank], up.chunk(world)[rank]])
    if name.endswith(COLUMN_PARALLEL):
        return full.chunk(world, dim=0)[rank]
    if name.endswith(ROW_PARALLEL):
        return full.chunk(world, dim=1)[rank]
    return full


def global_name(model, name: str) -> str:
    """``decoder.layers.<local>.*`` -> ``decoder.layers.<global>.*`` for a pipeline stage."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def load_full_state(model, full: dict) -> None:
    """Loads this rank's shards of ``full`` (TP = 1 names and shapes) into ``model``. With tied
    embeddings the last pipeline stage's own ``output_layer.weight`` (megatron's copy of the
    embedding) is loaded from ``embedding.word_embeddings.weight``."""
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    world = parallel_state.get_tensor_model_parallel_world_size()
    local = {}
    for name, param in model.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        gname = global_name(model, name)
        if gname == "output_layer.weight" and model.share_embeddings_and_output_weights:
            gname = "embedding.word_embeddings.weight"
        if gname not in full:
            raise KeyError(f"converted weights lack {gname!r} needed by the model")
        shard = tp_shard(gname, full[gname], rank, world)
        if shard.shape != param.shape:
            raise ValueError(f"{gname}: shape {tuple(shard.shape)} (TP rank {rank}/{world}) does "
                             f"not match the model's {tuple(param.shape)}")
        local[name] = shard.to(param.dtype)
    model.load_state_dict(local, strict=False)


def save_model_checkpoint(model, folder: Path, meta: dict) -> None:
    """Writes ``{"model": model.sharded_state_dict()}`` and (rank 0) ``state.json`` and the
    manifest that loading verifies."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from dmc.megatron.checkpoint import write_manifest

    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(folder))
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        (Path(folder) / "state.json").write_text(json.dumps(meta, indent=1))
        write_manifest(Path(folder))


def write_checkpoint(folder: Path, full: dict, model_config: ModelConfig | dict,
                     dmc_config: DMCConfig | dict | None, tp: int = 1, pp: int = 1,
                     extra: dict | None = None) -> Path:
    """Writes a converted checkpoint folder (see the module docstring) from ``full`` weights
    (the configs typed or as their ``to_dict`` dicts; ``dmc_config`` None = vanilla).

    The folder must not exist or be empty. ``tp * pp > 1`` runs the save in ``tp * pp`` gloo
    processes (``python -m torch.distributed.run``)."""
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"output folder {folder} exists and is not empty")
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
    model_config, dmc_config = ModelConfig.of(model_config), DMCConfig.of(dmc_config)
    _check_layout(model_config, tp, pp)
    folder.mkdir(parents=True, exist_ok=True)
    meta = dict(extra or {}, kind="converted", step=0, model_config=model_config.to_dict(),
                dmc_config=None if dmc_config is None else dmc_config.to_dict(), tp=tp, pp=pp)
    if tp * pp == 1:
        _save_single(folder, full, model_config, dmc_config, meta)
    else:
        _save_distributed(folder, full, meta, tp, pp)
    return folder


def _check_layout(model_config: ModelConfig, tp, pp):
    m = model_config
    problems = []
    if m.num_layers % pp:
        problems.append(f"num_layers={m.num_layers} is not divisible by pp={pp}")
    sizes = {"num_attention_heads": m.num_attention_heads, "num_query_groups": m.kv_heads,
             "ffn_hidden_size": m.ffn_hidden_size, "vocab_size": m.vocab_size}
    for key, size in sizes.items():
        if size % tp:
            problems.append(f"{key}={size} is not divisible by tp={tp}")
    if problems:
        raise ValueError("cannot shard the model: " + "; ".join(problems))


def _save_single(folder, full, model_config, dmc_config, meta):
    from megatron.core import parallel_state

    from dmc.megatron.model import build_model_from_config

    if parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_tensor_model_parallel_world_size() != 1
            or parallel_state.get_pipeline_model_parallel_world_size() != 1):
        raise RuntimeError("write_checkpoint(tp=1, pp=1) needs a process without model "
                           "parallelism (or none initialised)")
    model = build_model_from_config(model_config, dmc_config)
    load_full_state(model, full)
    save_model_checkpoint(model, folder, meta)


def _save_distributed(folder, full, meta, tp, pp):
    with tempfile.TemporaryDirectory(prefix="dmc_convert_") as tmp:
        payload = Path(tmp) / "full.pt"
        torch.save({"state": full, "meta": meta}, payload)
        cmd = [*torchrun_command(tp * pp), "-m", "dmc.convert.dist_save", str(payload),
               str(folder)]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"distributed save (tp={tp}, pp={pp}) failed:\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")


def read_checkpoint(folder: Path) -> tuple[dict, ModelConfig, DMCConfig | None, dict]:
    """``(full state dict, model_config, dmc_config, state.json)`` of one of this project's
    checkpoints (any TP/PP, any phase; ``folder`` may also be a run or checkpoints folder)."""
    from dmc.inference.loading import load_model

    loaded = load_model(folder)
    state = {k: v.detach().cpu() for k, v in loaded.model.state_dict().items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    return (state, loaded.model_config, loaded.dmc_config,
            dict(loaded.state, source=str(loaded.source)))
