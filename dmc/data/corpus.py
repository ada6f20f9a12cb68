"""Read a text corpus into documents.

Accepted inputs: ``.txt`` files (one document per file, or one per non-blank line with
``split_lines``), ``.jsonl`` files (one document per line, text under ``text_key``) and folders,
searched recursively for those two kinds (hidden files and folders skipped). Files are read as UTF-8
and visited in sorted order so that the same inputs always give the same document list.
Documents that are empty or whitespace only are dropped.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_SUFFIXES = (".txt", ".jsonl")
ACCEPTED_INPUTS = (
    ".txt files (one document per file, or per line with --split-lines), "
    ".jsonl files (one JSON object per line with a string field, 'text' by default), "
    "or folders of those"
)


@dataclass(frozen=True)
class Document:
    """One document: its text and where it came from (``path`` or ``path:line``)."""

    text: str
    source: str


def find_files(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """Expand files and folders into the sorted, de-duplicated list of corpus files.

    Raises FileNotFoundError for a missing path, ValueError for a file with an unsupported
    suffix or a folder without any supported file.
    """
    files: dict[Path, None] = {}
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise FileNotFoundError(
                f"input {str(path)!r} does not exist; accepted: {ACCEPTED_INPUTS}"
            )
        found = _files_in_folder(path) if path.is_dir() else [_check_suffix(path)]
        files.update(dict.fromkeys(p.resolve() for p in found))
    return list(files)


def _check_suffix(path: Path) -> Path:
    """Return ``path`` if its suffix is supported, else raise ValueError."""
    if path.suffix.lower() not in SUPPORTED_SUFFIXES:
        raise ValueError(
            f"input {str(path)!r} has unsupported suffix {path.suffix!r}; "
            f"accepted: {ACCEPTED_INPUTS}"
        )
    return path


def _files_in_folder(folder: Path) -> list[Path]:
    """All supported, non-hidden files under ``folder``, sorted by relative path."""
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix.lower() in SUPPORTED_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    if not files:
        raise ValueError(
            f"folder {str(folder)!r} holds no corpus file; accepted: {ACCEPTED_INPUTS}"
        )
    return files


def read_documents(
    inputs: Sequence[str | os.PathLike], *, text_key: str = "text", split_lines: bool = False
) -> list[Document]:
    """Read every document of ``inputs`` (files or folders), in a deterministic order.

    Raises ValueError when no non-empty document is found.
    """
    docs = []
    for path in find_files(inputs):
        reader = (
            _read_jsonl(path, text_key)
            if path.suffix.lower() == ".jsonl"
            else _read_txt(path, split_lines)
        )
        docs.extend(doc for doc in reader if doc.text.strip())
    if not docs:
        raise ValueError(
            f"empty corpus: no non-empty document in inputs {[str(p) for p in inputs]}; "
            f"accepted: {ACCEPTED_INPUTS}"
        )
    return docs


def _read_text(path: Path) -> str:
    """Read a UTF-8 file (newlines normalised to ``\\n``), naming the file on a decoding error."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"input {str(path)!r} is not valid UTF-8 ({err.reason} at byte {err.start})"
        ) from err


def _read_txt(path: Path, split_lines: bool) -> Iterator[Document]:
    """One document for the whole file, or one per line when ``split_lines``."""
    text = _read_text(path)
    if not split_lines:
        yield Document(text, str(path))
        return
    for number, line in enumerate(text.split("\n"), start=1):
        yield Document(line, f"{path}:{number}")


def _read_jsonl(path: Path, text_key: str) -> Iterator[Document]:
    """One document per non-blank line; the text is the string field ``text_key``."""
    for number, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{where}: invalid JSON ({err.msg}); expected one JSON object per line"
            ) from err
        if not isinstance(record, dict) or text_key not in record:
            raise ValueError(
                f"{where}: missing field {text_key!r}; each line must be a JSON object with it"
            )
        if not isinstance(record[text_key], str):
            raise ValueError(
                f"{where}: field {text_key!r} must be a string, "
                f"got {type(record[text_key]).__name__}"
            )
        yield Document(record[text_key], where)


def split_single_document(doc: Document, valid_fraction: float) -> tuple[Document, Document]:
    """Cut one document at a line boundary into (train, valid); valid gets the last lines.

    Used when the corpus is a single document, so that both splits are non-empty.
    Raises ValueError when the document has fewer than two non-blank lines.
    """
    lines = doc.text.split("\n")
    non_blank = [i for i, line in enumerate(lines) if line.strip()]
    if len(non_blank) < 2:
        raise ValueError(
            f"the corpus is one document with fewer than two non-blank lines ({doc.source}); "
            "a train/valid split needs at least two documents or lines"
        )
    wanted = round(len(non_blank) * valid_fraction)
    cut = non_blank[-min(len(non_blank) - 1, max(1, wanted))]
    return (
        Document("\n".join(lines[:cut]), f"{doc.source} (lines 1-{cut})"),
        Document("\n".join(lines[cut:]), f"{doc.source} (lines {cut + 1}-{len(lines)})"),
    )


def split_documents(
    docs: Sequence[Document], valid_fraction: float, seed: int
) -> tuple[list[Document], list[Document]]:
    """Deterministic train/valid split, sized by characters (the tokenizer is trained on the
    train split, so tokens cannot size it; characters are their proxy).

    Documents are visited in a ``random.Random(seed)`` order and go to valid whole until valid
    holds at least ``valid_fraction`` of the corpus characters: at least one document, never all
    of them. A document that would take valid past twice its share is cut at a line boundary
    instead (:func:`split_single_document`: its last lines to valid, the rest stays in train),
    so a corpus of a few large files is not mostly valid. Both lists keep corpus order.
    """
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(
            f"valid_fraction must be a number in the open interval (0, 1), got {valid_fraction!r}"
        )
    if len(docs) == 1:
        train, valid = split_single_document(docs[0], valid_fraction)
        return [train], [valid]
    order = random.Random(seed).sample(range(len(docs)), len(docs))
    target = valid_fraction * sum(len(doc.text) for doc in docs)
    parts: dict[int, tuple[Document | None, Document]] = {}  # index -> (train part, valid part)
    size = 0
    for i in order[: len(docs) - 1]:
        if parts and size >= target:
            break
        doc = docs[i]
        if size + len(doc.text) > 2 * target and _cuttable(doc):
            parts[i] = split_single_document(doc, (target - size) / len(doc.text))
            break
        parts[i] = (None, doc)
        size += len(doc.text)
    train = [parts[i][0] if i in parts else doc for i, doc in enumerate(docs)]
    return [d for d in train if d is not None], [parts[i][1] for i in sorted(parts)]


def _cuttable(doc: Document) -> bool:
    return sum(1 for line in doc.text.split("\n") if line.strip()) >= 2
