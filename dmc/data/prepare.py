"""``dmc data prepare``: corpus -> tokenizer -> megatron indexed datasets.

Output folder layout::

    OUT/tokenizer.model                          SentencePiece (trained or copied), or
    OUT/tokenizer.json [+ tokenizer_config.json] a copied Hugging Face tokenizer
    OUT/train_text_document.{bin,idx}            megatron indexed datasets, EOD after each document
    OUT/valid_text_document.{bin,idx}
    OUT/train_loss_mask_document.{bin,idx}       with --retrieval-loss queries | answerable
    OUT/meta.json                                what was done: tokenizer, ids, counts, source

Read it back with :func:`load_meta`, ``dmc.data.load_tokenizer(OUT)`` and
``dmc.data.build_gpt_dataset(split_prefix(OUT, "train"), ...)``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from dmc.data.corpus import Document, find_files, read_documents, split_documents
from dmc.data.indexed import CACHE_DIRNAME, loss_mask_prefix, write_indexed_dataset
from dmc.data.retrieval import (DEFAULT_RETRIEVAL_KINDS, MIN_DOC_TOKENS, RETRIEVAL_KINDS,
                                RetrievalDocument, make_retrieval_documents)
from dmc.data.shakespeare import PACKAGE, shakespeare_files
from dmc.data.tokenizer import (
    HF_CONFIG_FILE,
    HF_FILE,
    SENTENCEPIECE_FILE,
    Tokenizer,
    load_tokenizer,
    resolve_tokenizer_path,
    train_sentencepiece,
)

META_FILE = "meta.json"
STAGING_DIRNAME = ".prepare-staging"
META_FORMAT = 1
SPLITS = ("train", "valid")
RETRIEVAL_LOSSES = ("all", "queries", "answerable")


def split_prefix(out_dir: str | os.PathLike, split: str) -> Path:
    """Path prefix (no ``.bin``/``.idx``) of one split of a prepared folder."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    return Path(out_dir) / f"{split}_text_document"


