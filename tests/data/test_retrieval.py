"""Retrieval documents: deterministic, made of corpus spans, passages really recur, kv lines are
queried again, each document knows where its queries start, and `dmc data prepare
--retrieval-fraction` mixes them into the train split only (`--retrieval-loss queries`: with a
loss mask that megatron's samples carry)."""
import random

import pytest
import torch

from dmc.data.retrieval import (
    COPY_SHARE,
    DECOY_TAIL_TOKENS,
    NEEDLE_EVERY,
    NEEDLE_KEY_TOKENS,
    NEEDLE_VALUE_TOKENS,
    PASSAGE_TOKENS,
    QUERY_GAP_TOKENS,
    SPACED_NEEDLE_EVERY,
    _Stream,
    _text_without,
    copy_document,
    kv_document,
    make_retrieval_documents,
    needle_document,
    repeat_document,
)

from conftest import text_corpus

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
        document = repeat_document(stream, 512, rng)
        doc = document.tokens
        assert len(doc) == 512 and document.query_start == 0
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
        assert repeat_document(stream, 512, rng) == document


def test_copy_documents_repeat_one_random_sequence():
    rng = random.Random(2)
    stream = _Stream(corpus(), rng)
    periods = []
    for _ in range(200):
        doc = copy_document(stream, 512, rng).tokens
        period = next(p for p in range(1, 513) if doc[p:] == doc[:-p])
        assert 4 <= period <= 256 and len(doc) == 512
        periods.append(period)
    assert sum(p <= 32 for p in periods) > 60  # log-uniform: short periods are common


def test_kv_documents_query_their_own_lines():
    rng = random.Random(1)
    document = kv_document(_Stream(corpus(), rng), 400, rng, (SEP, END))
    doc = document.tokens
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
    assert document.query_start == sum(map(len, listed))  # the first repeated line


def test_kv_keys_are_distinct_and_no_span_holds_a_separator():
    """On a corpus of four token ids, separators included, keys of 2-6 tokens would repeat
    and spans would hold ':' or a line end: every key line is still one key, one answer."""
    rng = random.Random(2)
    small = [[rng.choice([1, 2, SEP, END]) for _ in range(3000)] for _ in range(3)]
    document = kv_document(_Stream(small, rng), 400, rng, (SEP, END))
    body = document.tokens[:document.query_start]
    lines = [line for line in _split(body, END) if line]
    assert len(lines) > 5
    keys = [tuple(line[:line.index(SEP)]) for line in lines]
    assert all(line.count(SEP) == 1 for line in lines)
    assert len(set(keys)) == len(keys)


def test_a_corpus_with_no_line_for_kv_documents_is_an_error_not_a_hang():
    """Every 2-6 token span holds a separator: not one key : value line can be drawn, which
    made empty kv documents and, with kv alone, a loop that never reached its token count."""
    rng = random.Random(3)
    lines_only = [[rng.choice([1, SEP, END]) if i % 2 else END for i in range(3000)]
                  for _ in range(3)]
    with pytest.raises(ValueError, match="kv documents: no key : value line"):
        kv_document(_Stream(lines_only, rng), 400, rng, (SEP, END))
    with pytest.raises(ValueError, match="leave kv out of the retrieval kinds"):
        make_retrieval_documents(lines_only, 2000, doc_tokens=400, kinds=["kv"],
                                 separators=(SEP, END))


