"""Megatron distributed checkpoints of a training run: written atomically, verified on load.

A checkpoint folder holds the megatron ``dist_checkpointing`` shards of the model and optimizer,
``state.json`` (step, phase, target CR, scheduler state, config), per-rank RNG states and
``manifest.json`` (size and SHA-256 of every other file). It is written under ``<name>.tmp`` and
renamed once complete; ``latest`` (replaced atomically) names the newest regular checkpoint.
Loading verifies the manifest first, so a truncated or corrupted file is an error naming it, and
:func:`resumable_checkpoint` falls back to the newest checkpoint that verifies. Folders written
before manifests existed load with a warning (nothing to verify against).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

LATEST = "latest"
STATE = "state.json"
MANIFEST = "manifest.json"
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint folder that is incomplete or damaged; the message names the file."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _from_rank0(value):
    """``value`` as rank 0 computed it, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _replace_folder(src: Path, dst: Path) -> None:
    """Moves the complete folder ``src`` to ``dst``; an older ``dst`` is moved aside first and
    removed only once ``src`` is in place."""
    old = dst.with_name(dst.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dst.exists():
        os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path) -> None:
    """``folder/manifest.json``: ``{"files": {relative path: {"size", "sha256"}}}``."""
    folder = Path(folder)
    files = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in _files(folder)}
    _write_atomic(folder / MANIFEST, json.dumps({"format": 1, "files": files}, indent=1))


def content_digest(folder: Path) -> str:
    """A SHA-256 of a checkpoint's content: of every file's SHA-256 but ``state.json``'s (which
    names the run folder), read from the manifest when there is one, else computed. Equal for a
    checkpoint moved, copied or renamed. Raises :class:`CheckpointError` for an empty folder."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if manifest.is_file():
        hashes = {name: entry["sha256"]
                  for name, entry in json.loads(manifest.read_text())["files"].items()}
    else:
        hashes = {str(p.relative_to(folder)): _sha256(p) for p in _files(folder)}
    if not hashes:
        raise CheckpointError(f"{folder}: no checkpoint files")
    lines = sorted(f"{name} {sha}" for name, sha in hashes.items() if name != STATE)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def verify_checkpoint(folder: Path, contents: bool = True) -> bool:
    """Checks every file ``manifest.json`` lists (present, same size, and with ``contents`` the
    same SHA-256; without, what a crash leaves behind, a missing or truncated file, is still
    caught, at no read).

    Returns True when verified, False for a folder written before manifests (a warning says it
    was not verified). Raises :class:`CheckpointError` naming the first file that is missing,
    truncated or changed, or the manifest itself when it is unreadable.
    """
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        if not (folder / STATE).is_file():
            raise CheckpointError(f"{folder}: not a complete checkpoint (no {STATE}, no "
                                  f"{MANIFEST})")
        warnings.warn(f"{folder} has no {MANIFEST} (written by an older dmc): loaded "
                      f"without verification", stacklevel=2)
        return False
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest}: unreadable manifest ({err})") from None
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in {manifest})")
        size = path.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(f"{path}: {size} bytes, {expected['size']} when written "
                                  f"(truncated or replaced)")
        if contents and _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"{path}: contents changed since it was written (SHA-256 "
                                  f"differs from {manifest})")
    return True


def is_complete(folder: Path, contents: bool = True) -> bool:
    """Whether ``folder`` is a checkpoint that verifies (or a pre-manifest one with a state);
    ``contents=False``: sizes only (:func:`verify_checkpoint`)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            verify_checkpoint(folder, contents=contents)
        return True
    except CheckpointError:
        return False


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
                    update_latest: bool = True, extras=None) -> Path:
    """Writes ``root/name`` (model, optimizer, scheduler, RNG, ``meta``, manifest) atomically.
    ``extras``: called on rank 0 with the temporary folder before the manifest is written, to
    add files (a CR heatmap) that appear with the checkpoint and are listed in its manifest."""
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
        if extras is not None:
            extras(tmp)
    _barrier()
    if _rank() == 0:
        write_manifest(tmp)
        _replace_folder(tmp, final)
        if update_latest:
            _write_atomic(root / LATEST, name)
    _barrier()
    return final


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """Copies the checkpoint ``src`` to ``dst`` atomically (under ``dst.tmp``, verified, then
    renamed): ``dst`` is either the old folder or the complete copy, never a partial one.
    Rank 0 only."""
    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    if not (tmp / MANIFEST).is_file():
        write_manifest(tmp)
    verify_checkpoint(tmp)
    _replace_folder(tmp, dst)
    return dst


