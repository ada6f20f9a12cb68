"""NVIDIA's released DMC checkpoints (Megatron-LM, ``dmc`` branch) -> this project's checkpoint.

Input layout (Megatron-LM's torch checkpoints)::

    ROOT/latest_checkpointed_iteration.txt      "1234" or "release"
    ROOT/iter_0001234/mp_rank_XX[_YYY]/model_optim_rng.pt      XX = TP rank, YYY = PP rank

Each file holds ``args`` (an ``argparse.Namespace``: architecture, parallel sizes and the DMC
settings ``dmc_window_size``, ``dmc_init_val`` (c), ``dmc_temp``, ``dmc_cr``) and ``model``, a
nested dict with the legacy names (``language_model.embedding.word_embeddings``,
``language_model.encoder.layers.N.self_attention.query_key_value``, ``input_norm`` or
``input_layernorm``, ``post_attention_norm`` or ``post_attention_layernorm``,
``mlp.dense_h_to_4h``, ``mlp.dense_4h_to_h``, ``final_norm`` or ``final_layernorm``,
``language_model.output_layer``) or megatron-core names. TP shards are merged (column-parallel
weights along dim 0, SwiGLU ``dense_h_to_4h`` per gate/up half, row-parallel along dim 1,
vocab-parallel embeddings along dim 0), PP stages renumbered. The fused QKV layout (grouped per
query group) and the decision channel (the last one of each head) are the same as ours, so no
permutation is needed.

Two settings of NVIDIA's code that the paper does not state are carried into the converted
``dmc_config`` (``megatron/contrib/dmc/dmc.py`` and ``triton.py`` of their branch):
``omega_offset = 2^-7``, since NVIDIA computes ``omega = sigmoid(q[..., -1] + c) + eps`` with
``eps = torch.finfo(torch.bfloat16).eps`` in its inference kernel and ``finfo(query dtype).eps``
in training (the same 2^-7 in its bf16 runs); and ``hard_loss = true``, since its CR loss counts
straight-through rounded decisions while attention uses the soft ones (for continued training;
inference always uses hard decisions).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from dmc.convert.from_hf import write_model_yaml
from dmc.convert.hf_io import copy_tokenizer
from dmc.convert.mcore_io import COLUMN_PARALLEL, ROW_PARALLEL, write_checkpoint
from dmc.megatron.config import DMCConfig, ModelConfig

CHECKPOINT_FILE = "model_optim_rng.pt"
TRACKER = "latest_checkpointed_iteration.txt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_LAYER_NAMES = {
    "input_norm.weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.query_key_value.weight": "self_attention.linear_qkv.weight",
    "self_attention.dense.weight": "self_attention.linear_proj.weight",
    "post_attention_norm.weight": "pre_mlp_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.dense_h_to_4h.weight": "mlp.linear_fc1.weight",
    "mlp.dense_4h_to_h.weight": "mlp.linear_fc2.weight",
    # megatron-core names (local and Transformer Engine specs)
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.weight": "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight": "self_attention.linear_proj.weight",
    "pre_mlp_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
}
_GLOBAL_NAMES = {
    "language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "language_model.output_layer.weight": "output_layer.weight",
    "language_model.encoder.final_norm.weight": "decoder.final_layernorm.weight",
    "language_model.encoder.final_layernorm.weight": "decoder.final_layernorm.weight",
    "language_model.transformer.final_layernorm.weight": "decoder.final_layernorm.weight",
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "output_layer.weight": "output_layer.weight",
    "decoder.final_layernorm.weight": "decoder.final_layernorm.weight",
}
_LAYER = re.compile(r"^(?:language_model\.(?:encoder|transformer)|decoder)\.layers\.(\d+)\.(.+)$")
_IGNORED = ("_extra_state", "rotary_pos_emb.inv_freq")
NVIDIA_OMEGA_OFFSET = 2.0 ** -7  # torch.finfo(torch.bfloat16).eps


def iteration_dir(root: Path) -> Path:
    """The folder holding ``mp_rank_*``: ``root`` itself, or the iteration that ``root``'s
    tracker file names."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"NVIDIA checkpoint folder {root} does not exist")
    if any(_RANK_DIR.match(p.name) for p in root.iterdir()):
        return root
    tracker = root / TRACKER
    if not tracker.is_file():
        raise FileNotFoundError(
            f"{root}: neither mp_rank_XX folders nor {TRACKER} (expected a Megatron-LM "
            f"checkpoint root or one of its iter_XXXXXXX folders)")
    it = tracker.read_text().strip()
    folder = root / ("release" if it == "release" else f"iter_{int(it):07d}")
    if not folder.is_dir():
        raise FileNotFoundError(f"{tracker} names iteration {it}, but {folder} does not exist")
    return folder


