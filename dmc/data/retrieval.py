"""In-context retrieval documents mixed into a pretraining corpus (``dmc data prepare
--retrieval-fraction``).

A small model pretrained on plain text for minutes never learns to look things up in its context,
so no cache comparison can show anything on it (every method scores 0% on a needle). These
documents, cut from the corpus's own tokens, make retrieval worth learning:

* ``repeat``: a window of corpus text in which a few foreign passages (spans drawn from elsewhere
  in the corpus, 16 to 128 tokens) appear 2 or 3 times, the first and last copies at a distance
  drawn uniformly up to the document's length. Once the start of a passage recurs, its
  continuation can only come from an earlier copy (an induction-style copy across up to
  ``doc_tokens`` tokens: the skill the needle task of :mod:`dmc.data.needle` measures);
* ``kv``: a list of ``key : value`` lines (keys and values are 2-6 token corpus spans) followed
  by the same lines again for a shuffled subset of the keys: look a value up by its key;
* ``copy``: tokens drawn independently from the corpus, repeated back to back with a
  log-uniform period: nothing but copying predicts them, and the short periods give the dense
  signal that gets a small model off the plateau before in-context copying (measured: a 4-layer,
  128-wide model on plain text plus the first two kinds showed no copying after 1.6M tokens);
* ``needle``: corpus text holding one needle (a key span then a value span, as in
  :mod:`dmc.data.needle`) per 64 tokens at uniform positions, followed by every key again, each
  with its value, in a shuffled order: the needle task's own format with a dense signal (one
  query per needle) over distances up to the whole document;
* ``decoy``: ``needle`` documents whose haystack also holds, per needle, a *decoy*: the last 1
  to 3 tokens of its key followed by another value. A key of corpus text shares its last tokens
  with some haystack text by chance (the needle probe's misses at 512 tokens are mostly values
  copied from such partial matches, docs/results/base_recipe.md "How the base recipe was found");
  the decoys make matching the whole key, not its tail, what the queries reward;
* ``spaced``: ``needle`` documents with one needle per 128 tokens whose queries are each
  preceded by 16-48 tokens of corpus text. In a ``needle`` document every query after the first
  follows another query and its value, and the base retrieves those far better than the first
  (measured on held-out documents: first value token 0.92-1.00 from the second query on, 0.75
  for the first; with 32 tokens of text before each query, 0.65-0.78 for all of them): the
  needle task asks a single query after plain text, which a ``needle`` document trains once.
  Trained in place of ``needle`` in the base's last stages it did not close that gap
  (docs/results/base_recipe.md, session 44); the base does not use it.

Every document records where its queries start (:attr:`RetrievalDocument.query_start`: the
``kv``, ``needle``, ``decoy`` and ``spaced`` documents' second part; 0 for ``repeat`` and
``copy``, where any token may be a copy): ``dmc data prepare --retrieval-loss queries`` keeps the
language-model loss off the tokens before it.

Generation is deterministic: the same token documents, sizes and seed give the same output.
"""
from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

RETRIEVAL_KINDS = ("repeat", "kv", "copy", "needle", "decoy", "spaced")
DEFAULT_RETRIEVAL_KINDS = RETRIEVAL_KINDS[:4]
PASSAGE_TOKENS = (16, 128)
PASSAGES_PER_DOC = (2, 6)
COPIES = (2, 3)
COPY_SHARE = 0.6
COPY_MIN_PERIOD = 4  # the longest period is half the document
KV_SPAN_TOKENS = (2, 6)
MIN_DOC_TOKENS = 4 * PASSAGE_TOKENS[0]
NEEDLE_EVERY = 64  # haystack tokens per needle
SPACED_NEEDLE_EVERY = 128  # document tokens per needle of a ``spaced`` document
QUERY_GAP_TOKENS = (16, 48)  # corpus text before each query of a ``spaced`` document
NEEDLE_KEY_TOKENS = (6, 10)
NEEDLE_VALUE_TOKENS = (2, 6)
DECOY_TAIL_TOKENS = (1, 3)  # key tokens a decoy repeats (its last ones)


@dataclass(frozen=True)
class RetrievalDocument:
    """``tokens`` of one document; ``tokens[query_start:]`` are its queries (0: all of it).

    ``sources``: one entry per token of ``tokens[query_start:]`` (empty when not recorded): how
    far back the span that answers it starts, the needle or ``key : value`` line a query looks up
    (``tokens[i - sources[i - query_start]]`` is that span's first token), 0 for a token that
    looks nothing up. A query is answerable in a training window only when that start is inside
    the window (``dmc data prepare --retrieval-loss answerable``)."""

    tokens: list[int]
    query_start: int = 0
    sources: tuple[int, ...] = ()


