"""Reading and writing Hugging Face model folders: weights (safetensors or ``.bin``, sharded or
not), ``config.json`` and tokenizer files."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json")


def read_hf_config(folder: Path) -> dict:
    """The ``config.json`` of a HF folder as a dict (FileNotFoundError without one)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    return read_json_object(path)


def read_json_object(path: Path) -> dict:
    """A JSON file holding an object, as a dict; ValueError naming ``path`` otherwise."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object (got a {type(value).__name__}); expected "
                         f"{{\"key\": value, ...}} as Hugging Face writes it")
    return value


def _load_file(path: Path) -> dict:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def read_hf_weights(folder: Path) -> dict:
    """All tensors of a HF folder: ``model.safetensors``, ``pytorch_model.bin`` or their sharded
    forms with an index file."""
    folder = Path(folder)
    for index_name in WEIGHT_INDEXES:
        index = folder / index_name
        if index.is_file():
            weight_map = read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no \"weight_map\" object (tensor name -> shard file)")
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (folder / f).is_file()]
            if missing:
                raise FileNotFoundError(f"{index}: shard files {missing} are missing")
            state = {}
            for name in files:
                state.update(_load_file(folder / name))
            return state
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return _load_file(folder / name)
    raise FileNotFoundError(
        f"{folder}: no weights; expected one of {list(WEIGHT_FILES)} or {list(WEIGHT_INDEXES)}")


def write_safetensors(folder: Path, state: dict, max_shard_bytes: int) -> list[str]:
    """Writes ``state`` as ``model-0000i-of-0000n.safetensors`` shards of at most
    ``max_shard_bytes`` each (one file ``model.safetensors`` when it fits) plus the index."""
    from safetensors.torch import save_file

    shards, current, size = [], {}, 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor.contiguous()
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / WEIGHT_INDEXES[0]).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return names


def copy_tokenizer(source: Path, dest: Path) -> list[str]:
    """Copies the tokenizer files found in ``source`` (a folder, or one tokenizer file) into
    ``dest``; returns the names copied."""
    source = Path(source)
    files = [source] if source.is_file() else [source / n for n in TOKENIZER_FILES
                                                if (source / n).is_file()]
    for f in files:
        shutil.copy2(f, Path(dest) / f.name)
    return [f.name for f in files]
