"""Perplexity on held-out tokens with the REAL compressed cache (``dmc eval ppl``).

Each held-out sequence is teacher-forced through :meth:`dmc.inference.Engine.score`: chunked
prefill into the paged cache (DMC merges included), logits of every position, NLL of every next
token. The measured compression ratio (tokens seen / slots kept) is reported overall, per layer and
per KV head, summed over all sequences. :func:`model_perplexity` is the same number from the
eval-mode megatron model's full forward (no cache), for cross-checks.

Token sources (:func:`load_token_sequences`): a megatron indexed dataset prefix
(``PREFIX.bin``/``PREFIX.idx``), a folder made by ``dmc data prepare`` (its ``valid`` split), or
a ``.pt``/``.npy`` file holding a 1-D token stream or a 2-D ``[sequences, length]`` array.
A stream (documents concatenated, EOD ids kept) is cut into non-overlapping ``seq_len`` windows;
a 2-D array's rows are the sequences, whole (``seq_len`` does not apply to them).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from dmc.inference.cli_args import (
    add_cache_arguments,
    add_model_argument,
    cache_dtype,
    check_tokens_fit,
)

DEFAULT_SEQ_LEN = 256


def token_windows(stream: Sequence[int] | torch.Tensor, seq_len: int,
                  num_sequences: int | None = None) -> list[list[int]]:
    """Non-overlapping ``seq_len``-token windows of a 1-D stream (the incomplete tail dropped),
    at most ``num_sequences`` of them."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (one prediction needs two tokens), got {seq_len}")
    stream = torch.as_tensor(stream).reshape(-1).tolist()
    count = len(stream) // seq_len
    if num_sequences is not None:
        count = min(count, num_sequences)
    return [stream[i * seq_len:(i + 1) * seq_len] for i in range(count)]


def load_token_sequences(path: str | os.PathLike, seq_len: int,
                         num_sequences: int | None = None) -> list[list[int]]:
    """Held-out sequences from ``path`` (see the module docstring for the accepted sources)."""
    path = Path(path)
    if path.suffix in (".pt", ".npy") and path.is_file():
        data = _load_token_array(path)
        if data.dim() == 2:
            rows = data[:num_sequences] if num_sequences is not None else data
            return [row.tolist() for row in rows]
        if data.dim() != 1:
            raise ValueError(f"--data {path}: expected a 1-D token stream or a 2-D [N, L] array "
                             f"of token ids, got {data.dim()} dimensions")
        return token_windows(data, seq_len, num_sequences)
    prefix = path
    if path.is_dir():
        from dmc.data.prepare import split_prefix

        prefix = split_prefix(path, "valid")
    if not Path(f"{prefix}.bin").is_file() or not Path(f"{prefix}.idx").is_file():
        raise FileNotFoundError(
            f"no tokens at {str(path)!r}: expected a .pt/.npy file, an indexed dataset prefix "
            f"(PREFIX.bin + PREFIX.idx) or a folder made by `dmc data prepare`"
        )
    from dmc.data.indexed import read_indexed_dataset

    stream = [t for doc in read_indexed_dataset(prefix) for t in doc]
    return token_windows(stream, seq_len, num_sequences)


def _load_token_array(path: Path) -> torch.Tensor:
    """The integer tensor of a ``.pt`` (tensors only) or ``.npy`` (no pickled objects) file;
    ValueError naming ``--data`` for a file that is neither or holds something else."""
    accepted = ("accepted: a 1-D token stream or a 2-D [N, L] integer array saved by torch.save "
                "or numpy.save")
    loader = "torch.load" if path.suffix == ".pt" else "numpy.load"
    try:
        if path.suffix == ".pt":
            data = torch.load(path, map_location="cpu", weights_only=True)
        else:
            import numpy

            data = numpy.load(path)
    except Exception as err:  # not such a file, or one holding pickled objects
        raise ValueError(f"--data {path}: not a {path.suffix} file of token ids "
                         f"({type(err).__name__} from {loader}); {accepted}") from err
    try:
        data = torch.as_tensor(data)
    except (TypeError, ValueError, RuntimeError):  # a dict, strings, ...
        what = f"an array of {data.dtype}" if hasattr(data, "dtype") else f"a {type(data).__name__}"
        raise ValueError(f"--data {path}: holds {what}, not token ids; {accepted}") from None
    if data.is_floating_point() or data.is_complex() or data.dtype == torch.bool:
        raise ValueError(f"--data {path}: token ids must be integers, got {data.dtype}")
    return data.long()