class _Stream:
    """Random spans of a token stream (documents concatenated), never crossing a document end."""

    def __init__(self, documents: Sequence[Sequence[int]], rng: random.Random):
        self.docs = [list(d) for d in documents if len(d) >= PASSAGE_TOKENS[1]]
        if not self.docs:
            raise ValueError(f"retrieval documents need corpus documents of at least "
                             f"{PASSAGE_TOKENS[1]} tokens")
        self.cum_weights = list(itertools.accumulate(len(d) for d in self.docs))
        self.rng = rng

    def span(self, length: int) -> list[int]:
        doc = self.rng.choices(self.docs, cum_weights=self.cum_weights)[0]
        length = min(length, len(doc))
        start = self.rng.randrange(len(doc) - length + 1)
        return doc[start:start + length]


def repeat_document(stream: _Stream, doc_tokens: int, rng: random.Random) -> RetrievalDocument:
    """``doc_tokens`` tokens of corpus text with foreign passages each inserted 2 or 3 times."""
    passages = []  # (passage, copies)
    room = int(COPY_SHARE * doc_tokens)  # tokens the copies may take
    for _ in range(rng.randint(*PASSAGES_PER_DOC)):
        copies = rng.randint(*COPIES)
        longest = room // copies
        if longest < PASSAGE_TOKENS[0]:
            break
        passage = stream.span(min(rng.randint(*PASSAGE_TOKENS), longest))
        passages.append((passage, copies))
        room -= copies * len(passage)
    hay = stream.span(max(1, doc_tokens - sum(c * len(p) for p, c in passages)))
    inserts = []  # (position in hay, order, passage): copies keep their order
    for passage, copies in passages:
        span = rng.randrange(len(hay) + 1)  # uniform, so long-range copies are as common
        first = rng.randrange(len(hay) + 1 - span)
        positions = sorted([first, first + span] + [rng.randint(first, first + span)
                                                     for _ in range(copies - 2)])
        inserts += [(at, order, passage) for order, at in enumerate(positions)]
    out, at = [], 0
    for position, _, passage in sorted(inserts, key=lambda x: (x[0], x[1])):
        out += hay[at:position] + passage
        at = position
    return RetrievalDocument((out + hay[at:])[:doc_tokens])


def kv_document(stream: _Stream, doc_tokens: int, rng: random.Random,
                separators: tuple[int, int]) -> RetrievalDocument:
    """``key : value`` lines, then a shuffled subset of them again, about ``doc_tokens`` long.
    Keys are distinct and neither keys nor values hold a separator (a span that would is
    redrawn, 100 tries, else the line is left out), so every query line has one answer. Raises
    ValueError when not one line can be drawn."""
    sep, end = separators
    lines, keys, tries = [], set(), 0
    while sum(len(line) for line in lines) < 0.6 * doc_tokens and tries < 100 * doc_tokens:
        tries += 1
        key, value = (stream.span(rng.randint(*KV_SPAN_TOKENS)) for _ in range(2))
        if tuple(key) in keys or {sep, end} & {*key, *value}:
            continue
        keys.add(tuple(key))
        lines.append(key + [sep] + value + [end])
    if not lines:
        raise ValueError(f"kv documents: no key : value line without a separator could be drawn "
                         f"in {tries} tries (nearly every {KV_SPAN_TOKENS[0]}-"
                         f"{KV_SPAN_TOKENS[1]} token span of the corpus holds ':' or a line end); "
                         f"leave kv out of the retrieval kinds")
    order = rng.sample(range(len(lines)), len(lines))
    starts = list(itertools.accumulate((len(line) for line in lines), initial=0))
    out = [t for line in lines for t in line]
    query_start, sources = len(out), []
    for i in order:
        if len(out) + len(lines[i]) > doc_tokens:
            break
        sources += [len(out) + t - starts[i] for t in range(len(lines[i]))]
        out += lines[i]
    return RetrievalDocument(out, query_start, tuple(sources))