def latest_checkpoint(root: Path) -> Path | None:
    """The folder named by ``root/latest`` if it holds a state, else None (not verified)."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / STATE).is_file() else None


def _candidates(root: Path) -> list[Path]:
    """Checkpoint folders under ``root``, newest step first (``latest``'s target leads ties)."""
    folders = [p for p in Path(root).iterdir() if p.is_dir() and (p / STATE).is_file()
               and not p.name.endswith((".tmp", ".old"))] if Path(root).is_dir() else []
    latest = latest_checkpoint(root)
    steps = {folder: _step_of(folder) for folder in folders}
    return sorted(folders, key=lambda p: (-steps[p], p != latest, p.name))


def _step_of(folder: Path) -> int:
    """The step in ``folder/state.json``; -1 when it cannot be read."""
    try:
        return int(read_state(folder)["step"])
    except (OSError, CheckpointError, KeyError, TypeError, ValueError):
        return -1


def resumable_checkpoint(root: Path, fallback: bool = True) -> Path | None:
    """The checkpoint a run in ``root`` resumes from: ``latest`` when it verifies; otherwise,
    with ``fallback``, the newest checkpoint folder that verifies (a warning names the damaged
    one and the one used). None when the run has no checkpoint. Raises
    :class:`CheckpointError` when ``latest`` is damaged and ``fallback`` is off, or when no
    folder verifies. Decided on rank 0, the same on every rank."""
    root = Path(root)
    if _rank() == 0:
        choice = _choose(root, fallback)
    else:
        choice = None
    choice = _from_rank0(choice)
    if isinstance(choice, CheckpointError):
        raise choice
    return None if choice is None else Path(choice)


def _choose(root: Path, fallback: bool):
    latest = latest_checkpoint(root)
    pointer = root / LATEST
    if latest is None and not pointer.is_file():
        return None
    problems = []
    if latest is None:
        problems.append(f"{pointer} names {pointer.read_text().strip()!r}, which is not a "
                        f"complete checkpoint")
    else:
        try:
            verify_checkpoint(latest)
            return str(latest)
        except CheckpointError as err:
            problems.append(str(err))
    if not fallback:
        return CheckpointError(f"cannot resume: {problems[0]}; checkpoint.fallback is false, "
                               f"so no older checkpoint is used")
    for folder in _candidates(root):
        if folder == latest:
            continue
        try:
            verify_checkpoint(folder)
        except CheckpointError as err:
            problems.append(str(err))
            continue
        warnings.warn(f"{problems[0]}; resuming from {folder} instead", stacklevel=3)
        return str(folder)
    return CheckpointError("cannot resume: no checkpoint verifies: " + "; ".join(problems))


def read_state(path: Path) -> dict:
    """``path/state.json``; errors name the folder or the file."""
    path = Path(path)
    if not (path / STATE).is_file():
        raise FileNotFoundError(
            f"{path} is not a dmc checkpoint (no {STATE}); expected a folder written by "
            f"dmc pretrain/retrofit"
        )
    try:
        return json.loads((path / STATE).read_text())
    except ValueError as err:
        raise CheckpointError(f"{path / STATE}: not valid JSON ({err}); the file is "
                              f"damaged") from None


def load_checkpoint(path: Path, model, optimizer=None, scheduler=None, *,
                    contents: bool = True, optional: tuple[str, ...] = ()) -> dict:
    """Verifies ``path`` (:func:`verify_checkpoint`; ``contents=False``: presence and sizes
    only, for loads that read the weights of a checkpoint many times, such as inference, where
    hashing every file, the optimizer state included, would cost more than the load), then
    restores the model (and optimizer, scheduler, RNG when given); returns ``state.json``.
    The optimizer takes the saved state (Adam's moments and step counts) but keeps the
    hyperparameters it was built with (betas, eps, weight decay, LR bounds of each param group:
    the run's config, which ``--allow-config-change`` may have changed); the scheduler gets
    ``load_state_dict`` (one built with megatron's ``override_opt_param_scheduler`` keeps its
    schedule and takes only the step count). ``optional``: names of submodules (e.g.
    ``"decision_proj"``, a DMS adapter that a vanilla base lacks) whose weights are loaded when
    ``path`` has them and kept as initialised when not (model-only loads)."""
    path = Path(path)
    problem = None
    if _rank() == 0:
        try:
            verify_checkpoint(path, contents=contents)
        except CheckpointError as err:
            problem = err
    problem = _from_rank0(problem)
    if problem is not None:
        raise problem
    state = read_state(path)
    model_sd = model.sharded_state_dict()
    absent = _absent_optional(path, model_sd, optional) if optional else []
    for name in absent:
        del model_sd[name]
    sharded = {"model": model_sd}
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True)
    try:
        loaded = dist_checkpointing.load(sharded, str(path))
    except (OSError, EOFError, RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"{path}: the distributed checkpoint does not load "
                              f"({type(err).__name__}: {err})") from err
    model.load_state_dict(loaded["model"], strict=not absent)
    if optimizer is not None:
        settings = [{k: v for k, v in group.items() if k != "params"}
                    for group in optimizer.param_groups]
        optimizer.load_state_dict(loaded["optimizer"])
        for group, kept in zip(optimizer.param_groups, settings):
            group.update(kept)  # the run's betas, eps, weight decay, LR bounds; saved moments
        if scheduler is not None and state.get("scheduler"):
            scheduler.load_state_dict(state["scheduler"])
        rng = path / f"rng_rank{_rank()}.pt"
        if rng.is_file():
            try:
                rng_state = torch.load(rng, weights_only=False)
            except (EOFError, RuntimeError, ValueError, OSError) as err:
                raise CheckpointError(f"{rng}: unreadable ({type(err).__name__}: {err})") \
                    from None
            _set_rng_state(rng_state)
    return state


