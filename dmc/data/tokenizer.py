"""Tokenizers behind one small interface, as megatron-core's GPT dataset and our code need them.

Three sources:

* a SentencePiece ``.model`` file (Llama-1/2 style), :class:`SentencePieceTokenizer`;
* a Hugging Face ``tokenizer.json`` through the ``tokenizers`` package (optional ``hf`` extra),
  :class:`HFTokenizer`; special tokens are read from a ``tokenizer_config.json`` beside it when
  present, else recognised by their usual names;
* a SentencePiece BPE model trained on the corpus, :func:`train_sentencepiece`.

:func:`load_tokenizer` picks the class from a file or from a folder that holds one.
Ids that a tokenizer does not define are ``-1`` (megatron-core's convention for a missing pad).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

import sentencepiece

SENTENCEPIECE_FILE = "tokenizer.model"
HF_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"

# Trained models: Llama's layout (unk 0, bos 1, eos 2) plus a pad id; 256 byte-fallback pieces.
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
MIN_TRAINED_VOCAB = 256 + 4 + 1
# SentencePiece's BPE result depends on its thread count, so the count is fixed, not the machine's.
TRAIN_THREADS = 4
MAX_TRAIN_SENTENCES = 1_000_000


class Tokenizer(ABC):
    """The interface: ``encode``/``decode`` plus the ids and identifiers megatron-core reads.

    ``GPTDatasetConfig`` needs ``eod``, ``pad``, ``vocab_size`` and ``unique_identifiers``
    (a JSON-serialisable dict that enters the hash naming megatron's index cache).
    """

    kind: str
    path: Path  # the tokenizer file

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without bos/eos."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (any iterable of ints, a 1-D tensor or array included)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids (before any padding of the embedding table)."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id, appended after every document of the indexed dataset."""

    @property
    @abstractmethod
    def bos(self) -> int:
        """Beginning-of-sequence id, or -1."""

    @property
    @abstractmethod
    def pad(self) -> int:
        """Padding id, or -1."""

    @property
    @abstractmethod
    def unique_identifiers(self) -> dict:
        """What identifies this tokenizer: class and content hash."""

    @property
    def eos(self) -> int:
        """Alias of :attr:`eod`."""
        return self.eod

    def tokenize(self, text: str) -> list[int]:
        """Alias of :meth:`encode` (megatron's name)."""
        return self.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        """Alias of :meth:`decode` (megatron's name)."""
        return self.decode(ids)


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file."""

    kind = "sentencepiece"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(self.path))
        if self._sp.eos_id() < 0:
            raise ValueError(f"{str(self.path)!r}: no end-of-document token (the model was "
                             f"trained with eos_id=-1); accepted: a SentencePiece model with an "
                             f"eos piece, which every document of the data ends with")
        self._ids = {"class": type(self).__name__, "sha256": file_sha256(self.path)}

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    @property
    def unique_identifiers(self) -> dict:
        return dict(self._ids)


# Usual names of special tokens, tried in order when no tokenizer_config.json says otherwise.
_HF_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>")
_HF_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")
_HF_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` (needs ``tokenizers``: ``pip install 'dmc[hf]'``)."""

    kind = "hf"

    def __init__(self, path: str | os.PathLike):
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as err:
            raise ImportError(
                f"reading {str(path)!r} needs the 'tokenizers' package: pip install 'dmc[hf]' "
                "(or pass a SentencePiece .model file)"
            ) from err
        self.path = Path(path)
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as err:  # tokenizers raises a bare Exception on a file it cannot parse
            raise ValueError(f"{str(self.path)!r} is not a Hugging Face tokenizer.json ({err}); "
                             f"accepted: a tokenizer.json, a SentencePiece .model or a folder "
                             f"with one") from err
        config = _read_hf_config(self.path.with_name(HF_CONFIG_FILE))
        self._eod = self._special_id(config.get("eos_token"), _HF_EOS_NAMES)
        if self._eod < 0:
            raise ValueError(
                f"{str(self.path)!r}: no end-of-document token found; put a {HF_CONFIG_FILE} with "
                f"'eos_token' beside it, or use a vocabulary with one of {list(_HF_EOS_NAMES)}"
            )
        self._bos = self._special_id(config.get("bos_token"), _HF_BOS_NAMES)
        self._pad = self._special_id(config.get("pad_token"), _HF_PAD_NAMES)
        self._ids = {"class": type(self).__name__, "sha256": file_sha256(self.path),
                     "eod": self._eod}

    def _special_id(self, configured: str | None, names: tuple[str, ...]) -> int:
        """Id of the configured token, else of the first known name in the vocabulary, else -1."""
        for name in (configured,) if configured else names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return -1

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int:
        return self._bos

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def unique_identifiers(self) -> dict:
        return dict(self._ids)


def _read_hf_config(path: Path) -> dict[str, str]:
    """Special-token names from a ``tokenizer_config.json`` (plain or ``{"content": ...}``)."""
    if not path.is_file():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    names = {}
    for key in ("eos_token", "bos_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            names[key] = value
    return names


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a ``tokenizer.model`` or a ``tokenizer.json``."""
    return any((Path(folder) / name).is_file() for name in (SENTENCEPIECE_FILE, HF_FILE))


def resolve_tokenizer_path(path: str | os.PathLike) -> Path:
    """The tokenizer file named by ``path``: the file itself, or the one inside a folder.

    A folder is searched for ``tokenizer.model`` first, then ``tokenizer.json``.
    """
    path = Path(path)
    accepted = f"a SentencePiece .model file, a Hugging Face {HF_FILE}, or a folder with either"
    if not path.exists():
        raise FileNotFoundError(f"tokenizer {str(path)!r} does not exist; accepted: {accepted}")
    if path.is_dir():
        for name in (SENTENCEPIECE_FILE, HF_FILE):
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(
            f"tokenizer folder {str(path)!r} holds neither {SENTENCEPIECE_FILE} nor {HF_FILE}"
        )
    if path.suffix not in (".model", ".json"):
        raise ValueError(
            f"tokenizer {str(path)!r} has unsupported suffix {path.suffix!r}; accepted: {accepted}"
        )
    return path


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer from a ``.model`` file, a ``tokenizer.json``, or a folder (e.g. a prepared
    data folder or a Hugging Face model folder) holding one of them."""
    path = resolve_tokenizer_path(path)
    return SentencePieceTokenizer(path) if path.suffix == ".model" else HFTokenizer(path)


def training_sentences(texts: Iterable[str], max_sentences: int, seed: int) -> list[str]:
    """The non-blank lines of ``texts``; a seeded uniform sample of ``max_sentences`` of them,
    in corpus order, when there are more."""
    lines = [line for text in texts for line in text.split("\n") if line.strip()]
    if len(lines) <= max_sentences:
        return lines
    keep = sorted(random.Random(seed).sample(range(len(lines)), max_sentences))
    return [lines[i] for i in keep]


def train_sentencepiece(
    texts: Iterable[str],
    out_path: str | os.PathLike,
    vocab_size: int,
    *,
    seed: int = 1234,
    max_sentences: int = MAX_TRAIN_SENTENCES,
) -> SentencePieceTokenizer:
    """Train a byte-fallback SentencePiece BPE model on the lines of ``texts``; write ``out_path``.

    Llama-style settings: identity normalisation and whitespace kept as is (so ``decode(encode(s))
    == s`` for any string without SentencePiece's space mark U+2581, which decodes as a space;
    unseen characters included), digits split, ids unk 0 / bos 1 / eos 2 /
    pad 3. The same texts, ``vocab_size`` and ``seed`` give the same model bytes.
    Raises ValueError when ``vocab_size`` is too small or too large for the corpus.
    """
    if not isinstance(vocab_size, int) or vocab_size < MIN_TRAINED_VOCAB:
        raise ValueError(
            f"vocab_size must be an integer >= {MIN_TRAINED_VOCAB} (256 byte pieces, 4 special "
            f"tokens and at least one character), got {vocab_size!r}"
        )
    sentences = training_sentences(texts, max_sentences, seed)
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=0.9995,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=True,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            input_sentence_size=0,
            num_threads=TRAIN_THREADS,
            minloglevel=2,
        )
    except RuntimeError as err:
        reason = re.sub(r"^.*?\] ", "", str(err))
        raise ValueError(
            f"vocab_size={vocab_size} cannot be trained on this corpus: {reason}"
        ) from err
    Path(out_path).write_bytes(model.getvalue())
    return SentencePieceTokenizer(out_path)