def copy_document(stream: _Stream, doc_tokens: int, rng: random.Random) -> RetrievalDocument:
    """A sequence of tokens drawn independently from the corpus (no n-gram can predict them),
    repeated back to back to fill ``doc_tokens``: only copying predicts the repeats. The period is
    log-uniform in ``[COPY_MIN_PERIOD, doc_tokens / 2]``: short periods, whose many repeats give a
    dense signal, are what gets a small model out of the plateau before in-context copying."""
    low, high = math.log(COPY_MIN_PERIOD), math.log(doc_tokens // 2)
    length = int(math.exp(rng.uniform(low, high)))
    sequence = [stream.span(1)[0] for _ in range(length)]
    return RetrievalDocument((sequence * (doc_tokens // length + 1))[:doc_tokens])


def needle_document(stream: _Stream, doc_tokens: int, rng: random.Random, *,
                    decoys: bool = False, spaced: bool = False) -> RetrievalDocument:
    """About ``doc_tokens`` tokens: a corpus haystack with ``doc_tokens // NEEDLE_EVERY`` needles
    (key + value corpus spans) at uniform positions, then each key again followed by its value
    (shuffled). A key that occurs in the haystack or as another needle's key is redrawn, so every
    query has one answer (as :func:`dmc.data.needle.make_needle_examples` ensures).

    ``decoys``: each needle also gets a decoy at its own uniform position: the key's last
    ``DECOY_TAIL_TOKENS`` tokens then another value span, placed where the haystack before it
    does not complete the key (so the query keeps one answer).

    ``spaced``: ``doc_tokens // SPACED_NEEDLE_EVERY`` needles, and each query (the first
    included) comes after ``QUERY_GAP_TOKENS`` tokens of corpus text holding no needle's key, so
    that no query follows another one."""
    count = max(1, doc_tokens // (SPACED_NEEDLE_EVERY if spaced else NEEDLE_EVERY))
    lengths = [(rng.randint(*NEEDLE_KEY_TOKENS), rng.randint(*NEEDLE_VALUE_TOKENS))
               for _ in range(count)]
    gaps = [rng.randint(*QUERY_GAP_TOKENS) for _ in range(count)] if spaced else [0] * count
    inserted = sum(2 * (k + v) + (DECOY_TAIL_TOKENS[1] + v if decoys else 0) for k, v in lengths)
    hay = stream.span(max(1, doc_tokens - inserted - sum(gaps)))
    grams: dict[int, set] = {}
    needles, inserts = [], []  # inserts: (position in hay, tokens)
    for key_len, value_len in lengths:
        seen = grams.setdefault(key_len, {tuple(hay[i:i + key_len])
                                          for i in range(len(hay) - key_len + 1)})
        for _ in range(100):
            key = stream.span(key_len)
            if tuple(key) not in seen:
                break
        else:
            continue  # the corpus is too repetitive for a unique key: one needle fewer
        seen.add(tuple(key))
        position, value = rng.randint(0, len(hay)), stream.span(value_len)
        needles.append((key, value))
        inserts.append((position, key + value, len(needles) - 1))
        if decoys:
            inserts += [(at, tokens, None)
                        for at, tokens in _decoy(stream, hay, key, value_len, rng)]
    out, at, starts = [], 0, {}  # starts: needle -> where it begins in out
    for position, tokens, needle in sorted(inserts, key=lambda n: n[0]):
        out += hay[at:position]
        starts[needle] = len(out)
        out += tokens
        at = position
    out += hay[at:]
    query_start, sources = len(out), []
    keys = [key for key, _ in needles]
    for i, gap in zip(rng.sample(range(len(needles)), len(needles)), gaps):
        text = _text_without(stream, gap, keys)
        sources += [0] * len(text)
        out += text
        sources += [len(out) + t - starts[i] for t in range(sum(map(len, needles[i])))]
        out += needles[i][0] + needles[i][1]
    return RetrievalDocument(out, query_start, tuple(sources))


def _text_without(stream: _Stream, length: int, keys: list[list[int]]) -> list[int]:
    """``length`` tokens of corpus text in which no key of ``keys`` occurs (the last draw of 100
    shortened to before a key's first token, so a query keeps one answer)."""
    if length == 0:
        return []
    for _ in range(100):
        text = stream.span(length)
        cut = min([i for key in keys for i in range(len(text) - len(key) + 1)
                   if text[i:i + len(key)] == key], default=None)
        if cut is None:
            return text
    return text[:cut]


def _decoy(stream: _Stream, hay: list[int], key: list[int], value_len: int,
           rng: random.Random) -> list[tuple[int, list[int]]]:
    """One decoy of ``key`` for :func:`needle_document`: ``[(position in hay, tail + value)]``,
    or ``[]`` when no position tried keeps the key's tail from completing the whole key."""
    tail = rng.randint(DECOY_TAIL_TOKENS[0], min(DECOY_TAIL_TOKENS[1], len(key) - 1))
    head = key[:-tail]
    for _ in range(100):
        position = rng.randint(0, len(hay))
        if hay[max(0, position - len(head)):position] != head:
            return [(position, key[-tail:] + stream.span(value_len))]
    return []


def make_retrieval_documents(documents: Sequence[Sequence[int]], num_tokens: int, *,
                             doc_tokens: int = 1024, seed: int = 0,
                             separators: tuple[int, int] | None = None,
                             kinds: Sequence[str] = DEFAULT_RETRIEVAL_KINDS
                             ) -> list[RetrievalDocument]:
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
        if kind == "kv":
            doc = kv_document(stream, doc_tokens, rng, separators)
        elif kind == "decoy":
            doc = needle_document(stream, doc_tokens, rng, decoys=True)
        elif kind == "spaced":
            doc = needle_document(stream, doc_tokens, rng, spaced=True)
        else:
            doc = {"repeat": repeat_document, "copy": copy_document,
                   "needle": needle_document}[kind](stream, doc_tokens, rng)
        out.append(doc)
        total += len(doc.tokens)
    return out
