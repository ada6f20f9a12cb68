"""Retrieval documents: deterministic, made of corpus spans, passages really recur, kv lines are
queried again, and `dmc data prepare --retrieval-fraction` mixes them into the train split only."""
import random

import pytest

from dmc.data.retrieval import (
    COPY_SHARE,
    NEEDLE_EVERY,
    NEEDLE_KEY_TOKENS,
    NEEDLE_VALUE_TOKENS,
    PASSAGE_TOKENS,
    _Stream,
    copy_document,
    kv_document,
    make_retrieval_documents,
    needle_document,
    repeat_document,
)

SEP, END = 1000, 1001


def corpus(n_docs=6, length=3000, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(500) for _ in range(length)] for _ in range(n_docs)]


def occurrences(doc, span):
    n = len(span)
    return [i for i in range(len(doc) - n + 1) if doc[i:i + n] == span]


def test_repeat_documents_hold_each_passage_two_or_three_times():
    docs = corpus()
    rng = random.Random(3)
    stream = _Stream(docs, rng)
    for _ in range(20):
        state = rng.getstate()
        doc = repeat_document(stream, 512, rng)
        assert len(doc) == 512
        rng.setstate(state)  # replay the draws to learn the passages and their copies
        passages, room = [], int(COPY_SHARE * 512)
        for _ in range(rng.randint(2, 6)):
            copies = rng.randint(2, 3)
            if room // copies < PASSAGE_TOKENS[0]:
                break
            passage = stream.span(min(rng.randint(*PASSAGE_TOKENS), room // copies))
            passages.append((passage, copies))
            room -= copies * len(passage)
        assert passages
        for passage, copies in passages:
            assert len(occurrences(doc, passage)) >= copies
        rng.setstate(state)
        assert repeat_document(stream, 512, rng) == doc


def test_copy_documents_repeat_one_random_sequence():
    rng = random.Random(2)
    stream = _Stream(corpus(), rng)
    periods = []
    for _ in range(200):
        doc = copy_document(stream, 512, rng)
        period = next(p for p in range(1, 513) if doc[p:] == doc[:-p])
        assert 4 <= period <= 256 and len(doc) == 512
        periods.append(period)
    assert sum(p <= 32 for p in periods) > 60  # log-uniform: short periods are common


def test_kv_documents_query_their_own_lines():
    rng = random.Random(1)
    doc = kv_document(_Stream(corpus(), rng), 400, rng, (SEP, END))
    assert len(doc) <= 400
    lines, line = [], []
    for t in doc:
        line.append(t)
        if t == END:
            lines.append(tuple(line))
            line = []
    listed = []
    for entry in lines:
        if entry in listed:
            break
        listed.append(entry)
    queried = lines[len(listed):]
    assert queried and set(queried) <= set(listed)
    assert all(entry.count(SEP) == 1 for entry in listed)


def runs(tokens):
    """Maximal runs of consecutive integers."""
    out = [[tokens[0]]]
    for t in tokens[1:]:
        (out[-1].append(t) if t == out[-1][-1] + 1 else out.append([t]))
    return out


def test_needle_documents_query_every_needle_once_with_one_answer():
    # corpus documents of consecutive ids: every span is a run, so needles show as breaks
    docs = [list(range(i * 10_000, i * 10_000 + 3000)) for i in range(6)]
    rng = random.Random(5)
    stream = _Stream(docs, rng)
    for _ in range(4):
        state = rng.getstate()
        doc = needle_document(stream, 1024, rng)
        rng.setstate(state)  # replay the first draws: the needles' sizes
        lengths = [(rng.randint(*NEEDLE_KEY_TOKENS), rng.randint(*NEEDLE_VALUE_TOKENS))
                   for _ in range(1024 // NEEDLE_EVERY)]
        tail = sum(k + v for k, v in lengths)
        assert len(doc) == 1024  # haystack, needles in it, then the queries
        body, queries = doc[:-tail], doc[-tail:]
        pieces = runs(queries)  # key, value, key, value, ...
        assert len(pieces) == 2 * len(lengths)
        pairs = [(pieces[i], pieces[i + 1]) for i in range(0, len(pieces), 2)]
        assert sorted((len(k), len(v)) for k, v in pairs) == sorted(lengths)
        for key, value in pairs:  # the needle is in the body once, its key nowhere else
            assert len(occurrences(body, key + value)) == 1
            assert len(occurrences(doc, key)) == 2
        assert len({tuple(k) for k, _ in pairs}) == len(pairs)
        positions = [occurrences(body, k)[0] for k, _ in pairs]
        assert max(positions) - min(positions) > 1024 // 4  # spread over the haystack


def test_make_documents_is_deterministic_and_sized():
    docs = corpus()
    a = make_retrieval_documents(docs, 20_000, doc_tokens=512, seed=4, separators=(SEP, END))
    b = make_retrieval_documents(docs, 20_000, doc_tokens=512, seed=4, separators=(SEP, END))
    c = make_retrieval_documents(docs, 20_000, doc_tokens=512, seed=5, separators=(SEP, END))
    assert a == b and a != c
    assert 20_000 <= sum(map(len, a)) < 20_000 + 512
    vocab = {t for d in docs for t in d} | {SEP, END}
    assert {t for d in a for t in d} <= vocab
    with pytest.raises(ValueError, match="separators"):
        make_retrieval_documents(docs, 100, kinds=("kv",))
    with pytest.raises(ValueError, match="kinds: .*choose from repeat, kv, copy, needle"):
        make_retrieval_documents(docs, 100, kinds=("nope",))
    with pytest.raises(ValueError, match="doc_tokens must be >= 64"):
        make_retrieval_documents(docs, 100, doc_tokens=40, kinds=("repeat",))


def test_prepare_mixes_retrieval_documents_into_train_only(tmp_path):
    from dmc.data.indexed import read_indexed_dataset
    from dmc.data.prepare import load_meta, prepare_data, split_prefix

    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    words = random.Random(0)
    for i in range(6):
        text = "\n".join(" ".join(words.choice(["to", "be", "or", "not", "the", "king", "queen",
                                                  "lord", "sweet", "night", "day", "love"])
                                     for _ in range(12)) for _ in range(250))
        (corpus_dir / f"doc{i}.txt").write_text(text)
    plain = prepare_data([corpus_dir], tmp_path / "plain", vocab_size=300, valid_fraction=0.2,
                         quiet=True)
    mixed = prepare_data([corpus_dir], tmp_path / "mixed", vocab_size=300, valid_fraction=0.2,
                         quiet=True, retrieval_fraction=0.5, retrieval_doc_tokens=512)
    assert plain["retrieval"] is None
    info = mixed["retrieval"]
    assert info["fraction"] == 0.5 and info["doc_tokens"] == 512 and info["documents"] > 0
    plain_train = plain["splits"]["train"]["tokens"]
    assert mixed["splits"]["train"]["tokens"] == plain_train + info["tokens"]
    assert info["tokens"] == pytest.approx(plain_train, rel=0.05)
    assert mixed["splits"]["valid"] == plain["splits"]["valid"]
    valid = read_indexed_dataset(split_prefix(tmp_path / "mixed", "valid"))
    assert valid == read_indexed_dataset(split_prefix(tmp_path / "plain", "valid"))
    with pytest.raises(ValueError, match="retrieval_fraction must be in"):
        prepare_data([corpus_dir], tmp_path / "bad", retrieval_fraction=1.0, quiet=True)
    with pytest.raises(ValueError, match="retrieval_kinds: nope not accepted; choose from"):
        prepare_data([corpus_dir], tmp_path / "bad", retrieval_fraction=0.5,
                     retrieval_kinds=["copy", "nope"], quiet=True)
    assert not (tmp_path / "bad").exists()
    copy_only = prepare_data([corpus_dir], tmp_path / "copy", vocab_size=300, valid_fraction=0.2,
                             quiet=True, retrieval_fraction=0.5, retrieval_doc_tokens=64,
                             retrieval_kinds=["copy"])
    assert copy_only["retrieval"]["kinds"] == ["copy"]
    assert copy_only["retrieval"]["tokens"] == pytest.approx(plain_train, rel=0.05)

    import argparse

    from dmc.data.prepare import add_prepare_arguments, run_prepare
    args = add_prepare_arguments(argparse.ArgumentParser()).parse_args(
        ["--input", str(corpus_dir), "--output", str(tmp_path / "cli"), "--vocab-size", "300",
         "--retrieval-fraction", "0.5", "--retrieval-doc-tokens", "64",
         "--retrieval-kinds", "copy, kv", "--quiet"])
    assert run_prepare(args) == 0
    assert load_meta(tmp_path / "cli")["retrieval"]["kinds"] == ["copy", "kv"]
