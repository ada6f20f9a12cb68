"""In-context retrieval documents mixed into a pretraining corpus (``dmc data prepare
--retrieval-fraction``).

A small model pretrained on plain text for minutes never learns to look things up in its context,
so no cache comparison can show anything on it (every method scores 0% on a needle). These
documents, cut from the corpus's own tokens, make retrieval worth learning:

* ``repeat``: a window of corpus text in which a few foreign passages (spans drawn from elsewhere
  in the corpus, 8 to 40 tokens) appear twice, at a distance drawn uniformly up to the document's
  length.
  Once the start of a passage recurs, its continuation can only come from the first occurrence
  (an induction-style copy across up to ``doc_tokens`` tokens: the skill the needle task of
  :mod:`dmc.data.needle` measures);
* ``kv``: a list of ``key : value`` lines (keys and values are 2-6 token corpus spans) followed
  by the same lines again for a shuffled subset of the keys: look a value up by its key.

Generation is deterministic: the same token documents, sizes and seed give the same output.
"""
from __future__ import annotations

import random
from collections.abc import Sequence

RETRIEVAL_KINDS = ("repeat", "kv")
PASSAGE_TOKENS = (8, 40)
PASSAGES_PER_DOC = (2, 6)
KV_SPAN_TOKENS = (2, 6)
MIN_DOC_TOKENS = 4 * PASSAGE_TOKENS[1]


class _Stream:
    """Random spans of a token stream (documents concatenated), never crossing a document end."""

    def __init__(self, documents: Sequence[Sequence[int]], rng: random.Random):
        self.docs = [list(d) for d in documents if len(d) >= PASSAGE_TOKENS[1]]
        if not self.docs:
            raise ValueError(f"retrieval documents need corpus documents of at least "
                             f"{PASSAGE_TOKENS[1]} tokens")
        self.weights = [len(d) for d in self.docs]
        self.rng = rng

    def span(self, length: int) -> list[int]:
        doc = self.rng.choices(self.docs, weights=self.weights)[0]
        length = min(length, len(doc))
        start = self.rng.randrange(len(doc) - length + 1)
        return doc[start:start + length]


def repeat_document(stream: _Stream, doc_tokens: int, rng: random.Random) -> list[int]:
    """``doc_tokens`` tokens of corpus text with foreign passages each inserted twice."""
    passages = []
    for _ in range(rng.randint(*PASSAGES_PER_DOC)):
        passage = stream.span(rng.randint(*PASSAGE_TOKENS))
        if 2 * (len(passage) + sum(map(len, passages))) > doc_tokens // 2:
            break  # copies take at most half of the document
        passages.append(passage)
    hay = stream.span(max(1, doc_tokens - 2 * sum(len(p) for p in passages)))
    inserts = []  # (position in hay, order, passage): the second copy never precedes the first
    for passage in passages:
        distance = rng.randrange(len(hay) + 1)  # uniform, so long-range copies are as common
        first = rng.randrange(len(hay) + 1 - distance)
        inserts += [(first, 0, passage), (first + distance, 1, passage)]
    out, at = [], 0
    for position, _, passage in sorted(inserts, key=lambda x: (x[0], x[1])):
        out += hay[at:position] + passage
        at = position
    return (out + hay[at:])[:doc_tokens]


def kv_document(stream: _Stream, doc_tokens: int, rng: random.Random,
                separators: tuple[int, int]) -> list[int]:
    """``key : value`` lines, then a shuffled subset of them again, about ``doc_tokens`` long."""
    sep, end = separators
    lines = []
    while sum(len(line) for line in lines) < 0.6 * doc_tokens:
        key, value = (stream.span(rng.randint(*KV_SPAN_TOKENS)) for _ in range(2))
        lines.append(key + [sep] + value + [end])
    queries = rng.sample(lines, len(lines))
    out = [t for line in lines for t in line]
    for line in queries:
        if len(out) + len(line) > doc_tokens:
            break
        out += line
    return out


def make_retrieval_documents(documents: Sequence[Sequence[int]], num_tokens: int, *,
                             doc_tokens: int = 1024, seed: int = 0,
                             separators: tuple[int, int] | None = None,
                             kinds: Sequence[str] = RETRIEVAL_KINDS) -> list[list[int]]:
    """Retrieval documents holding about ``num_tokens`` tokens in all, built from ``documents``
    (token lists of the corpus), alternating over ``kinds``.

    ``separators``: the ids of ``:`` and of a line end for ``kv`` documents (required with it).
    Raises ValueError naming the argument when a size, kind or separator is missing or bad.
    """
    unknown = [k for k in kinds if k not in RETRIEVAL_KINDS]
    if unknown or not kinds:
        raise ValueError(f"kinds: {unknown or 'none'} not accepted; choose from "
                         f"{', '.join(RETRIEVAL_KINDS)}")
    if doc_tokens < MIN_DOC_TOKENS:
        raise ValueError(f"doc_tokens must be >= {MIN_DOC_TOKENS}, got {doc_tokens}")
    if "kv" in kinds and separators is None:
        raise ValueError("separators (the ids of ':' and a line end) are required for kv "
                         "documents")
    rng = random.Random(seed)
    stream = _Stream(documents, rng)
    out, total = [], 0
    while total < num_tokens:
        kind = kinds[len(out) % len(kinds)]
        doc = (repeat_document(stream, doc_tokens, rng) if kind == "repeat"
               else kv_document(stream, doc_tokens, rng, separators))
        out.append(doc)
        total += len(doc)
    return out