def evaluate_perplexity(engine, sequences: Iterable[Sequence[int]], *,
                        prefill_tokens: int | None = None, reference: list | None = None,
                        keep_logprobs: bool = False, progress: bool = False) -> dict:
    """Perplexity of ``sequences`` through ``engine`` (a :class:`dmc.inference.Engine`), with
    its real compressed cache, ``engine.max_batch`` sequences at a time
    (:meth:`Engine.score_batch`).

    ``prefill_tokens=None``: each sequence is prefilled whole and every next token is scored.
    ``prefill_tokens=P``: the first ``P`` tokens are prefilled (a policy compresses them as
    before generating), the rest are teacher-forced one at a time through the decode path, and
    only the predictions the decode path makes are scored (of tokens ``P + 1 .. n - 1``): the
    prefix, where every method sees the whole context, is excluded.

    ``reference``: the ``logprobs`` of another run over the same sequences and ``prefill_tokens``
    (``keep_logprobs=True``; e.g. the uncompressed control): adds the KL divergence
    ``KL(reference || this)`` of the next-token distributions and the greedy top-1 agreement,
    per scored token. Returns a JSON-able dict (plus ``"logprobs"``, a list of per-sequence
    ``[scored, vocab]`` float32 tensors, with ``keep_logprobs``)::

        {"perplexity", "perplexity_ci" (95%, sequences resampled), "nll" (mean per scored
         token), "tokens" (scored), "sequences", "prefill_tokens", "chunk_size", "page_size",
         "dmc": bool, "per_sequence_nll",
         "kl", "kl_ci", "top1_agreement", "top1_ci" (with a reference),
         "compression": {"cr", "tokens", "slots", "per_layer", "per_head"},
         "cache_bytes": {"kv", "metadata", "dmc_state", "policy_state", "total"} (summed)}
    """
    from dmc.eval.stats import mean_interval
    from dmc.inference import CompressionStats

    sequences = [list(s) for s in sequences]
    if not sequences:
        raise ValueError("evaluate_perplexity: no sequences")
    if any(len(s) < 2 for s in sequences):
        raise ValueError("evaluate_perplexity: every sequence needs at least two tokens")
    if prefill_tokens is not None and any(not 1 <= prefill_tokens < len(s) - 1
                                          for s in sequences):
        raise ValueError(f"evaluate_perplexity: prefill_tokens={prefill_tokens} leaves no "
                         f"decoded prediction to score in a sequence")
    if reference is not None and len(reference) != len(sequences):
        raise ValueError(f"evaluate_perplexity: {len(reference)} reference entries for "
                         f"{len(sequences)} sequences")
    first = 0 if prefill_tokens is None else prefill_tokens  # first scored prediction's position
    nlls, counts, kls, agree, logprobs, stats, cache_bytes = [], [], [], [], [], [], []
    groups = range(0, len(sequences), engine.max_batch)
    if progress:
        from tqdm import tqdm

        groups = tqdm(groups, unit="batch", desc="ppl")
    for start in groups:
        batch = sequences[start:start + engine.max_batch]
        want_logits = keep_logprobs or reference is not None
        for i, result in enumerate(engine.score_batch(batch, prefill_tokens=prefill_tokens,
                                                      return_logits=want_logits),
                                   start=start):
            scored = result.token_logprobs[first:]
            nlls.append(-float(scored.sum()))
            counts.append(scored.numel())
            stats.append(result.compression)
            cache_bytes.append(result.cache_bytes)
            if not want_logits:
                continue
            logp = torch.log_softmax(result.logits[first:-1].float(), dim=-1)
            if keep_logprobs:
                logprobs.append(logp)
            if reference is not None:
                kl, same = _divergence(reference[i], logp)
                kls.append(kl)
                agree.append(same)
    tokens = sum(counts)
    mean = sum(nlls) / tokens
    per_token = [n / c for n, c in zip(nlls, counts)]
    low, high = mean_interval(per_token, counts)
    out = {
        "perplexity": math.exp(mean),
        "perplexity_ci": [math.exp(low), math.exp(high)],
        "nll": mean,
        "tokens": tokens,
        "sequences": len(sequences),
        "prefill_tokens": prefill_tokens,
        "chunk_size": engine.chunk_size,
        "page_size": engine.page_size,
        "dmc": engine.dmc is not None,
        "per_sequence_nll": per_token,
        "compression": CompressionStats.combine(stats).to_dict(),
        "cache_bytes": {k: sum(b[k] for b in cache_bytes) for k in cache_bytes[0]},
    }
    if reference is not None:
        out["kl"] = sum(kls) / tokens
        out["kl_ci"] = list(mean_interval([k / c for k, c in zip(kls, counts)], counts))
        out["top1_agreement"] = sum(agree) / tokens
        out["top1_ci"] = list(mean_interval([a / c for a, c in zip(agree, counts)], counts))
    if keep_logprobs:
        out["logprobs"] = logprobs
    return out


