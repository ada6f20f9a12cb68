"""Tokenizers, megatron indexed datasets and the GPT dataset over them, on a synthetic corpus."""

import json
import random

import numpy
import pytest
import torch

from dmc.data.indexed import (
    build_gpt_dataset,
    loss_mask_prefix,
    read_indexed_dataset,
    write_indexed_dataset,
)
from dmc.data.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    load_tokenizer,
    resolve_tokenizer_path,
    train_sentencepiece,
    training_sentences,
)

WORDS = (
    "the king queen lord lady sword crown night day love death honour grace heaven earth fool "
    "speak come go stay hark alas good sweet noble gentle brave false true thou thee thy art"
).split()
VOCAB = 400


def make_documents(n_docs, seed=0):
    """Deterministic pseudo-English documents of a few lines each."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        lines = [
            " ".join(rng.choices(WORDS, k=rng.randint(3, 10))).capitalize() + rng.choice(".,;!?")
            for _ in range(rng.randint(5, 15))
        ]
        docs.append("\n".join(lines) + "\n")
    return docs


@pytest.fixture(scope="module")
def docs():
    return make_documents(40)


@pytest.fixture(scope="module")
def sp(docs, tmp_path_factory):
    return train_sentencepiece(
        docs, tmp_path_factory.mktemp("sp") / "tokenizer.model", VOCAB, seed=0
    )


def test_trained_sentencepiece_ids_and_round_trip(sp, docs):
    assert isinstance(sp, SentencePieceTokenizer) and sp.kind == "sentencepiece"
    assert (sp.vocab_size, sp.eod, sp.eos, sp.bos, sp.pad) == (VOCAB, 2, 2, 1, 3)
    for text in docs[:5] + ["  two  spaces\n\n\ttab ", "unseen: ünïcödé 🙂 中文 12345", ""]:
        ids = sp.encode(text)
        assert sp.decode(ids) == text and sp.detokenize(sp.tokenize(text)) == text
        assert all(0 <= i < sp.vocab_size for i in ids) and sp.eod not in ids and sp.pad not in ids
    assert len(sp.encode(docs[0])) < len(docs[0]) / 2  # it learned merges
    json.dumps(sp.unique_identifiers)


def test_training_is_deterministic_and_a_smaller_sample_changes_the_model(docs, tmp_path):
    paths = [tmp_path / f"{i}.model" for i in range(3)]
    train_sentencepiece(docs, paths[0], VOCAB, seed=0)
    train_sentencepiece(docs, paths[1], VOCAB, seed=0)
    train_sentencepiece(docs, paths[2], VOCAB, seed=0, max_sentences=50)
    assert paths[0].read_bytes() == paths[1].read_bytes() != paths[2].read_bytes()
    assert (
        load_tokenizer(paths[0]).unique_identifiers == load_tokenizer(paths[1]).unique_identifiers
    )


def test_training_sample_is_seeded_and_keeps_corpus_order():
    texts = ["\n".join(f"{d}-{i}" for i in range(10)) + "\n\n" for d in range(10)]
    everything = [f"{d}-{i}" for d in range(10) for i in range(10)]
    assert training_sentences(texts, 1000, seed=0) == everything
    sample = training_sentences(texts, 20, seed=0)
    assert sample == training_sentences(texts, 20, seed=0) != training_sentences(texts, 20, seed=1)
    assert len(sample) == 20 and sample == sorted(sample, key=everything.index)


@pytest.mark.parametrize(
    "vocab, fragment", [(100, ">= 261"), (270, "smaller than required_chars"), (50_000, "too high")]
)
def test_bad_vocab_size_is_a_value_error_naming_it(docs, tmp_path, vocab, fragment):
    with pytest.raises(ValueError, match=f"vocab_size.*{fragment}"):
        train_sentencepiece(docs, tmp_path / "t.model", vocab)


def test_load_tokenizer_resolves_files_and_folders(sp, tmp_path):
    assert resolve_tokenizer_path(sp.path.parent) == sp.path
    assert load_tokenizer(sp.path.parent).unique_identifiers == sp.unique_identifiers
    with pytest.raises(FileNotFoundError, match="accepted"):
        load_tokenizer(tmp_path / "nope.model")
    with pytest.raises(FileNotFoundError, match="neither tokenizer.model nor tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.txt").write_text("x")
    with pytest.raises(ValueError, match=r"unsupported suffix '\.txt'.*tokenizer\.json"):
        load_tokenizer(tmp_path / "vocab.txt")


def test_hf_tokenizer_json(docs, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<|endoftext|>", "<pad>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(tmp_path)
    assert isinstance(hf, HFTokenizer) and (hf.eod, hf.pad, hf.bos, hf.vocab_size) == (
        1,
        2,
        -1,
        300,
    )
    text = docs[0] + " ünï 🙂"
    assert hf.decode(hf.encode(text)) == text
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<unk>"}}))
    assert load_tokenizer(tmp_path).eod == 0


def test_indexed_dataset_round_trip(sp, docs, tmp_path):
    encoded = [sp.encode(d) for d in docs]
    counts = write_indexed_dataset(tmp_path / "ds", encoded, sp.vocab_size, sp.eod)
    assert counts == {"documents": len(docs), "tokens": sum(len(e) + 1 for e in encoded)}
    back = read_indexed_dataset(tmp_path / "ds")
    assert back == [e + [sp.eod] for e in encoded]
    assert [sp.decode(ids[:-1]) for ids in back] == docs
    assert (tmp_path / "ds.bin").stat().st_size == counts["tokens"] * numpy.dtype(
        numpy.uint16
    ).itemsize


def test_gpt_dataset_samples_come_from_the_data(sp, docs, tmp_path):
    encoded = [sp.encode(d) for d in docs]
    write_indexed_dataset(tmp_path / "ds", encoded, sp.vocab_size, sp.eod)
    seq = 32
    ds = build_gpt_dataset(tmp_path / "ds", seq, 200, 1234, sp)
    assert len(ds) >= 200
    stream = [t for e in encoded for t in e + [sp.eod]]
    windows = {tuple(stream[i : i + seq + 1]) for i in range(len(stream) - seq)}
    for i in (0, 1, len(ds) - 1):
        sample = ds[i]
        assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert all(v.shape == (seq,) for v in sample.values())
        assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
        assert torch.equal(sample["position_ids"], torch.arange(seq))
        assert bool((sample["loss_mask"] == 1).all())
        assert (*sample["tokens"].tolist(), sample["labels"][-1].item()) in windows
    assert list((tmp_path / "cache").iterdir())  # megatron's indices are cached beside the data
    again = build_gpt_dataset(tmp_path / "ds", seq, 200, 1234, sp)
    assert torch.equal(again[5]["tokens"], ds[5]["tokens"])


def test_a_loss_mask_beside_the_data_weights_each_label_of_every_sample(sp, docs, tmp_path):
    # the mask of a token is its id's parity: the sample's weights must follow its labels
    encoded = [sp.encode(d) for d in docs]
    prefix = tmp_path / "train_text_document"
    write_indexed_dataset(prefix, encoded, sp.vocab_size, sp.eod)
    write_indexed_dataset(loss_mask_prefix(prefix), [[t % 2 for t in e] for e in encoded],
                          sp.vocab_size, sp.eod % 2)
    ds = build_gpt_dataset(prefix, 32, 200, 1234, sp)
    for i in range(len(ds)):
        sample = ds[i]
        assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert torch.equal(sample["loss_mask"], (sample["labels"] % 2).float())
    with pytest.raises(ValueError, match="'\\*_text_document' prefix"):
        loss_mask_prefix(tmp_path / "ds")


def test_an_index_cache_outside_the_data_is_not_reused_for_other_data(sp, docs, tmp_path):
    """Megatron keys its sample-index cache by the path, seed and sizes, not the data: a
    ``cache_dir`` kept across a folder prepared again must not serve the old indices."""
    prefix, cache = tmp_path / "train_text_document", tmp_path / "elsewhere"
    for n_docs in (40, 12):  # the same path and tokenizer, other data
        encoded = [sp.encode(d) for d in docs[:n_docs]]
        write_indexed_dataset(prefix, encoded, sp.vocab_size, sp.eod)
        kept = build_gpt_dataset(prefix, 32, None, 1234, sp, cache_dir=cache)
        fresh = build_gpt_dataset(prefix, 32, None, 1234, sp, cache_dir=tmp_path / f"new{n_docs}")
        assert len(kept) == len(fresh)
        assert all(torch.equal(kept[i]["tokens"], fresh[i]["tokens"]) for i in range(len(kept)))


def test_a_sentencepiece_model_without_an_eos_piece_is_refused(docs, tmp_path):
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(docs), model_prefix=str(tmp_path / "noeos"), vocab_size=100,
        eos_id=-1, minloglevel=2, hard_vocab_limit=False)
    with pytest.raises(ValueError, match="noeos.model': no end-of-document token"):
        load_tokenizer(tmp_path / "noeos.model")


def test_gpt_dataset_needs_an_existing_prefix(sp, tmp_path):
    with pytest.raises(FileNotFoundError, match="dmc data prepare"):
        build_gpt_dataset(tmp_path / "missing", 16, 10, 0, sp)
