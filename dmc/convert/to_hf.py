"""This project's checkpoints -> a Hugging Face folder (``dmc convert mcore-to-hf``).

Vanilla and GQA models become ``LlamaForCausalLM`` folders (``Qwen3ForCausalLM`` with
``model.qk_layernorm``). DMC models (any phase after the
decision rows were zeroed) become ``DMCLlamaForCausalLM`` folders: ``config.json`` carries
``dmc_window``, ``dmc_c``, ``dmc_omega_offset``, ``dmc_channel`` ("last"), the target CR and the
CR measured at export,
and an ``auto_map`` to ``modeling_dmc.py`` (a copy of :mod:`dmc.convert.hf_modeling_dmc`, shipped
with :mod:`dmc.convert.hf_modeling_common` and the ``dmc/ops`` files they import: ``METHOD_FILES``),
so that ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads it.
DMS models (``dmc.method: dms``, DMS paper arXiv 2506.05345 Sec. 3) become
``DMSLlamaForCausalLM`` folders the same way: ``dms_window``, ``dms_c``, ``dms_logit_scale``,
``dms_channel``, ``dms_target_cr``, ``dms_measured_cr`` and ``modeling_dms.py``
(:mod:`dmc.convert.hf_modeling_dms`); adapter decisions (``dmc.dms_decision: adapter``) add
``dms_decision`` and the tensors ``model.layers.i.self_attn.dms_decision_proj.weight``
(:mod:`dmc.convert.mapping`). Models with ``qk_layernorm`` or ``kv_channels`` add
``qk_norm`` and ``head_dim`` to either.

``config.json`` carries the shipped tokenizer's ``bos_token_id`` / ``eos_token_id`` /
``pad_token_id`` (:func:`special_token_ids`), and so does a ``generation_config.json`` where the
tokenizer files bring none, so that ``generate()`` stops at the end-of-sequence token.
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch

import dmc.ops
from dmc.convert.hf_config import hf_config_from_model_config
from dmc.convert.hf_io import copy_tokenizer, read_json_object, write_safetensors
from dmc.convert.hf_tokenizer import sentencepiece_to_tokenizer_json
from dmc.convert.mapping import mcore_to_hf_state
from dmc.inference.loading import find_tokenizer

COMMON_FILE = "hf_modeling_common.py"
# per method: (this package's modeling file, its name in the export, the dmc.ops files it and
# COMMON_FILE import relatively, shipped next to it, auto_map)
METHOD_FILES = {
    "dmc": ("hf_modeling_dmc.py", "modeling_dmc.py",
            ("algorithm1.py", "accumulate.py", "decisions.py", "mask.py", "rope.py"),
            {"AutoConfig": "modeling_dmc.DMCLlamaConfig",
             "AutoModelForCausalLM": "modeling_dmc.DMCLlamaForCausalLM"}),
    "dms": ("hf_modeling_dms.py", "modeling_dms.py", ("decisions.py", "mask.py", "rope.py"),
            {"AutoConfig": "modeling_dms.DMSLlamaConfig",
             "AutoModelForCausalLM": "modeling_dms.DMSLlamaForCausalLM"}),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GENERATION_CONFIG = "generation_config.json"
SPECIAL_TOKENS = ("bos", "eos", "pad")


def mcore_to_hf(checkpoint, out_folder, *, tokenizer=None, dtype: str | None = None,
                max_shard_bytes: int = 5 * 2**30, cr_tokens=None) -> dict:
    """Exports ``checkpoint`` (a checkpoint, checkpoints or run folder, any TP/PP) to
    ``out_folder`` (must not exist or be empty).

    tokenizer: tokenizer file or folder to copy; default: :func:`find_tokenizer` (the
        checkpoint folder's own, else the run's prepared data).
    dtype: "float32", "bfloat16" or "float16" (default: the checkpoint's parameter dtype).
    cr_tokens: token ids on which to measure the DMC/DMS compression ratio with
        :class:`dmc.inference.Engine` (stored as ``dmc_measured_cr`` / ``dms_measured_cr``);
        None = not measured.
    Returns a summary (files, config, measured CR).
    """
    from dmc.inference.loading import load_model

    out = Path(out_folder)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output folder {out} exists and is not empty")
    loaded = load_model(checkpoint)
    model_config, dmc_config = loaded.model_config, loaded.dmc_config
    if dtype is None:
        dtype = loaded.dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    state = {k: v.detach().cpu() for k, v in loaded.model.state_dict().items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    hf_state = {k: v.to(DTYPES[dtype]) for k, v in mcore_to_hf_state(state, model_config).items()}
    dmc_extra, measured = None, None
    if dmc_config is not None:
        if cr_tokens is not None:
            measured = measure_cr(loaded.model, cr_tokens)
        prefix = dmc_config.method
        dmc_extra = {f"{prefix}_target_cr": loaded.state.get("target_cr"),
                     f"{prefix}_measured_cr": measured,
                     "auto_map": METHOD_FILES[dmc_config.method][3]}
    out.mkdir(parents=True, exist_ok=True)
    copied = _export_tokenizer(tokenizer, loaded, out)
    token_ids = special_token_ids(out, copied)
    config = hf_config_from_model_config(model_config, dtype, dmc_config, dmc_extra, token_ids)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    files = write_safetensors(out, hf_state, max_shard_bytes)
    if token_ids and GENERATION_CONFIG not in copied:
        (out / GENERATION_CONFIG).write_text(json.dumps(token_ids, indent=1))
        files.append(GENERATION_CONFIG)
    if dmc_config is not None:
        source, modeling, ops_files, _ = METHOD_FILES[dmc_config.method]
        here = Path(__file__).parent
        shutil.copy2(here / source, out / modeling)
        shutil.copy2(here / COMMON_FILE, out / COMMON_FILE)
        ops = Path(dmc.ops.__file__).parent
        for name in ops_files:
            shutil.copy2(ops / name, out / name)
        files += [modeling, COMMON_FILE, *ops_files]
    return {"output": str(out), "config": config, "files": files, "tokenizer": copied,
            "measured_cr": measured}


def measure_cr(model, tokens) -> float:
    """Overall compression ratio (tokens x heads / slots) of the real compressed cache after
    teacher-forcing ``tokens`` through :class:`dmc.inference.Engine`."""
    from dmc.inference.engine import Engine

    tokens = [int(t) for t in tokens]
    engine = Engine(model, max_batch=1, max_seq_len=len(tokens), page_size=16)
    return float(engine.score(tokens).compression.overall)


def _export_tokenizer(tokenizer, loaded, out: Path) -> list[str]:
    """Copies the tokenizer (``tokenizer``, else :func:`find_tokenizer`'s) into ``out``; a bare
    SentencePiece model gets a ``tokenizer.json`` beside it (so ``AutoTokenizer`` needs no
    protobuf) and a ``tokenizer_config.json`` naming its special tokens. No tokenizer found:
    a warning, and the export has none."""
    source = Path(tokenizer) if tokenizer is not None else find_tokenizer(loaded.source,
                                                                          loaded.state)
    if source is None:
        warnings.warn(f"no tokenizer found for {loaded.source} (neither in the checkpoint "
                      f"folder nor in the run's data.path): the export has none; pass "
                      f"--tokenizer", stacklevel=3)
        return []
    if not source.exists():
        raise FileNotFoundError(f"tokenizer {source} does not exist")
    copied = copy_tokenizer(source, out)
    if not copied:
        raise FileNotFoundError(f"{source} holds no tokenizer.model or tokenizer.json")
    if "tokenizer.model" in copied and "tokenizer.json" not in copied:
        try:
            sentencepiece_to_tokenizer_json(out / "tokenizer.model", out / "tokenizer.json")
            copied.append("tokenizer.json")
        except ValueError as err:
            warnings.warn(f"{err}: the export carries tokenizer.model only (loading it with "
                          f"AutoTokenizer then needs protobuf)", stacklevel=3)
    if "tokenizer_config.json" not in copied:
        (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(out, copied)))
        copied.append("tokenizer_config.json")
    return copied


def _tokenizer_config(out: Path, copied: list[str]) -> dict:
    if "tokenizer.model" not in copied:
        return {"tokenizer_class": "LlamaTokenizerFast"}
    if "tokenizer.json" not in copied:
        return {"tokenizer_class": "LlamaTokenizer"}
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    ids = {"unk_token": sp.unk_id(), "bos_token": sp.bos_id(), "eos_token": sp.eos_id(),
           "pad_token": sp.pad_id()}
    return {"tokenizer_class": "PreTrainedTokenizerFast",
            **{name: sp.id_to_piece(i) for name, i in ids.items() if i >= 0}}


def special_token_ids(folder: Path, copied: list[str]) -> dict:
    """``{"bos_token_id", "eos_token_id", "pad_token_id"}`` (those the tokenizer defines) of
    the tokenizer files ``copied`` into ``folder``: the SentencePiece model's ``bos_id()`` /
    ``eos_id()`` / ``pad_id()`` (-1 = none), overridden by the tokens that a copied Hugging
    Face ``tokenizer_config.json`` / ``special_tokens_map.json`` name (which of the two wins:
    :func:`_hf_tokenizer_ids`), looked up in ``tokenizer.json`` as ``AutoTokenizer`` does
    (added tokens first, then the model's vocabulary). Transformers' ``PretrainedConfig`` /
    ``GenerationConfig`` fields of these names tell ``generate()`` where to start, stop and
    pad."""
    ids = {}
    if "tokenizer.model" in copied:
        ids.update(_sentencepiece_ids(folder / "tokenizer.model"))
    if "tokenizer.json" in copied:
        ids.update(_hf_tokenizer_ids(folder))
    return ids


def _sentencepiece_ids(model: Path) -> dict:
    """The special ids a SentencePiece model defines (``<name>_id() >= 0``)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    found = {"bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id()}
    return {f"{name}_token_id": i for name, i in found.items() if i >= 0}


def _hf_tokenizer_ids(folder: Path) -> dict:
    """The ids in ``folder/tokenizer.json`` of the special tokens named as AutoTokenizer
    (transformers 5.23) reads them: by ``tokenizer_config.json`` alone when it holds
    ``added_tokens_decoder`` (a null there is no token), else by ``special_tokens_map.json``
    over ``tokenizer_config.json``; a string or ``{"content": ...}`` as transformers writes
    them; a token the vocabulary lacks is left out."""
    config, mapped = (folder / name for name in ("tokenizer_config.json",
                                                 "special_tokens_map.json"))
    specs = [read_json_object(config) if config.is_file() else {}]
    if "added_tokens_decoder" not in specs[0] and mapped.is_file():
        specs.append(read_json_object(mapped))  # the later wins
    tokens = {}
    for spec in specs:
        for kind in SPECIAL_TOKENS:
            token = spec.get(f"{kind}_token")
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                tokens[kind] = token
    if not tokens:
        return {}
    vocab = _tokenizer_vocab(read_json_object(folder / "tokenizer.json"))
    return {f"{kind}_token_id": vocab[token] for kind, token in tokens.items() if token in vocab}


def _tokenizer_vocab(spec: dict) -> dict:
    """``{token: id}`` of a ``tokenizer.json``: the model's vocabulary (a dict for BPE /
    WordPiece / WordLevel, ``[[piece, score], ...]`` for Unigram) under its added tokens."""
    vocab = (spec.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list):
        vocab = {entry[0]: i for i, entry in enumerate(vocab)}
    added = {t["content"]: t["id"] for t in spec.get("added_tokens") or ()
             if isinstance(t, dict) and "content" in t and "id" in t}
    return {**vocab, **added}
