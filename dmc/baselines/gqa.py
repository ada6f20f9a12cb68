"""MHA (or GQA) -> GQA conversion by mean-pooling KV heads (Ainslie et al., 2023, "GQA: Training
Generalized Multi-Query Transformer Models from Multi-Head Checkpoints", Sec. 2.1).

The key and value projection heads of the query heads that end up in one group are replaced by
their mean; query heads, the output projection and everything else are copied. The converted
model is then up-trained with vanilla attention (``configs/retrofit/gqa2.yaml``) for the same
token budget as DMC, which is the GQA baseline of the DMC paper (Table 1).

Megatron fuses Q, K and V into ``linear_qkv`` with rows grouped per query group:
``[q_1 .. q_{np/ng}, k, v]`` for group 1, then group 2, ... (each entry ``head_dim`` rows).
Old groups ``r * j .. r * j + r - 1`` (``r = old_groups / new_groups``) form new group ``j``,
so query head ``h`` stays head ``h`` and belongs to group ``h // (np / new_groups)``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch

from dmc.megatron.config import ModelConfig

QKV_SUFFIXES = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")


def pool_qkv(tensor: torch.Tensor, num_heads: int, old_groups: int,
             new_groups: int) -> torch.Tensor:
    """Mean-pool the K and V heads of a fused QKV weight or bias.

    Args:
        tensor: ``[old_groups * (num_heads / old_groups + 2) * head_dim, *rest]`` in megatron's
            per-group layout (``rest`` = ``[hidden]`` for a weight, empty for a bias).
        num_heads: query heads; old_groups, new_groups: KV heads before and after
            (``new_groups`` must divide ``old_groups``).

    Returns:
        ``[new_groups * (num_heads / new_groups + 2) * head_dim, *rest]``, same dtype; the means
        are taken in float64.
    """
    if new_groups < 1 or old_groups % new_groups:
        raise ValueError(f"num_query_groups ({new_groups}) must divide the model's current "
                         f"number of KV heads ({old_groups})")
    per_group = num_heads // old_groups
    rows = tensor.shape[0]
    head_dim, leftover = divmod(rows, old_groups * (per_group + 2))
    if leftover or num_heads % old_groups:
        raise ValueError(f"a fused QKV tensor of {rows} rows does not fit {num_heads} heads in "
                         f"{old_groups} groups")
    rest = tensor.shape[1:]
    r = old_groups // new_groups
    grouped = tensor.double().reshape(new_groups, r, per_group + 2, head_dim, *rest)
    query = grouped[:, :, :per_group].reshape(new_groups, r * per_group, head_dim, *rest)
    key = grouped[:, :, per_group].mean(dim=1, keepdim=True)
    value = grouped[:, :, per_group + 1].mean(dim=1, keepdim=True)
    pooled = torch.cat([query, key, value], dim=1)
    return pooled.reshape(-1, *rest).to(tensor.dtype)


def convert_state_dict(state_dict: dict, model_config: ModelConfig, num_query_groups: int) -> dict:
    """A copy of ``state_dict`` (a megatron GPTModel's, TP = 1) with every ``linear_qkv`` weight
    and bias mean-pooled to ``num_query_groups`` KV heads; other entries are shared, not copied."""
    heads, old = model_config.num_attention_heads, model_config.kv_heads
    out = dict(state_dict)
    found = 0
    for name, tensor in state_dict.items():
        if name.endswith(QKV_SUFFIXES) and isinstance(tensor, torch.Tensor):
            out[name] = pool_qkv(tensor, heads, old, num_query_groups)
            found += 1
    if not found:
        raise ValueError("no self_attention.linear_qkv tensors in the state dict")
    return out


def _holds_conversion(output: Path, checkpoint, num_query_groups: int) -> bool:
    """Whether ``output`` is :func:`convert_to_gqa`'s folder for ``checkpoint`` at
    ``num_query_groups`` KV heads (its ``state.json`` names both)."""
    from dmc.inference.loading import resolve_checkpoint

    state_path = output / "state.json"
    if not state_path.is_file():
        return False
    state = json.loads(state_path.read_text())
    path = Path(checkpoint)
    source = path if path.is_file() else resolve_checkpoint(path)
    return (state.get("kind") == "gqa_conversion" and state.get("source") == str(source)
            and state.get("model_config", {}).get("num_query_groups") == num_query_groups)


def convert_to_gqa(checkpoint, num_query_groups: int, output) -> Path:
    """Convert the vanilla model at ``checkpoint`` (a dmc checkpoint folder, a checkpoints or run
    folder, or an inference ``.pt`` file) to ``num_query_groups`` KV heads and write a dmc
    checkpoint folder at ``output`` (``state.json`` + megatron distributed checkpoint, TP = 1):
    ``dmc.inference.load_model``, the Engine, ``dmc eval`` and
    ``dmc retrofit ... checkpoint.load_base=OUTPUT`` read it. Returns ``output``; an ``output``
    that already holds this conversion (a requeued job's: it is written whole or not at all)
    is returned as it is."""
    from megatron.core import dist_checkpointing

    from dmc.inference.loading import load_model
    from dmc.megatron.model import build_model_from_config

    output = Path(output)
    if output.exists():
        if _holds_conversion(output, checkpoint, num_query_groups):
            return output
        raise ValueError(f"--output {output} already exists (and holds no conversion of "
                         f"{checkpoint} to {num_query_groups} KV heads); choose a new folder")
    loaded = load_model(checkpoint)
    if loaded.dmc_config is not None:
        raise ValueError(f"--checkpoint {loaded.source} is a DMC model (dmc_config "
                         f"{loaded.dmc_config}); GQA conversion needs a vanilla model")
    groups = loaded.model_config.kv_heads
    if not isinstance(num_query_groups, int) or num_query_groups < 1 or groups % num_query_groups:
        accepted = [g for g in range(1, groups + 1) if groups % g == 0]
        raise ValueError(f"--num-query-groups must divide the model's {groups} KV heads; "
                         f"accepted: {accepted}; got {num_query_groups!r}")
    model_config = dataclasses.replace(loaded.model_config, num_query_groups=num_query_groups,
                                       params_dtype=None)
    model = build_model_from_config(model_config, None)
    state_dict = convert_state_dict(loaded.model.state_dict(), loaded.model_config,
                                    num_query_groups)
    model.load_state_dict(state_dict)

    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(tmp))
    config = loaded.state.get("config")
    if config is not None:
        config = dict(config, model=dict(config.get("model", {}),
                                         num_query_groups=num_query_groups))
    state = {"kind": "gqa_conversion", "step": 0, "source": str(loaded.source),
             "source_num_query_groups": groups, "model_config": model_config.to_dict(),
             "dmc_config": None, "config": config, "tp": 1, "pp": 1}
    (tmp / "state.json").write_text(json.dumps(state, indent=1, default=str))
    os.replace(tmp, output)
    return output