def _split(tokens, end):
    lines, line = [], []
    for t in tokens:
        if t == end:
            lines.append(line)
            line = []
        else:
            line.append(t)
    return lines


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
        document = needle_document(stream, 1024, rng)
        doc = document.tokens
        rng.setstate(state)  # replay the first draws: the needles' sizes
        lengths = [(rng.randint(*NEEDLE_KEY_TOKENS), rng.randint(*NEEDLE_VALUE_TOKENS))
                   for _ in range(1024 // NEEDLE_EVERY)]
        tail = sum(k + v for k, v in lengths)
        assert len(doc) == 1024  # haystack, needles in it, then the queries
        body, queries = doc[:-tail], doc[-tail:]
        assert document.query_start == len(body)
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


def test_decoy_documents_repeat_each_keys_tail_with_another_value():
    docs = [list(range(i * 10_000, i * 10_000 + 3000)) for i in range(6)]
    rng = random.Random(7)
    stream = _Stream(docs, rng)
    decoys = 0
    for _ in range(4):
        document = needle_document(stream, 1024, rng, decoys=True)
        doc, body = document.tokens, document.tokens[:document.query_start]
        pieces = runs(doc[document.query_start:])
        pairs = [(pieces[i], pieces[i + 1]) for i in range(0, len(pieces), 2)]
        assert abs(len(doc) - 1024) < 64
        for key, value in pairs:
            assert len(occurrences(body, key + value)) == 1  # still one answer
            assert len(occurrences(doc, key)) == 2
            needle_at = occurrences(body, key)[0] + len(key)
            others = [(tail, at + tail) for tail in range(DECOY_TAIL_TOKENS[0],
                                                           DECOY_TAIL_TOKENS[1] + 1)
                      for at in occurrences(body, key[-tail:]) if at + tail != needle_at]
            decoys += bool(others)
            for tail, end in others:  # a partial match of the key, followed by another value
                assert body[end:end + len(value)] != value
    assert decoys >= 0.9 * 4 * (1024 // NEEDLE_EVERY)


def test_spaced_documents_put_text_without_any_key_before_every_query():
    """Runs of consecutive ids: the queries read text, key, value, text, key, value, ...; each
    needle is queried once, after its drawn 16-48 tokens of text, which hold no key."""
    docs = [list(range(i * 10_000, i * 10_000 + 3000)) for i in range(6)]
    rng = random.Random(9)
    stream = _Stream(docs, rng)
    count = 1024 // SPACED_NEEDLE_EVERY
    for _ in range(4):
        state = rng.getstate()
        document = needle_document(stream, 1024, rng, spaced=True)
        doc, body = document.tokens, document.tokens[:document.query_start]
        rng.setstate(state)  # replay the first draws: the needles' sizes, then the gaps
        lengths = [(rng.randint(*NEEDLE_KEY_TOKENS), rng.randint(*NEEDLE_VALUE_TOKENS))
                   for _ in range(count)]
        gaps = [rng.randint(*QUERY_GAP_TOKENS) for _ in range(count)]
        assert len(doc) == 1024
        pieces = runs(doc[document.query_start:])  # text, key, value, text, key, value, ...
        assert len(pieces) == 3 * count
        triples = [pieces[i:i + 3] for i in range(0, len(pieces), 3)]
        assert [len(text) for text, _, _ in triples] == gaps
        assert sorted((len(k), len(v)) for _, k, v in triples) == sorted(lengths)
        for text, key, value in triples:
            assert len(occurrences(body, key + value)) == 1
            assert len(occurrences(doc, key)) == 2  # the needle's and its query's
            assert all(not occurrences(text, k) for _, k, _ in triples)


def test_text_before_a_query_is_cut_short_of_a_key_it_cannot_avoid():
    stream = _Stream([list(range(130))], random.Random(0))
    key = list(range(60, 66))
    text = _text_without(stream, 120, [key])  # every 120-token span holds the key
    assert text == list(range(text[0], 60)) and not occurrences(text, key)
    assert _text_without(stream, 0, [key]) == []


def test_decoys_are_a_kind_and_leave_the_other_kinds_unchanged():
    docs = corpus()
    plain = make_retrieval_documents(docs, 8000, doc_tokens=512, seed=2, kinds=["needle"])
    mixed = make_retrieval_documents(docs, 8000, doc_tokens=512, seed=2,
                                     kinds=["needle", "decoy"])
    assert plain[0] == mixed[0]
    assert len(mixed[1].tokens) > mixed[1].query_start > 0
    assert mixed[1].tokens != plain[1].tokens


def test_make_documents_is_deterministic_and_sized():
    docs = corpus()
    a = make_retrieval_documents(docs, 20_000, doc_tokens=512, seed=4, separators=(SEP, END))
    b = make_retrieval_documents(docs, 20_000, doc_tokens=512, seed=4, separators=(SEP, END))
    c = make_retrieval_documents(docs, 20_000, doc_tokens=512, seed=5, separators=(SEP, END))
    assert a == b and a != c
    assert 20_000 <= sum(len(d.tokens) for d in a) < 20_000 + 512
    vocab = {t for d in docs for t in d} | {SEP, END}
    assert {t for d in a for t in d.tokens} <= vocab
    with pytest.raises(ValueError, match="separators"):
        make_retrieval_documents(docs, 100, kinds=("kv",))
    with pytest.raises(ValueError, match="kinds: .*choose from repeat, kv, copy, needle"):
        make_retrieval_documents(docs, 100, kinds=("nope",))
    with pytest.raises(ValueError, match="doc_tokens must be >= 64"):
        make_retrieval_documents(docs, 100, doc_tokens=40, kinds=("repeat",))


def test_prepare_mixes_retrieval_documents_into_train_only(tmp_path):
    from dmc.data.indexed import read_indexed_dataset
    from dmc.data.prepare import load_meta, prepare_data, split_prefix

    corpus_dir = text_corpus(tmp_path / "corpus")
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

    from dmc.data.cli import add_prepare_arguments, run_prepare
    args = add_prepare_arguments(argparse.ArgumentParser()).parse_args(
        ["--input", str(corpus_dir), "--output", str(tmp_path / "cli"), "--vocab-size", "300",
         "--retrieval-fraction", "0.5", "--retrieval-doc-tokens", "64",
         "--retrieval-kinds", "copy, kv", "--quiet"])
    assert run_prepare(args) == 0
    assert load_meta(tmp_path / "cli")["retrieval"]["kinds"] == ["copy", "kv"]


def test_queries_loss_mask_covers_the_lookups_and_megatron_samples_carry_it(tmp_path):
    from dmc.data import build_gpt_dataset, load_tokenizer
    from dmc.data.indexed import loss_mask_prefix, read_indexed_dataset
    from dmc.data.prepare import prepare_data, split_prefix

    corpus_dir = text_corpus(tmp_path / "corpus")
    kinds = ["needle", "kv", "copy"]
    meta = prepare_data([corpus_dir], tmp_path / "out", vocab_size=300, valid_fraction=0.2,
                        quiet=True, retrieval_fraction=0.5, retrieval_doc_tokens=256,
                        retrieval_kinds=kinds, retrieval_loss="queries")
    assert meta["retrieval"]["loss"] == "queries"
    train = split_prefix(tmp_path / "out", "train")
    docs, masks = read_indexed_dataset(train), read_indexed_dataset(loss_mask_prefix(train))
    assert [len(m) for m in masks] == [len(d) for d in docs]
    corpus_docs = len(docs) - meta["retrieval"]["documents"]
    assert all(set(m) == {1} for m in masks[:corpus_docs])
    for i, mask in enumerate(masks[corpus_docs:]):
        start = mask.index(1)
        assert set(mask[start:]) == {1}  # zeros, then ones to the end (EOD included)
        assert (start > len(mask) // 4) if kinds[i % 3] != "copy" else start == 0
    tok = load_tokenizer(tmp_path / "out")
    data = build_gpt_dataset(train, 128, None, 7, tok)
    plain = build_gpt_dataset(train, 128, None, 7, tok, cache_dir=tmp_path / "other")
    masked = 0
    for index in range(0, len(data), 7):
        sample, reference = data[index], plain[index]
        assert torch.equal(sample["tokens"], reference["tokens"])
        weights = sample["loss_mask"] / reference["loss_mask"].clamp(min=1)
        assert set(weights.unique().tolist()) <= {0.0, 1.0}
        masked += int((weights == 0).sum())
    assert masked > 0
    # with "all", a mask left by an earlier run is removed, and samples are unmasked again
    prepare_data([corpus_dir], tmp_path / "out", vocab_size=300, valid_fraction=0.2,
                 quiet=True, retrieval_fraction=0.5, retrieval_doc_tokens=256,
                 retrieval_kinds=kinds)
    assert not loss_mask_prefix(train).with_suffix(".idx").exists()
    assert type(build_gpt_dataset(train, 128, None, 7, tok)).__name__ == "GPTDataset"
    with pytest.raises(ValueError, match="retrieval_loss: 'answers' not accepted; choose from "
                                         "all, queries, answerable"):
        prepare_data([corpus_dir], tmp_path / "bad", retrieval_fraction=0.5,
                     retrieval_loss="answers", quiet=True)
    with pytest.raises(ValueError, match="needs retrieval documents"):
        prepare_data([corpus_dir], tmp_path / "bad", retrieval_loss="queries", quiet=True)


@pytest.mark.parametrize("kind", ["needle", "decoy", "spaced", "kv"])
def test_sources_point_back_at_the_span_each_query_looks_up(kind):
    for document in make_retrieval_documents(corpus(seed=3), 4000, doc_tokens=512, seed=4,
                                             separators=(SEP, END), kinds=[kind]):
        doc, start, sources = document.tokens, document.query_start, document.sources
        assert len(sources) == len(doc) - start > 0
        looked_up = [i for i, s in enumerate(sources, start) if s]
        if kind != "spaced":  # every query token looks something up (no text between them)
            assert len(looked_up) == len(sources)
        for i in looked_up:  # a query of n tokens repeats the n tokens from where it points
            first = i
            while first - 1 >= start and sources[first - 1 - start] == sources[i - start] - (
                    i - first + 1):
                first -= 1
            origin = i - sources[i - start]
            assert origin + (i - first) < start  # inside the body, before the queries
            assert doc[origin:origin + i - first + 1] == doc[first:i + 1]


def test_answerable_loss_keeps_a_query_in_the_windows_that_hold_its_needle(tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from dmc.data import build_gpt_dataset, load_tokenizer
    from dmc.data.indexed import (_MaskIds, loss_mask_prefix, read_indexed_dataset,
                                  write_indexed_dataset)
    from dmc.data.prepare import prepare_data, split_prefix

    corpus_dir = text_corpus(tmp_path / "corpus")
    options = dict(vocab_size=300, valid_fraction=0.2, quiet=True, retrieval_fraction=0.5,
                   retrieval_doc_tokens=256, retrieval_kinds=["needle", "kv", "copy"])
    prepare_data([corpus_dir], tmp_path / "q", retrieval_loss="queries", **options)
    meta = prepare_data([corpus_dir], tmp_path / "a", retrieval_loss="answerable", **options)
    assert meta["retrieval"]["loss"] == "answerable"
    q_train, a_train = split_prefix(tmp_path / "q", "train"), split_prefix(tmp_path / "a", "train")
    q_masks = read_indexed_dataset(loss_mask_prefix(q_train))
    a_masks = read_indexed_dataset(loss_mask_prefix(a_train))
    assert read_indexed_dataset(a_train) == read_indexed_dataset(q_train)  # the same tokens
    assert [[min(v, 1) for v in m] for m in a_masks] == q_masks  # loss on the same tokens
    # each token's place in the split + 1 (0: an end of document), sampled as the text is: label
    # j at place g keeps its loss when what it looks up, g - (value - 1), is in the window's
    # first j + 1 tokens
    docs = read_indexed_dataset(a_train)
    offsets = [sum(len(d) for d in docs[:i]) for i in range(len(docs))]
    where = tmp_path / "where_text_document"
    write_indexed_dataset(where, ([o + k + 1 for k in range(len(d) - 1)] for o, d in
                                  zip(offsets, docs)), 2 ** 31 - 1, 0)
    tok = load_tokenizer(tmp_path / "a")
    seq = 64
    data = build_gpt_dataset(a_train, seq, None, 7, tok)
    plain = build_gpt_dataset(a_train, seq, None, 7, tok, cache_dir=tmp_path / "plain")
    config = GPTDatasetConfig(
        random_seed=7, sequence_length=seq, blend=([str(where)], None), split="1,0,0",
        tokenizer=_MaskIds(2 ** 31 - 1), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, path_to_cache=str(tmp_path / "w"))
    index = BlendedMegatronDatasetBuilder(GPTDataset, [None, 0, 0], lambda: True,
                                          config).build()[0]
    flat = [v for m in a_masks for v in m]
    kept = dropped = 0
    for i in range(len(data)):
        window = [*index[i]["tokens"].tolist(), index[i]["labels"][-1].item()]
        weights = data[i]["loss_mask"] / plain[i]["loss_mask"].clamp(min=1)
        for j, g in enumerate(window[1:]):
            value = flat[g - 1] if g else 1
            expected = value == 1 or (value > 1 and g - (value - 1) in window[:j + 1])
            assert weights[j].item() == float(expected), (i, j, value)
            kept += value > 1 and expected
            dropped += value > 1 and not expected
    assert kept > 0 and dropped > 0


def test_answerable_mask_keeps_a_query_exactly_in_the_windows_from_its_needles_start():
    """--retrieval-loss answerable on a hand-built needle document: in every training window
    (tokens a..a+n), a query token's label keeps its loss iff the needle it repeats starts at
    or after a (found by searching the body), text between queries always, the body never."""
    from dmc.data.indexed import window_weights
    from dmc.data.prepare import _loss_mask
    from dmc.data.retrieval import RetrievalDocument

    needle = [100, 101, 102]
    body = [50, 51, 52] + needle + [53, 54, 55, 56]
    gap, start = [57, 58], len(body)
    tokens = body + gap + needle
    sources = [0] * len(gap) + [p - 3 for p in range(start + len(gap), len(tokens))]
    mask = _loss_mask(RetrievalDocument(tokens, start, tuple(sources)), "answerable")
    assert len(mask) == len(tokens) and mask[:start] == [0] * start
    origin = occurrences(body, needle)[0]  # where a query's answer starts
    assert origin == 3
    decided = set()
    for a in range(len(tokens)):
        for n in range(1, len(tokens) - a):
            weights = window_weights(mask[a + 1:a + n + 1]).tolist()
            for j, weight in enumerate(weights):
                place = a + 1 + j  # label j is token a + 1 + j
                if place < start:
                    want = 0.0
                elif place < start + len(gap):
                    want = 1.0
                else:
                    want = float(a <= origin)
                    decided.add(want)
                assert weight == want, (a, n, j)
    assert decided == {0.0, 1.0}
