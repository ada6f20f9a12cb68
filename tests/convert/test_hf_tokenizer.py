"""tokenizer.json from this project's SentencePiece models: the same ids as SentencePiece on
random text, refused for a model whose encoding it would not reproduce."""
import io
import random
from pathlib import Path

import pytest

sentencepiece = pytest.importorskip("sentencepiece")
tokenizers = pytest.importorskip("tokenizers")

from dmc.convert.hf_tokenizer import sentencepiece_to_tokenizer_json  # noqa: E402

CHARS = [chr(c) for c in [*range(32, 127), 9, 10, 0xE9, 0x4E2D, 0x1F600, 0x2581]]


def test_same_ids_and_text_as_sentencepiece(tiny_data, tmp_path):
    model = Path(tiny_data) / "tokenizer.model"
    out = sentencepiece_to_tokenizer_json(model, tmp_path / "tokenizer.json")
    tok = tokenizers.Tokenizer.from_file(str(out))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice(CHARS) for _ in range(rng.randint(0, 40)))
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids), text
    assert tok.token_to_id("</s>") == sp.eos_id()
    assert tok.encode("</s>", add_special_tokens=False).ids == [sp.eos_id()]


def test_a_unigram_model_is_refused(tmp_path):
    lines = [" ".join(random.Random(i).choice(["alpha", "beta", "gamma", "delta"])
                      for _ in range(8)) for i in range(200)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                             model_type="unigram", vocab_size=16, minloglevel=2)
    (tmp_path / "uni.model").write_bytes(model.getvalue())
    with pytest.raises(ValueError, match="encodes .* not written"):
        sentencepiece_to_tokenizer_json(tmp_path / "uni.model", tmp_path / "tokenizer.json")
    assert not (tmp_path / "tokenizer.json").exists()
