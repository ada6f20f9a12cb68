"""``dmc convert``: ``hf-to-mcore``, ``mcore-to-hf``, ``nvidia-dmc`` and ``nvidia-dms``."""
from __future__ import annotations

import json
import os


def _clear_errors(handler):
    """Reports a non-empty output folder or a missing tensor as ValueError, which ``dmc``
    prints as a one-line error."""
    def run(args) -> int:
        try:
            return handler(args)
        except (FileExistsError, KeyError) as err:
            raise ValueError(str(err).strip("'\"")) from err

    return run


def _print(args, summary: dict) -> int:
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        for key in ("output", "yaml", "tokenizer", "files", "measured_cr", "note"):
            if key in summary:
                print(f"{key}: {summary[key]}")
    return 0


def run_hf_to_mcore(args) -> int:
    from dmc.convert import hf_to_mcore

    return _print(args, hf_to_mcore(args.input, args.output, tp=args.tp, pp=args.pp,
                                    dtype=args.dtype))


def run_mcore_to_hf(args) -> int:
    from dmc.convert import mcore_to_hf

    if not 0 < args.max_shard_gb < float("inf"):
        raise ValueError(f"--max-shard-gb must be a number > 0, got {args.max_shard_gb}")
    if args.cr_max_tokens < 2:
        raise ValueError(f"--cr-max-tokens must be >= 2, got {args.cr_max_tokens}")
    cr_tokens = None
    if args.cr_text:
        if not os.path.isfile(args.cr_text):
            raise ValueError(f"--cr-text {args.cr_text}: no such file (a text file to measure "
                             f"the compression ratio on)")
        from dmc.data import load_tokenizer
        from dmc.inference.loading import model_tokenizer

        source = args.tokenizer or model_tokenizer(args.input)
        if source is None:
            raise ValueError(f"--cr-text: no tokenizer found for {args.input} (neither in the "
                             f"checkpoint folder nor in its run's data.path); pass --tokenizer")
        with open(args.cr_text) as f:
            cr_tokens = load_tokenizer(source).encode(f.read())[: args.cr_max_tokens]
    return _print(args, mcore_to_hf(args.input, args.output, tokenizer=args.tokenizer,
                                    dtype=args.dtype,
                                    max_shard_bytes=int(args.max_shard_gb * 2**30),
                                    cr_tokens=cr_tokens))


def run_nvidia(args) -> int:
    from dmc.convert import nvidia_dmc_to_mcore

    return _print(args, nvidia_dmc_to_mcore(args.input, args.output, tokenizer=args.tokenizer,
                                            vocab_size=args.vocab_size, tp=args.tp, pp=args.pp,
                                            trust_pickle=args.trust_pickle))


def run_nvidia_dms(args) -> int:
    from dmc.convert import nvidia_dms_to_mcore

    return _print(args, nvidia_dms_to_mcore(args.input, args.output, tp=args.tp, pp=args.pp,
                                            dtype=args.dtype))


DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(name: str, parser) -> None:
    """The options of ``dmc convert NAME`` (shared with ``checkpoints_convert/*.py``)."""
    parser.add_argument("input", help={
        "hf-to-mcore": "Hugging Face Llama or Qwen3 folder (config.json + safetensors or .bin)",
        "nvidia-dms": "NVIDIA Model-Optimizer DMS folder (Qwen3 config.json with dms_* fields "
                      "+ safetensors), e.g. nvidia/Qwen3-8B-DMS-8x",
        "mcore-to-hf": "dmc checkpoint, checkpoints folder or run folder",
        "nvidia-dmc": "Megatron-LM checkpoint root (latest_checkpointed_iteration.txt) or "
                      "iter_XXXXXXX folder"}[name])
    parser.add_argument("output", help="output folder (must not exist or be empty)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    if name in ("hf-to-mcore", "nvidia-dmc", "nvidia-dms"):
        parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to save at")
        parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to save at")
    if name in ("hf-to-mcore", "mcore-to-hf", "nvidia-dms"):
        parser.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: keep)")
    if name in ("mcore-to-hf", "nvidia-dmc"):
        parser.add_argument("--tokenizer", help="tokenizer file or folder to copy")
    if name == "mcore-to-hf":
        parser.add_argument("--max-shard-gb", type=float, default=5.0,
                            help="largest safetensors shard in GiB")
        parser.add_argument("--cr-text", help="text file on which to measure the DMC/DMS "
                            "compression ratio stored in config.json (dmc_measured_cr or "
                            "dms_measured_cr)")
        parser.add_argument("--cr-max-tokens", type=int, default=4096)
    if name == "nvidia-dmc":
        parser.add_argument("--vocab-size", type=int,
                            help="true vocabulary size: drop Megatron's padding rows")
        parser.add_argument("--trust-pickle", action="store_true",
                            help="read the .pt files with weights_only=False (trusted files only)")


HANDLERS = {"hf-to-mcore": _clear_errors(run_hf_to_mcore),
            "mcore-to-hf": _clear_errors(run_mcore_to_hf),
            "nvidia-dmc": _clear_errors(run_nvidia),
            "nvidia-dms": _clear_errors(run_nvidia_dms)}
HELP = {"hf-to-mcore": "Hugging Face Llama / Qwen3 folder -> megatron-core checkpoint + model YAML",
        "mcore-to-hf": ("dmc checkpoint -> Hugging Face folder (DMC / DMS models with "
                        "modeling_dmc.py / modeling_dms.py)"),
        "nvidia-dmc": "NVIDIA Megatron-LM DMC checkpoint -> dmc checkpoint",
        "nvidia-dms": "NVIDIA Model-Optimizer DMS checkpoint (Hugging Face) -> dmc checkpoint"}


def register(sub) -> None:
    parser = sub.add_parser("convert", help="convert checkpoints (Hugging Face, NVIDIA DMC / DMS)")
    convert_sub = parser.add_subparsers(dest="convert_command", required=True)
    for name, handler in HANDLERS.items():
        p = convert_sub.add_parser(name, help=HELP[name])
        add_arguments(name, p)
        p.set_defaults(handler=handler)


def main(name: str, argv=None) -> int:
    """Entry point of the ``checkpoints_convert/*.py`` wrappers."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog=f"dmc convert {name}", description=HELP[name])
    add_arguments(name, parser)
    args = parser.parse_args(argv)
    try:
        return HANDLERS[name](args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"dmc convert {name}: error: {err}", file=sys.stderr)
        return 2
