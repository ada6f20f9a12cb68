"""Reading .txt / .jsonl / folders into documents, and the train/valid split."""

import json

import pytest

from dmc.data.corpus import (
    Document,
    find_files,
    read_documents,
    split_documents,
    split_single_document,
)


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_txt_is_one_document_per_file_and_crlf_is_normalised(tmp_path):
    path = _write(tmp_path / "a.txt", "line one\r\n\r\nline two\r\n")
    (doc,) = read_documents([path])
    assert doc == Document("line one\n\nline two\n", str(path))


def test_split_lines_gives_one_document_per_non_blank_line(tmp_path):
    path = _write(tmp_path / "a.txt", "first\n\n  \nsecond\n")
    docs = read_documents([path], split_lines=True)
    assert [d.text for d in docs] == ["first", "second"]
    assert docs[1].source == f"{path}:4"


def test_jsonl_reads_the_text_field_and_skips_blank_lines(tmp_path):
    path = _write(
        tmp_path / "c.jsonl",
        json.dumps({"text": "alpha", "id": 1}) + "\n\n" + json.dumps({"text": "beta"}),
    )
    docs = read_documents([path])
    assert [d.text for d in docs] == ["alpha", "beta"]
    assert [d.source for d in docs] == [f"{path}:1", f"{path}:3"]
    other = _write(tmp_path / "d.jsonl", json.dumps({"body": "gamma"}) + "\n")
    assert [d.text for d in read_documents([other], text_key="body")] == ["gamma"]


def test_jsonl_missing_field_names_file_line_and_field(tmp_path):
    path = _write(
        tmp_path / "bad.jsonl",
        json.dumps({"text": "ok"}) + "\n\n" + json.dumps({"content": "x"}) + "\n",
    )
    with pytest.raises(ValueError) as err:
        read_documents([path])
    assert f"{path}:3" in str(err.value) and "'text'" in str(err.value)


@pytest.mark.parametrize(
    "line, fragment", [("not json", "invalid JSON"), ('{"text": 3}', "must be a string")]
)
def test_jsonl_bad_lines(tmp_path, line, fragment):
    path = _write(tmp_path / "bad.jsonl", line + "\n")
    with pytest.raises(ValueError, match=fragment):
        read_documents([path])


def test_folders_are_recursive_sorted_deduplicated_and_skip_hidden_and_other_files(tmp_path):
    root = tmp_path / "corpus"
    for name in ["b.txt", "a/z.jsonl", "a/y.txt", ".hidden/x.txt", "notes.md"]:
        _write(root / name, json.dumps({"text": name}) if name.endswith(".jsonl") else name)
    files = find_files([root, root / "b.txt"])
    assert [p.relative_to(root).as_posix() for p in files] == ["a/y.txt", "a/z.jsonl", "b.txt"]
    assert [d.text for d in read_documents([root])] == ["a/y.txt", "a/z.jsonl", "b.txt"]


def test_bad_inputs_name_the_path_and_accepted_values(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt.*accepted"):
        read_documents([tmp_path / "missing.txt"])
    with pytest.raises(ValueError, match=r"unsupported suffix '\.csv'.*\.jsonl"):
        read_documents([_write(tmp_path / "x.csv", "a,b")])
    with pytest.raises(ValueError, match="holds no corpus file"):
        read_documents([_write(tmp_path / "only_md" / "x.md", "x").parent])
    with pytest.raises(ValueError, match="empty corpus"):
        read_documents([_write(tmp_path / "blank.txt", " \n\n")])
    with pytest.raises(ValueError, match="not valid UTF-8"):
        (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
        read_documents([tmp_path / "latin1.txt"])


def _docs(sizes):
    return [Document("x" * size, f"doc{i}") for i, size in enumerate(sizes)]


def test_split_is_deterministic_disjoint_and_keeps_order():
    docs = _docs([100] * 50)
    train, valid = split_documents(docs, 0.1, seed=7)
    assert (train, valid) == split_documents(docs, 0.1, seed=7)
    assert split_documents(docs, 0.1, seed=8)[1] != valid
    assert len(valid) == 5 and len(train) == 45
    assert sorted(train + valid, key=docs.index) == docs
    assert train == sorted(train, key=docs.index) and valid == sorted(valid, key=docs.index)


def test_split_keeps_at_least_one_document_on_each_side():
    assert [len(s) for s in split_documents(_docs([10, 10]), 0.01, seed=0)] == [1, 1]
    assert [len(s) for s in split_documents(_docs([10, 10, 10]), 0.99, seed=0)] == [1, 2]


def test_split_is_sized_by_characters():
    docs = _docs([1000] + [10] * 100)
    for seed in range(5):
        train, valid = split_documents(docs, 0.05, seed)
        size = sum(len(d.text) for d in valid)
        assert size >= 0.05 * 2000 and (docs[0] in valid or size < 0.05 * 2000 + 10)


def test_a_few_large_documents_are_cut_not_moved_whole():
    """Two plays at valid_fraction 0.02 once put one whole play (half the corpus) in valid."""
    docs = [Document("\n".join(f"{name} line {i}" for i in range(1000)), name)
            for name in ("a.txt", "b.txt")]
    total = sum(len(d.text) for d in docs)
    train, valid = split_documents(docs, 0.02, seed=0)
    assert len(train) == 2 and len(valid) == 1
    share = sum(len(d.text) for d in valid) / total
    assert 0.015 < share < 0.025
    cut = next(d for d in docs if valid[0].text in d.text)
    assert any(t.text + "\n" + valid[0].text == cut.text for t in train)


def test_single_document_is_cut_at_a_line_boundary():
    doc = Document("\n".join(f"line {i}" for i in range(100)), "one.txt")
    train, valid = split_documents([doc], 0.1, seed=0)
    assert [len(train), len(valid)] == [1, 1]
    assert train[0].text + "\n" + valid[0].text == doc.text
    assert valid[0].text.split("\n") == [f"line {i}" for i in range(90, 100)]
    with pytest.raises(ValueError, match="fewer than two non-blank lines"):
        split_single_document(Document("only one line\n\n", "x.txt"), 0.1)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 2])
def test_split_rejects_fractions_outside_the_open_unit_interval(fraction):
    with pytest.raises(ValueError, match="valid_fraction"):
        split_documents(_docs([1, 1]), fraction, seed=0)