def load_rank_files(folder: Path, trust_pickle: bool = False) -> dict[tuple[int, int], dict]:
    """``{(tp_rank, pp_rank): checkpoint dict}`` for every ``mp_rank_*`` folder."""
    found = {}
    for sub in sorted(folder.iterdir()):
        match = _RANK_DIR.match(sub.name)
        if not match:
            continue
        path = sub / CHECKPOINT_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{sub}: {CHECKPOINT_FILE} is missing")
        found[(int(match[1]), int(match[2] or 0))] = _torch_load(path, trust_pickle)
    return found


def _torch_load(path: Path, trust_pickle: bool) -> dict:
    if trust_pickle:
        return torch.load(path, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle refuses a class outside the allow-list
        raise ValueError(
            f"{path}: cannot be read with weights_only=True ({err}); if you trust the file, pass "
            f"--trust-pickle (trust_pickle=True)") from err


def flatten(tree: dict, prefix: str = "") -> dict:
    """Nested state dicts (legacy Megatron) -> ``{"a.b.c": tensor}``."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, torch.Tensor):
            flat[name] = value
    return flat


def mcore_names(flat: dict, layer_offset: int, source: str) -> dict:
    """Legacy or megatron-core names of one rank file -> our names (global layer index)."""
    out, unknown = {}, []
    for name, tensor in flat.items():
        if name.endswith(_IGNORED):
            continue
        if name in _GLOBAL_NAMES:
            out[_GLOBAL_NAMES[name]] = tensor
            continue
        match = _LAYER.match(name)
        if match and match[2] in _LAYER_NAMES:
            out[f"decoder.layers.{int(match[1]) + layer_offset}.{_LAYER_NAMES[match[2]]}"] = tensor
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"{source}: tensors with no mapping (biases or an unsupported "
                         f"architecture?): {unknown[:8]}")
    return out


def merge_tp(shards: list[dict], source: str) -> dict:
    """Full tensors from the TP shards of one pipeline stage (each a dict of our names)."""
    names = set(shards[0])
    for rank, shard in enumerate(shards[1:], 1):
        if set(shard) != names:
            raise ValueError(f"{source}: TP rank {rank} holds different tensors than rank 0: "
                             f"{sorted(names ^ set(shard))[:6]}")
    full = {}
    for name in names:
        parts = [s[name] for s in shards]
        if len(parts) == 1 or parts[0].dim() == 1:
            full[name] = parts[0]
        elif name.endswith("linear_fc1.weight"):
            halves = [p.chunk(2) for p in parts]
            full[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        elif name.endswith(COLUMN_PARALLEL):
            full[name] = torch.cat(parts, dim=0)
        elif name.endswith(ROW_PARALLEL):
            full[name] = torch.cat(parts, dim=1)
        else:
            raise ValueError(f"{source}: do not know how {name} is sharded")
    return full


def _arg(args, name, default=None):
    return getattr(args, name, default) if getattr(args, name, None) is not None else default


def _rope_problems(args) -> list[str]:
    """The RoPE variants of Megatron-LM's args that this project's models do not have:
    ``--rotary-seq-len-interpolation-factor`` (positions divided by it, megatron-core's
    ``RotaryEmbedding(seq_len_interpolation_factor=...)``) and ``--rotary-interleaved``
    (GPT-J's interleaved pairs instead of rotate-half)."""
    problems = []
    factor = _arg(args, "rotary_seq_len_interpolation_factor")
    if factor not in (None, 1):
        problems.append(f"rotary_seq_len_interpolation_factor={factor!r}, accepted: None, 1")
    if _arg(args, "rotary_interleaved", False):
        problems.append("rotary_interleaved=True, accepted: False (rotate-half RoPE)")
    return problems


def _rope_scaling_factor(args) -> float | None:
    """:attr:`ModelConfig.rope_scaling_factor` of Megatron-LM's ``--use-rope-scaling`` (Llama
    3.x frequency scaling, megatron-core's ``RotaryEmbedding(rope_scaling=True)``) with its
    ``--rope-scaling-factor`` (Megatron-LM's default 8.0); None without scaling."""
    if not _arg(args, "use_rope_scaling", False):
        return None
    return float(_arg(args, "rope_scaling_factor", 8.0))


def configs_from_args(args, vocab_rows: int, dtype: torch.dtype, source: str
                      ) -> tuple[ModelConfig, DMCConfig]:
    """``(model_config, dmc_config)`` from the checkpoint's ``args``; ValueError naming every
    arg that the conversion cannot reproduce."""
    problems = []
    if not _arg(args, "swiglu", False):
        problems.append("swiglu must be true (Llama MLP)")
    if _arg(args, "normalization", "RMSNorm") != "RMSNorm":
        problems.append(f"normalization={args.normalization!r}, accepted: RMSNorm")
    if _arg(args, "add_bias_linear", False) or _arg(args, "add_qkv_bias", False):
        problems.append("linear biases are not supported (add_bias_linear / add_qkv_bias)")
    if _arg(args, "position_embedding_type", "rope") != "rope":
        problems.append(f"position_embedding_type={args.position_embedding_type!r}, accepted: rope")
    if float(_arg(args, "rotary_percent", 1.0)) != 1.0:
        problems.append(f"rotary_percent={args.rotary_percent}, accepted: 1.0")
    problems += _rope_problems(args)
    if _arg(args, "virtual_pipeline_model_parallel_size") not in (None, 1):
        problems.append("virtual pipeline parallelism is not supported")
    if not hasattr(args, "dmc_window_size"):
        problems.append("args lack dmc_window_size: not a checkpoint of NVIDIA's DMC branch")
    elif _arg(args, "dmc_is_stage_one", False):
        problems.append("dmc_is_stage_one: a zero-out (stage one) checkpoint; convert a "
                        "retrofitted (stage two) one")
    elif int(args.dmc_window_size) < 1:
        problems.append(f"dmc_window_size={args.dmc_window_size}, accepted: >= 1")
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems))
    heads = args.num_attention_heads
    groups = _arg(args, "num_query_groups", heads) if _arg(args, "group_query_attention") else heads
    model_config = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=_arg(args, "ffn_hidden_size", 4 * args.hidden_size),
        vocab_size=vocab_rows,
        max_seq_length=_arg(args, "max_position_embeddings", _arg(args, "seq_length", 4096)),
        rotary_base=float(_arg(args, "rotary_base", 10000.0)),
        norm_epsilon=float(_arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5))),
        share_embeddings=not _arg(args, "untie_embeddings_and_output_weights", False),
        rope_scaling_factor=_rope_scaling_factor(args),
        params_dtype=str(dtype).removeprefix("torch."))
    dmc_config = DMCConfig(window=int(args.dmc_window_size), tau=float(_arg(args, "dmc_temp", 0.1)),
                           c=float(_arg(args, "dmc_init_val", 5.0)), hard=False, hard_loss=True,
                           omega_offset=NVIDIA_OMEGA_OFFSET)
    return model_config, dmc_config