def _absent_optional(path: Path, model_sd: dict, optional: tuple[str, ...]) -> list[str]:
    """Entries of ``model_sd`` under an ``optional`` submodule whose weight ``path`` lacks."""
    stored = set(dist_checkpointing.load_tensors_metadata(str(path)))
    modules = {name.rsplit(".", 1)[0] for name, item in model_sd.items()
               if any(f".{part}." in f".{name}" for part in optional)
               and not name.endswith("_extra_state") and item.key not in stored}
    return [name for name in model_sd if name.rsplit(".", 1)[0] in modules]


def prune_checkpoints(root: Path, keep_last: int) -> None:
    """Removes all but the newest ``keep_last`` regular ``step_*`` checkpoints, newest by the
    step in their ``state.json``; CR-crossing and phase-end checkpoints are kept. The folder
    ``latest`` names is always kept and counts among the ``keep_last``. A folder whose sizes do
    not verify, or whose step is above ``latest``'s (what a resume that fell back to an older
    checkpoint leaves), neither counts among the newest nor is removed: the run replaces it
    when it saves that name again. Rank 0 only."""
    if _rank() != 0:
        return
    latest = latest_checkpoint(root)
    limit = _step_of(latest) if latest is not None else None
    ranked = []
    for folder in Path(root).glob("step_*"):
        if not folder.is_dir() or folder.name.endswith((".tmp", ".old")) or folder == latest:
            continue
        step = _step_of(folder)
        if step >= 0 and (limit is None or step <= limit) and is_complete(folder, contents=False):
            ranked.append((step, folder.name, folder))
    ranked.sort(reverse=True)
    keep = keep_last - (latest is not None and latest.name.startswith("step_"))
    for _, _, old in ranked[max(keep, 0):]:
        shutil.rmtree(old, ignore_errors=True)
