"""Command-line flags shared by the commands that serve a model with the engine (``dmc generate``,
``dmc eval ppl``, ``dmc eval compare``). Importing this module does not import torch."""
from __future__ import annotations

import argparse


CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """``--model PATH`` (alias ``--state-dict``): anything :func:`load_model` reads."""
    parser.add_argument("--model", "--state-dict", dest="model", required=True, metavar="PATH",
                        help="an inference .pt file (dmc.inference.save_inference_state), a "
                        "training checkpoint folder, or a run folder (its latest checkpoint)")


def add_cache_arguments(parser: argparse.ArgumentParser, *, dtype: bool = True) -> None:
    """The engine's cache flags: ``--chunk-size``, ``--page-size`` and (``dtype``)
    ``--cache-dtype`` (read back with :func:`cache_dtype`)."""
    parser.add_argument("--chunk-size", type=int, default=512,
                        help="prefill chunk in tokens (default: %(default)s)")
    parser.add_argument("--page-size", type=int, default=16,
                        help="slots per KV page (default: %(default)s)")
    if dtype:
        parser.add_argument("--cache-dtype", choices=CACHE_DTYPES, default="auto",
                            help="KV cache dtype (default: the model's)")


def cache_dtype(name: str):
    """``--cache-dtype`` as a torch dtype; None for ``auto`` (the model's)."""
    import torch

    return None if name == "auto" else getattr(torch, name)


def check_tokens_fit(engine, sequences, what: str, new_tokens: int = 0) -> None:
    """Raises ValueError naming ``what`` (the flags the tokens came from) when a sequence plus
    the ``new_tokens`` it will generate (the last never fed back) is longer than the model's
    ``max_seq_length``, or holds an id outside its vocabulary."""
    limit, vocab = engine.model.max_sequence_length, engine.model.vocab_size
    longest = max(len(s) for s in sequences) + max(new_tokens - 1, 0)
    if longest > limit:
        raise ValueError(f"{what}: {longest} tokens exceed the model's max_seq_length ({limit})")
    bad = [int(t) for s in sequences for t in s if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"{what}: token id {bad[0]} is outside the model's vocabulary "
                         f"[0, {vocab})")
