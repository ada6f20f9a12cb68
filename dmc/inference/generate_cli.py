"""``dmc generate``: generation from a saved model file with the paged (DMC-compressed) cache.

The model file is what :func:`dmc.inference.save_inference_state` writes (``torch.save`` of a
plain dict, read with ``weights_only=True``)::

    {"format": 1,
     "model_config": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                      "ffn_hidden_size": 96, "vocab_size": 96,          # required
                      "num_query_groups": 2, "max_seq_length": 4096, "norm_epsilon": 1e-5,
                      "rotary_base": 10000.0, "share_embeddings": False,
                      "params_dtype": "float32", ...},   # other keys: TransformerConfig overrides
     "dmc_config": {"window": 12, "c": 5.0, ...} or None,  # DMCConfig fields; None = vanilla
     "state_dict": {name: tensor}}                          # the GPTModel's state dict

Prompts are token ids (``--prompt-ids "1 2 3"``) or text (``--prompt "..."``, encoded with
``--tokenizer``, else the tokenizer of the checkpoint folder or of its run's prepared data).
``--model`` may also name a training checkpoint (see :func:`dmc.inference.loading.load_model`).
megatron-core is imported only when the command runs.

Exit codes: 0 every request finished, 2 bad input, 3 (:data:`EXIT_REQUEST_FAILED`) some request
outgrew the page pool on its own (its result says so; the others are printed).
"""
from __future__ import annotations

import argparse
import json
import sys

from dmc.inference.cli_args import (
    add_cache_arguments,
    add_model_argument,
    cache_dtype,
    check_tokens_fit,
)


EXIT_REQUEST_FAILED = 3  # some request ended with finish_reason "cache_full"