def nvidia_dmc_to_mcore(source, out_folder, *, tokenizer=None, vocab_size: int | None = None,
                        tp: int = 1, pp: int = 1, trust_pickle: bool = False) -> dict:
    """Converts an NVIDIA DMC checkpoint (root or iteration folder) into ``out_folder``.

    vocab_size: the tokenizer's vocabulary, to drop Megatron's padding rows (default: keep).
    tokenizer: tokenizer file or folder copied alongside. tp/pp: layout of the written
    checkpoint. trust_pickle: read the ``.pt`` files with ``weights_only=False``.
    Returns a summary (model_config, dmc_config, yaml path).
    """
    folder = iteration_dir(Path(source))
    files = load_rank_files(folder, trust_pickle)
    if not files:
        raise FileNotFoundError(f"{folder}: no mp_rank_XX folders")
    args = next(iter(files.values())).get("args")
    if not isinstance(args, argparse.Namespace):
        raise ValueError(f"{folder}: checkpoint has no 'args' Namespace")
    src_tp, src_pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    expected = {(t, p) for t in range(src_tp) for p in range(src_pp)}
    if set(files) != expected:
        raise FileNotFoundError(f"{folder}: args say TP={src_tp}, PP={src_pp} but rank folders "
                                f"{sorted(expected - set(files))} are missing")
    per_stage = args.num_layers // src_pp
    full = {}
    for p in range(src_pp):
        shards = []
        for t in range(src_tp):
            ckpt = files[(t, p)]
            if "model" not in ckpt:
                raise ValueError(f"{folder}: rank ({t}, {p}) has no 'model' (virtual pipeline "
                                 f"'model0' checkpoints are not supported)")
            shards.append(mcore_names(flatten(ckpt["model"]), p * per_stage,
                                      f"{folder}/mp_rank_{t:02d}"))
        full.update(merge_tp(shards, str(folder)))
    embedding = full["embedding.word_embeddings.weight"]
    if vocab_size is not None:
        if vocab_size > embedding.shape[0]:
            raise ValueError(f"vocab_size={vocab_size} exceeds the checkpoint's "
                             f"{embedding.shape[0]} embedding rows")
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if name in full:
                full[name] = full[name][:vocab_size]
    model_config, dmc_config = configs_from_args(args, full["embedding.word_embeddings.weight"]
                                                 .shape[0], embedding.dtype, str(folder))
    extra = {"source": {"format": "megatron-lm-dmc", "path": str(folder),
                        "iteration": files[(0, 0)].get("iteration")},
             "target_cr": float(_arg(args, "dmc_cr", 0.0)) or None}
    write_checkpoint(out_folder, full, model_config, dmc_config, tp=tp, pp=pp, extra=extra)
    copied = copy_tokenizer(Path(tokenizer), Path(out_folder)) if tokenizer else []
    yaml_path = write_model_yaml(Path(out_folder), model_config, f"NVIDIA DMC checkpoint {folder}")
    return {"output": str(out_folder), "model_config": model_config.to_dict(),
            "dmc_config": dmc_config.to_dict(), "tokenizer": copied, "yaml": str(yaml_path)}
