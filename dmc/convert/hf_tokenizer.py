"""``tokenizer.json`` (Hugging Face ``tokenizers``) from this project's SentencePiece BPE models,
so an export loads with ``AutoTokenizer`` without ``protobuf`` (transformers converts a bare
``tokenizer.model`` through protobuf) and encodes exactly as SentencePiece does.

Handles the Llama-1/2 recipe that :func:`dmc.data.tokenizer.train_sentencepiece` trains (BPE,
byte fallback, identity normalisation, whitespace kept, a dummy prefix ``▁``): the BPE merges are
read off the vocabulary (every split of a piece into two pieces, ranked by the merged piece's
score, as SentencePiece applies them), the pre-processing is "replace spaces by ``▁`` and prepend
one ``▁``", decoding undoes it. Other SentencePiece models (unigram, NFKC normalisation) are
refused: the result is checked against SentencePiece before it is written.
"""
from __future__ import annotations

from pathlib import Path

SPACE = "\u2581"


def sentencepiece_to_tokenizer_json(model_path: str | Path, out_path: str | Path,
                                    texts: tuple[str, ...] = ()) -> Path:
    """Writes ``out_path`` (a ``tokenizer.json``) equivalent to the SentencePiece ``model_path``,
    checked on :data:`PROBES` and ``texts`` first: raises ValueError (nothing written) when
    an encoding differs, as it would for a unigram or NFKC-normalised model."""
    import sentencepiece
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_path))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    special = [i for i in range(len(pieces)) if sp.is_control(i) or sp.is_unknown(i)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merges(sp, vocab),
                                     unk_token=sp.id_to_piece(sp.unk_id()), fuse_unk=True,
                                     byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE),
                                                 normalizers.Replace(" ", SPACE)])
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken(pieces[i], special=True, normalized=False)
                                  for i in special])
    _verify(sp, tokenizer, model_path, PROBES + tuple(texts))
    tokenizer.save(str(out_path))
    return Path(out_path)


PROBES = ("Hello, world!", "  two  spaces\tand a tab\n", "KING HENRY V. 1599 -> 2026",
          "caf\u00e9 na\u00efve \u00fcber \u4e2d\u6587 \U0001f600", "", " ", "\n\n",
          "What's this? 'Tis nothing.\nEnter HAMLET, reading.")


def _verify(sp, tokenizer, model_path, texts) -> None:
    """Raises ValueError unless ``tokenizer`` encodes every text as SentencePiece does."""
    for text in texts:
        want, got = sp.encode(text), tokenizer.encode(text, add_special_tokens=False).ids
        if want != got:
            raise ValueError(f"{model_path}: the tokenizer.json built from it encodes {text!r} "
                             f"as {got[:12]}, SentencePiece as {want[:12]} (not a Llama-style "
                             f"BPE model?); not written")


def _merges(sp, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges ``(left, right)`` for every piece that splits into two pieces, in the order
    SentencePiece applies them: higher score of the merged piece first, then by the ids of the
    parts."""
    scored = []
    for piece, index in vocab.items():
        if sp.is_control(index) or sp.is_unknown(index) or sp.is_byte(index):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                scored.append((-sp.get_score(index), vocab[left], vocab[right], left, right))
    return [(left, right) for *_, left, right in sorted(scored)]