def _divergence(reference: torch.Tensor, logp: torch.Tensor) -> tuple[float, int]:
    """Summed ``KL(p_ref || p)`` over positions and the number of positions whose argmax
    agree, for log-probabilities ``reference, logp [positions, vocab]``."""
    if reference.shape != logp.shape:
        raise ValueError(f"reference log-probabilities {tuple(reference.shape)} do not match "
                         f"{tuple(logp.shape)} (same sequences and prefill_tokens?)")
    ref = reference.double()
    kl = (ref.exp() * (ref - logp.double())).sum()
    same = (ref.argmax(dim=-1) == logp.argmax(dim=-1)).sum()
    return float(kl), int(same)


@torch.inference_mode()
def model_perplexity(model, sequences: Iterable[Sequence[int]]) -> dict:
    """Perplexity from the megatron model's full forward (one sequence at a time). DMC models run
    in ``eval`` mode (hard decisions, the runtime's mode is restored afterwards): the number the
    engine's real cache must reproduce. Returns ``{"perplexity", "nll", "tokens", "sequences"}``."""
    from dmc.eval.forward_scorer import eval_mode

    device = next(model.parameters()).device
    nll, count, n = 0.0, 0, 0
    with eval_mode(model):
        for tokens in sequences:
            ids = torch.as_tensor(list(tokens), device=device)[None]
            positions = torch.arange(ids.shape[1], device=device)[None]
            logits = model(ids, positions, None)[0].double()
            logp = torch.log_softmax(logits[:-1], dim=-1)
            nll -= float(logp.gather(-1, ids[0, 1:, None]).sum())
            count += ids.shape[1] - 1
            n += 1
    if not count:
        raise ValueError("model_perplexity: no sequences")
    return {"perplexity": math.exp(nll / count), "nll": nll / count, "tokens": count,
            "sequences": n}


# ----------------------------------------------------------------------------- CLI
def add_ppl_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the ``dmc eval ppl`` flags on ``parser``; returns it."""
    add_model_argument(parser)
    parser.add_argument("--data", required=True, metavar="PATH",
                        help="held-out tokens: an indexed dataset prefix (PREFIX.bin/.idx), a "
                        "folder made by `dmc data prepare` (its valid split), or a .pt/.npy "
                        "1-D token stream or 2-D [N, L] array")
    parser.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                        help="tokens per evaluated sequence (default: %(default)s; a 2-D "
                        "array's rows are evaluated whole)")
    parser.add_argument("--num-sequences", type=int, default=None,
                        help="evaluate at most this many sequences (default: all)")
    add_cache_arguments(parser)
    parser.add_argument("--compare-full-forward", action="store_true",
                        help="also report the perplexity of the model's full forward (no cache)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def run_ppl(args: argparse.Namespace) -> int:
    """Run ``dmc eval ppl`` from parsed arguments; prints a summary (or JSON); returns 0."""
    from dmc.inference.engine import Engine

    if args.num_sequences is not None and args.num_sequences < 1:
        raise ValueError(f"--num-sequences must be >= 1 (or left out: all), got "
                         f"{args.num_sequences}")
    sequences = load_token_sequences(args.data, args.seq_len, args.num_sequences)
    if not sequences:
        raise ValueError(f"--data {args.data}: fewer than --seq-len={args.seq_len} tokens")
    longest = max(len(s) for s in sequences)
    engine = Engine.from_path(
        args.model, max_batch=1, page_size=args.page_size, chunk_size=args.chunk_size,
        max_seq_len=longest, cache_dtype=cache_dtype(args.cache_dtype),
    )
    check_tokens_fit(engine, sequences, f"--data {args.data} with --seq-len {args.seq_len}")
    result = evaluate_perplexity(engine, sequences, progress=not (args.quiet or args.json))
    if args.compare_full_forward:
        result["full_forward"] = model_perplexity(engine.model, sequences)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(summary(result))
    return 0


def summary(result: dict) -> str:
    comp = result["compression"]
    lines = [
        f"perplexity {result['perplexity']:.4f} (nll {result['nll']:.5f}) over "
        f"{result['tokens']} predicted tokens in {result['sequences']} sequences",
        f"measured CR {comp['cr']:.3f} ({comp['tokens']} tokens per KV head, {comp['slots']} "
        f"slots kept over {len(comp['per_layer'])} layers x {len(comp['per_head'][0])} KV heads)",
        "CR per layer " + " ".join(f"{x:.2f}" for x in comp["per_layer"]),
    ]
    if "full_forward" in result:
        lines.append(f"full forward perplexity {result['full_forward']['perplexity']:.4f}")
    return "\n".join(lines)
