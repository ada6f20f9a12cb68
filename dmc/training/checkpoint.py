"""Megatron distributed checkpoints of a training run, written atomically.

A checkpoint folder holds the megatron ``dist_checkpointing`` shards of the model and optimizer,
``state.json`` (step, phase, target CR, scheduler state, config) and per-rank RNG states. It is
written under ``<name>.tmp`` and renamed once complete; ``latest`` (replaced atomically) names
the newest regular checkpoint. A run killed at any moment resumes from the last complete one.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

LATEST = "latest"
STATE = "state.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(root: Path, name: str, model, optimizer, scheduler, meta: dict,
                    update_latest: bool = True) -> Path:
    """Writes ``root/name`` (model, optimizer, scheduler, RNG, ``meta``) atomically."""
    root = Path(root)
    final, tmp = root / name, root / f"{name}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_sd = model.sharded_state_dict()
    sharded = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd)}
    dist_checkpointing.save(sharded, str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        state = dict(meta, scheduler=scheduler.state_dict() if scheduler else None)
        (tmp / STATE).write_text(json.dumps(state, indent=1, default=str))
    _barrier()
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if update_latest:
            _write_atomic(root / LATEST, name)
    _barrier()
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The folder named by ``root/latest`` if it is complete, else None."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / STATE).is_file() else None


def read_state(path: Path) -> dict:
    path = Path(path)
    if not (path / STATE).is_file():
        raise FileNotFoundError(
            f"{path} is not a dmc checkpoint (no {STATE}); expected a folder written by "
            f"dmc pretrain/retrofit"
        )
    return json.loads((path / STATE).read_text())


INIT_FROM_SAME = ("seed", "model", "schedule", "optim", "data.seq_length",
                  "data.global_batch_size")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def check_init_from(path: Path, config: dict, kind: str) -> None:
    """Raises ValueError unless ``path`` (``checkpoint.init_from``) was written by a ``kind``
    run whose seed, model, schedule, optimizer and batch shape equal ``config``'s (a nested
    dict), so continuing from it is the same as having run those steps here."""
    state = read_state(path)
    if state.get("kind") != kind:
        raise ValueError(f"checkpoint.init_from {path} belongs to a {state.get('kind')} run, "
                         f"not {kind}")
    ours, theirs = _flat(config), _flat(state.get("config", {}))
    wrong = sorted(k for k in ours
                   if any(k == s or k.startswith(s + ".") for s in INIT_FROM_SAME)
                   and theirs.get(k, ours[k]) != ours[k])
    if wrong:
        raise ValueError(
            f"checkpoint.init_from {path} was written by a different run: "
            + ", ".join(f"{k} is {ours[k]!r} here but {theirs[k]!r} there" for k in wrong))


def load_checkpoint(path: Path, model, optimizer=None, scheduler=None) -> dict:
    """Restores the model (and optimizer, scheduler, RNG when given); returns ``state.json``."""
    path = Path(path)
    state = read_state(path)
    model_sd = model.sharded_state_dict()
    sharded = {"model": model_sd}
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True)
    loaded = dist_checkpointing.load(sharded, str(path))
    model.load_state_dict(loaded["model"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
        if scheduler is not None and state.get("scheduler"):
            scheduler.load_state_dict(state["scheduler"])
        rng = path / f"rng_rank{_rank()}.pt"
        if rng.is_file():
            _set_rng_state(torch.load(rng, weights_only=False))
    return state


def prune_checkpoints(root: Path, keep_last: int) -> None:
    """Removes all but the newest ``keep_last`` regular ``step_*`` checkpoints (CR-crossing and
    phase-end checkpoints are kept)."""
    if _rank() != 0:
        return
    steps = sorted(p for p in Path(root).glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in steps[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)