def add_generate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the ``dmc generate`` flags on ``parser``; returns it."""
    add_model_argument(parser)
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                        help="a text prompt (tokenizer: --tokenizer, else the model's run data); "
                             "repeatable")
    parser.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                        help="a prompt as token ids separated by spaces or commas; repeatable")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="SentencePiece .model, tokenizer.json or a folder with one")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens to generate per prompt (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0 = all)")
    parser.add_argument("--seed", type=int, default=0,
                        help="sampling seed; prompt i uses seed + i (default: %(default)s)")
    parser.add_argument("--stop-token", type=int, action="append", default=None, metavar="ID",
                        help="stop after this id; repeatable (default: the tokenizer's EOD)")
    parser.add_argument("--no-stop", action="store_true",
                        help="ignore stop tokens: always generate --max-new-tokens")
    add_cache_arguments(parser)
    parser.add_argument("--num-pages", type=int, default=None,
                        help="KV pages in the pool (default: every prompt uncompressed)")
    parser.add_argument("--max-batch", type=int, default=8,
                        help="sequences decoded together (default: %(default)s)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="replay the steps that only decode from a CUDA graph per batch size "
                             "(dmc.inference.decode_graphs; on the CPU the same static step runs "
                             "eagerly)")
    parser.add_argument("--overlap", action="store_true",
                        help="with --cuda-graphs: launch each decode step before the previous "
                             "one is read back, the host's work beside the device's "
                             "(dmc.inference.overlap)")
    parser.add_argument("--stream", action="store_true",
                        help="print each request's new text (or token ids) as the steps sample "
                             "it, '[i] TEXT' lines, before the results (Engine.stream)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    return parser


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: expected integer token ids separated by "
                         f"spaces or commas") from None
    if not ids:
        raise ValueError(f"--prompt-ids {text!r}: no token ids")
    return ids


def run_generate(args: argparse.Namespace) -> int:
    """Run ``dmc generate`` from parsed arguments; prints each completion (or JSON). Returns 0,
    or :data:`EXIT_REQUEST_FAILED` when some request could not finish (``cache_full``: it
    outgrew the page pool alone); the others are printed all the same.

    Bad arguments raise ValueError / FileNotFoundError naming the flag."""
    from dmc.inference.engine import Engine
    from dmc.inference.sampling import SamplingParams

    tokenizer, source = None, args.tokenizer
    if source is None and args.prompt:
        from dmc.inference.loading import model_tokenizer

        source = model_tokenizer(args.model)
        if source is None:
            raise ValueError(f"--prompt: no tokenizer found for --model {args.model} (neither "
                             f"in the checkpoint folder nor in its run's data.path); pass "
                             f"--tokenizer (or give --prompt-ids)")
    if source is not None:
        from dmc.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(source)
    if args.stream and args.json:
        raise ValueError("--stream prints text as it comes; --json prints the results at the "
                         "end: give one of them")
    if args.overlap and not args.cuda_graphs:
        raise ValueError("--overlap needs --cuda-graphs (the decode steps it launches ahead "
                         "replay a batch size's static step)")
    prompts = [tokenizer.encode(p) for p in args.prompt] + [_parse_ids(p) for p in args.prompt_ids]
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-ids")
    if args.no_stop:
        stop = ()
    elif args.stop_token is not None:
        stop = tuple(args.stop_token)
    else:
        stop = (tokenizer.eod,) if tokenizer is not None and tokenizer.eod >= 0 else ()
    params = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_p=args.top_p, top_k=args.top_k, stop_tokens=stop,
                             seed=args.seed + i) for i in range(len(prompts))]
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    num_pages = args.num_pages
    engine = Engine.from_path(
        args.model, num_pages=num_pages, page_size=args.page_size,
        max_batch=min(args.max_batch, len(prompts)), max_seq_len=longest,
        chunk_size=args.chunk_size, cache_dtype=cache_dtype(args.cache_dtype), seed=args.seed,
        cuda_graphs=args.cuda_graphs, overlap=args.overlap,
    )
    check_tokens_fit(engine, prompts, "prompt + --max-new-tokens", args.max_new_tokens)
    if args.stop_token:
        check_tokens_fit(engine, [args.stop_token], "--stop-token")
    if args.stream:
        results = _print_stream(engine, prompts, params, tokenizer)
    else:
        results = engine.generate(prompts, params, progress=not (args.quiet or args.json))
    records = []
    for result in results:
        record = result.to_dict()
        if tokenizer is not None:
            record["text"] = tokenizer.decode(result.tokens)
        records.append(record)
    status = EXIT_REQUEST_FAILED if any(r.error for r in results) else 0
    if args.json:
        print(json.dumps({"results": records, "stats": engine.stats.to_dict()}, indent=2))
        return status
    for i, (record, result) in enumerate(zip(records, results)):
        comp = result.compression
        print(f"[{i}] {len(result.prompt)} prompt + {len(result.tokens)} new tokens, "
              f"{result.finish_reason}; measured CR {comp.overall:.2f} "
              f"(per layer {' '.join(f'{x:.2f}' for x in comp.per_layer)}), "
              f"{result.kv_pages} KV pages")
        if result.error:
            print(f"[{i}] failed: {result.error}", file=sys.stderr)
        print(record.get("text", " ".join(map(str, result.tokens))))
    stats = engine.stats
    if stats.decode_seconds:
        print(f"decode {stats.decode_tokens / stats.decode_seconds:.1f} tok/s, "
              f"prefill {stats.prefill_tokens / max(stats.prefill_seconds, 1e-9):.1f} tok/s,"
              f" preemptions {stats.preemptions}"
              + (f", {stats.continued_steps} of {stats.decode_steps} decode steps overlapped"
                 if engine.pipeline is not None else ""))
    return status


def _print_stream(engine, prompts, params, tokenizer) -> list:
    """Print what each request's new tokens add (``[i] TEXT``: the decoded text past what its
    earlier tokens decoded to, so that pieces joining into one word print once; or the ids)
    as :meth:`Engine.stream` hands them out; returns the results in prompt order."""
    results, tokens = [None] * len(prompts), [[] for _ in prompts]
    for delta in engine.stream(prompts, params):
        earlier, tokens[delta.index] = tokens[delta.index], tokens[delta.index] + delta.tokens
        if delta.tokens:
            new = (" ".join(map(str, delta.tokens)) if tokenizer is None else
                   tokenizer.decode(tokens[delta.index])[len(tokenizer.decode(earlier)):])
            print(f"[{delta.index}] {new}", flush=True)
        if delta.result is not None:
            results[delta.index] = delta.result
    return results


def register(sub) -> None:
    parser = sub.add_parser("generate", help="generate with the paged (DMC-compressed) KV cache")
    add_generate_arguments(parser)
    parser.set_defaults(handler=run_generate)