def load_meta(out_dir: str | os.PathLike) -> dict:
    """The ``meta.json`` of a prepared folder."""
    path = Path(out_dir) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} not found; create it with `dmc data prepare --output {out_dir}`"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def prepare_data(
    inputs: Sequence[str | os.PathLike] | None,
    out_dir: str | os.PathLike,
    tokenizer: str | os.PathLike | None = None,
    vocab_size: int = 4096,
    valid_fraction: float = 0.02,
    seed: int = 1234,
    *,
    text_key: str = "text",
    split_lines: bool = False,
    quiet: bool = False,
    retrieval_fraction: float = 0.0,
    retrieval_doc_tokens: int = 1024,
    retrieval_kinds: Sequence[str] = DEFAULT_RETRIEVAL_KINDS,
    retrieval_loss: str = "all",
) -> dict:
    """Tokenise a corpus into train/valid megatron indexed datasets in ``out_dir``; return the meta.

    ``inputs``: files/folders (see :mod:`dmc.data.corpus`), or None for the Shakespeare corpus.
    ``tokenizer``: a ``.model``, a ``tokenizer.json`` or a folder with one; None trains a
    SentencePiece BPE model of ``vocab_size`` on the train split. ``seed`` fixes the split and the
    tokenizer's training sample. Everything is written into ``out_dir/.prepare-staging`` first and
    moved in once complete, so a run that fails (a bad argument found late, a vocabulary size the
    corpus cannot train) leaves a prepared ``out_dir`` as it was; a run that succeeds replaces
    its files, removes those this run does not write (a loss mask, the other kind of
    tokenizer) and megatron's index cache there (``cache/``).

    ``retrieval_fraction`` > 0 adds in-context retrieval documents of ``retrieval_doc_tokens``
    tokens (:mod:`dmc.data.retrieval`, drawn with ``seed`` from the train split's own tokens) to
    the train split, until they are that share of its tokens, cycling over ``retrieval_kinds``
    (a kind listed twice gets twice the documents); the valid split stays plain text.
    ``retrieval_loss="queries"`` also writes the train split's loss mask (``OUT/
    train_loss_mask_document``, read by :func:`dmc.data.build_gpt_dataset`): 0 on the tokens of
    a ``kv``, ``needle``, ``decoy`` or ``spaced`` document before its queries (the lines, the
    haystack and its needles), 1 everywhere else, so their language-model loss falls on the
    lookups only (and on a ``spaced`` document's text between them). ``"answerable"`` writes
    the same mask, and in it, for each lookup, ``1 +`` how far back the needle or line it looks
    up starts: a training window keeps the loss of a lookup only when that start lies inside
    the window (:class:`dmc.data.indexed.LossMaskedDataset`). With documents as long as the
    window, about half of the lookups a window holds have lost their needle to the window's
    start and can only be guessed.
    """
    if not 0.0 <= retrieval_fraction < 1.0:
        raise ValueError(f"retrieval_fraction must be in [0, 1), got {retrieval_fraction!r}")
    unknown = sorted(set(retrieval_kinds) - set(RETRIEVAL_KINDS))
    if unknown or not retrieval_kinds:
        raise ValueError(f"retrieval_kinds: {', '.join(unknown) or 'none given'} not accepted; "
                         f"choose from {', '.join(RETRIEVAL_KINDS)}")
    if retrieval_loss not in RETRIEVAL_LOSSES:
        raise ValueError(f"retrieval_loss: {retrieval_loss!r} not accepted; choose from "
                         f"{', '.join(RETRIEVAL_LOSSES)}")
    if retrieval_loss != "all" and not retrieval_fraction:
        raise ValueError(f"retrieval_loss={retrieval_loss!r} needs retrieval documents "
                         f"(retrieval_fraction > 0)")
    if retrieval_fraction and retrieval_doc_tokens < MIN_DOC_TOKENS:
        raise ValueError(f"retrieval_doc_tokens must be >= {MIN_DOC_TOKENS}, got "
                         f"{retrieval_doc_tokens!r}")
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(
            f"valid_fraction must be a number in the open interval (0, 1), got {valid_fraction!r}"
        )
    source_path = resolve_tokenizer_path(tokenizer) if tokenizer is not None else None
    if source_path is not None:
        load_tokenizer(source_path)  # fail before writing anything
    docs, source = _load_corpus(inputs, text_key, split_lines, quiet)
    train_docs, valid_docs = split_documents(docs, valid_fraction, seed)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stage = out / STAGING_DIRNAME  # written whole, then moved in: a failure leaves `out` as it was
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        tok = _install_tokenizer(source_path, stage, train_docs, vocab_size, seed)
        retrieval = None
        if retrieval_fraction:
            retrieval = {"fraction": retrieval_fraction, "doc_tokens": retrieval_doc_tokens,
                         "seed": seed, "kinds": list(retrieval_kinds), "loss": retrieval_loss}
        splits = {
            name: _write_split(stage, name, split_docs, tok, quiet,
                               retrieval if name == "train" else None)
            for name, split_docs in zip(SPLITS, (train_docs, valid_docs), strict=True)
        }
        meta = {
            "format": META_FORMAT,
            "tokenizer": {
                "kind": tok.kind,
                "path": tok.path.name,
                "trained": source_path is None,
                "source": str(source_path) if source_path else None,
            },
            "vocab_size": tok.vocab_size,
            "eod": tok.eod,
            "bos": tok.bos,
            "pad": tok.pad,
            "splits": splits,
            "source": source,
            "retrieval": retrieval,
            "valid_fraction": valid_fraction,
            "seed": seed,
        }
        (stage / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        _move_into(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return meta


def _move_into(stage: Path, out: Path) -> None:
    """Replace the prepared files of ``out`` by those in ``stage``: ``meta.json`` is removed
    first and moved in last, so a folder caught in between reads as not prepared; a file that
    ``stage`` lacks (the other kind of tokenizer, a loss mask) is removed, and so is megatron's
    index cache of the previous data (``cache/``)."""
    (out / META_FILE).unlink(missing_ok=True)
    shutil.rmtree(out / CACHE_DIRNAME, ignore_errors=True)
    names = [SENTENCEPIECE_FILE, HF_FILE, HF_CONFIG_FILE]
    for split in SPLITS:
        prefix = split_prefix(Path(), split)
        names += [f"{p}{suffix}" for p in (prefix, loss_mask_prefix(prefix))
                  for suffix in (".bin", ".idx")]
    for name in names:
        if (stage / name).exists():
            os.replace(stage / name, out / name)
        else:
            (out / name).unlink(missing_ok=True)
    os.replace(stage / META_FILE, out / META_FILE)


def _load_corpus(
    inputs: Sequence[str | os.PathLike] | None, text_key: str, split_lines: bool, quiet: bool
) -> tuple[list[Document], dict]:
    """The documents of ``inputs`` (Shakespeare when None) and a description of the source."""
    if inputs is None:
        files = shakespeare_files(quiet)
        kind, names = "shakespeare", [PACKAGE]
    else:
        if not inputs:
            raise ValueError(
                "inputs is empty; give at least one file or folder, or None for Shakespeare"
            )
        files = find_files(inputs)
        kind, names = "files", [str(p) for p in inputs]
    docs = read_documents(files, text_key=text_key, split_lines=split_lines)
    source = {
        "kind": kind,
        "inputs": names,
        "files": len(files),
        "documents": len(docs),
        "characters": sum(len(doc.text) for doc in docs),
    }
    return docs, source


def _install_tokenizer(
    source: Path | None, out: Path, train_docs: list[Document], vocab_size: int, seed: int
) -> Tokenizer:
    """Put the tokenizer into the empty folder ``out`` (copied from ``source``, or trained when
    None) and load it."""
    payload = {}
    if source is not None and source.suffix == ".model":
        payload[SENTENCEPIECE_FILE] = source.read_bytes()
    elif source is not None:
        payload[HF_FILE] = source.read_bytes()
        config = source.with_name(HF_CONFIG_FILE)
        if config.is_file():
            payload[HF_CONFIG_FILE] = config.read_bytes()
    if source is None:
        return train_sentencepiece(
            (doc.text for doc in train_docs), out / SENTENCEPIECE_FILE, vocab_size, seed=seed
        )
    for name, data in payload.items():
        (out / name).write_bytes(data)
    return load_tokenizer(out)


def _write_split(out: Path, name: str, docs: list[Document], tok: Tokenizer, quiet: bool,
                 retrieval: dict | None = None) -> dict:
    """Tokenise ``docs`` into the indexed dataset of split ``name``; return its counts. With
    ``retrieval`` (see :func:`prepare_data`), retrieval documents follow the corpus's and their
    counts are added to it (and to ``retrieval``); its ``loss`` other than "all" writes the loss
    mask."""
    prefix = split_prefix(out, name)
    encoded_docs: list[list[int]] = []
    masked = retrieval is not None and retrieval["loss"] != "all"
    masks: list[int | list[int]] = []  # per document: its loss mask, or its length (all ones)

    def encoded():  # the bar starts with the first document, once the writer is ready
        with tqdm(
            total=sum(len(doc.text) for doc in docs),
            desc=f"{name}: tokenize + write",
            unit="char",
            unit_scale=True,
            disable=quiet or not sys.stderr.isatty(),
        ) as bar:
            for doc in docs:
                ids = tok.encode(doc.text)
                if retrieval is not None:
                    encoded_docs.append(ids)
                    masks.append(len(ids))
                yield ids
                bar.update(len(doc.text))
        if retrieval is not None:
            for document in _retrieval_documents(encoded_docs, tok, retrieval):
                if masked:
                    masks.append(_loss_mask(document, retrieval["loss"]))
                yield document.tokens

    counts = write_indexed_dataset(prefix, encoded(), tok.vocab_size, tok.eod)
    if masked:
        write_indexed_dataset(loss_mask_prefix(prefix),
                              ([1] * m if isinstance(m, int) else m for m in masks),
                              max(tok.vocab_size, retrieval["doc_tokens"] + 2), 1)
    return {"prefix": prefix.name, **counts}


def _loss_mask(document: RetrievalDocument, loss: str) -> list[int]:
    """The loss mask of one retrieval document (see :func:`prepare_data`)."""
    queries = len(document.tokens) - document.query_start
    if loss == "answerable" and document.sources:
        return [0] * document.query_start + [1 + source for source in document.sources]
    return [0] * document.query_start + [1] * queries


def _retrieval_documents(corpus: list[list[int]], tok: Tokenizer, retrieval: dict):
    """The retrieval documents for a train split whose corpus documents are ``corpus``; records
    their number and tokens in ``retrieval``."""
    corpus_tokens = sum(len(d) + 1 for d in corpus)
    fraction = retrieval["fraction"]
    separators = (tok.encode(":")[-1], tok.encode("\n")[-1])  # as spelled at the end of a text
    documents = make_retrieval_documents(
        corpus, round(corpus_tokens * fraction / (1 - fraction)),
        doc_tokens=retrieval["doc_tokens"], seed=retrieval["seed"], separators=separators,
        kinds=retrieval["kinds"])
    retrieval.update(documents=len(documents), tokens=sum(len(d.tokens) + 1 for d in documents))
    yield from documents
