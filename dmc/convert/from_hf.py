"""Hugging Face Llama or Qwen3 folder -> this project's megatron-core checkpoint
(``dmc convert hf-to-mcore``).

The output folder is a checkpoint (see :mod:`dmc.convert.mcore_io`) that also holds the tokenizer
files and ``model.yaml``, a model config that ``dmc retrofit --config model.yaml ...`` takes as
is (its ``checkpoint.load_base`` points at the folder).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import yaml

from dmc.convert.hf_config import model_config_from_hf
from dmc.convert.hf_io import copy_tokenizer, read_hf_config, read_hf_weights
from dmc.convert.mapping import hf_to_mcore_state
from dmc.convert.mcore_io import write_checkpoint
from dmc.megatron.config import DMCConfig, ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRECISION = {"float32": "fp32", "bfloat16": "bf16"}
PAPER_SEQ_LENGTH, PAPER_GLOBAL_BATCH = 4096, 1024  # DMC paper Sec. 4 (and NVIDIA's train.sh)
YAML_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
             "ffn_hidden_size", "vocab_size", "max_seq_length", "rotary_base", "norm_epsilon",
             "share_embeddings", "rope_scaling_factor", "qk_layernorm", "kv_channels")


def hf_to_mcore(hf_folder, out_folder, *, tp: int = 1, pp: int = 1,
                dtype: str | None = None) -> dict:
    """Converts ``hf_folder`` into ``out_folder`` (must not exist or be empty).

    ``dtype``: "float32", "bfloat16" or "float16" (default: the weights' own dtype).
    ``tp``/``pp``: the layout the distributed checkpoint is written from (any layout loads it).
    Returns a summary: ``model_config``, ``tokenizer`` (files copied), ``yaml`` path.
    """
    hf_folder = Path(hf_folder)
    if not hf_folder.is_dir():
        raise FileNotFoundError(f"Hugging Face folder {hf_folder} does not exist")
    model_config = model_config_from_hf(read_hf_config(hf_folder), str(hf_folder / "config.json"))
    return convert_hf_folder(hf_folder, out_folder, model_config, None, tp=tp, pp=pp, dtype=dtype,
                             source={"format": "huggingface", "path": str(hf_folder)},
                             what=f"Hugging Face folder {hf_folder}")


def convert_hf_folder(hf_folder: Path, out_folder, model_config: ModelConfig,
                      dmc_config: DMCConfig | None, *, tp: int, pp: int, dtype: str | None,
                      source: dict, what: str, extra: dict | None = None,
                      prepare=None) -> dict:
    """The weights of ``hf_folder`` (HF names, :func:`hf_to_mcore_state`) written as our
    checkpoint of ``model_config`` / ``dmc_config`` in ``out_folder``, with the tokenizer files
    and ``model.yaml``; ``source`` and ``extra`` go into ``state.json``. ``prepare``: a function
    of the weights as read (before any dtype cast) returning them in the names
    :func:`hf_to_mcore_state` takes. Shared by :func:`hf_to_mcore` and
    :func:`dmc.convert.nvidia_dms.nvidia_dms_to_mcore`."""
    weights = read_hf_weights(hf_folder)
    if prepare is not None:
        weights = prepare(weights)
    if dtype is None:
        dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    weights = {k: v.to(DTYPES[dtype]) for k, v in weights.items()}
    model_config = dataclasses.replace(model_config, params_dtype=dtype)
    full = hf_to_mcore_state(weights, model_config, str(hf_folder))
    out_folder = Path(out_folder)
    write_checkpoint(out_folder, full, model_config, dmc_config, tp=tp, pp=pp,
                     extra=dict(extra or {}, source=source))
    copied = copy_tokenizer(hf_folder, out_folder)
    yaml_path = write_model_yaml(out_folder, model_config, what)
    summary = {"output": str(out_folder), "model_config": model_config.to_dict(),
               "tokenizer": copied, "yaml": str(yaml_path)}
    if dmc_config is not None:
        summary["dmc_config"] = dmc_config.to_dict()
    return summary


def write_model_yaml(folder: Path, model_config: ModelConfig, source: str) -> Path:
    """``folder/model.yaml``: the ``model`` section, the paper's batch (``data``: 1024
    sequences of 4096 tokens, or of the model's context when shorter: Sec. 4 of the DMC
    paper, the batch the retrofit recipes' token budgets are stated at), ``precision`` and
    ``checkpoint.load_base``."""
    folder = Path(folder).resolve()
    fields = model_config.to_dict()
    model = {k: fields[k] for k in YAML_KEYS if fields.get(k) is not None}
    data = {"seq_length": min(PAPER_SEQ_LENGTH, model_config.max_seq_length),
            "micro_batch_size": 1, "global_batch_size": PAPER_GLOBAL_BATCH}
    body = {"model": model, "data": data, "checkpoint": {"load_base": str(folder)},
            "precision": PRECISION.get(model_config.params_dtype, "auto")}
    header = (f"# Converted from {source} by `dmc convert`.\n"
              f"# Retrofit: dmc data prepare --tokenizer {folder} ...; then\n"
              f"#   dmc retrofit --config {folder / 'model.yaml'} --config "
              f"configs/retrofit/cr2.yaml data.path=...\n")
    path = folder / "model.yaml"
    path.write_text(header + yaml.safe_dump(body, sort_keys=False))
    return path
