"""Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) and the GPT dataset over them.

megatron-core is imported inside the functions: importing it takes seconds, and parsing the
command line (``dmc --help``) should not pay for that.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path

from dmc.data.tokenizer import Tokenizer, file_sha256

CACHE_DIRNAME = "cache"
TEXT_SUFFIX, LOSS_MASK_SUFFIX = "_text_document", "_loss_mask_document"


def loss_mask_prefix(prefix: str | os.PathLike) -> Path:
    """Where the loss mask of the indexed dataset at ``prefix`` (``..._text_document``) lives:
    one value per token, the same document lengths (``dmc data prepare --retrieval-loss``): 0 no
    loss, 1 loss, ``1 + d`` loss when the token ``d`` places back is in the same training window
    (:func:`window_weights`)."""
    prefix = Path(prefix)
    if not prefix.name.endswith(TEXT_SUFFIX):
        raise ValueError(f"a loss mask belongs to a '*{TEXT_SUFFIX}' prefix, got {str(prefix)!r}")
    return prefix.with_name(prefix.name[:-len(TEXT_SUFFIX)] + LOSS_MASK_SUFFIX)


def write_indexed_dataset(
    prefix: str | os.PathLike, documents: Iterable[list[int]], vocab_size: int, eod: int
) -> dict[str, int]:
    """Write token documents to ``prefix.bin``/``prefix.idx``, ``eod`` appended after each one.

    The token dtype is megatron's ``DType.optimal_dtype(vocab_size)`` (uint16 below 65500 ids).
    Returns ``{"documents": n, "tokens": n}`` (tokens include the EOD ids).
    """
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    counts = {"documents": 0, "tokens": 0}
    for ids in documents:
        tokens = numpy.asarray([*ids, eod], dtype=dtype)
        builder.add_document(tokens, [tokens.size])
        counts["documents"] += 1
        counts["tokens"] += int(tokens.size)
    builder.finalize(f"{prefix}.idx")
    return counts


def read_indexed_dataset(prefix: str | os.PathLike) -> list[list[int]]:
    """All documents of ``prefix.bin``/``.idx`` as lists of ids (EOD included), for checks."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return [dataset[i].tolist() for i in range(len(dataset))]


def build_gpt_dataset(
    prefix: str | os.PathLike,
    seq_length: int,
    num_samples: int | None,
    seed: int,
    tokenizer: Tokenizer,
    cache_dir: str | os.PathLike | None = None,
):
    """A megatron ``GPTDataset`` over all documents of one indexed dataset.

    Samples are dicts of ``seq_length``-long tensors ``tokens, labels, loss_mask, position_ids``
    (no attention mask: attention builds its own). Where a loss mask lies beside the data
    (:func:`loss_mask_prefix`), ``loss_mask`` is multiplied by its weight at each label
    (:func:`window_weights`).
    ``num_samples=None`` gives one epoch; more samples than an epoch holds repeat the data in
    new shuffles. Every rank must call this (megatron builds on rank 0 first when
    torch.distributed is initialised). Megatron caches its sample indices in ``cache_dir``, by
    default ``cache/`` beside the ``.bin`` file.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefix = Path(prefix)
    if not Path(f"{prefix}.idx").is_file():
        raise FileNotFoundError(
            f"no indexed dataset at {str(prefix)!r} (missing {prefix}.idx); run `dmc data prepare`"
        )
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([str(prefix)], None),
        split="1,0,0",
        tokenizer=_DataKeyed(tokenizer, Path(f"{prefix}.idx")),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=str(cache_dir if cache_dir is not None else prefix.parent / CACHE_DIRNAME),
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config)
    dataset = builder.build()[0]
    mask = loss_mask_prefix(prefix) if prefix.name.endswith(TEXT_SUFFIX) else None
    if mask is None or not Path(f"{mask}.idx").is_file():
        return dataset
    # the same document sizes, seed and lengths give the same samples: mask i belongs to sample i;
    # no pad id among the ids, or megatron would zero the labels equal to the tokenizer's pad
    config = dataclasses.replace(config, blend=([str(mask)], None),
                                 tokenizer=_DataKeyed(_MaskIds(tokenizer.vocab_size),
                                                      Path(f"{mask}.idx")))
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config)
    return LossMaskedDataset(dataset, builder.build()[0])


class _DataKeyed:
    """``tokenizer`` as a GPT dataset's config reads it, its unique identifiers extended by the
    SHA-256 of the dataset's ``.idx`` (its document sizes, what the sample indices derive from):
    megatron keys its index cache by the identifiers, the path and the sizes asked for, not by
    the data, so a ``cache_dir`` outside a folder prepared again would serve the old data's
    indices (samples past the new data's end, or of the wrong length)."""

    def __init__(self, tokenizer, idx_path: Path):
        self.tokenizer, self.idx_sha256 = tokenizer, file_sha256(idx_path)

    def __getattr__(self, name: str):
        if name == "tokenizer":  # not yet set (a copy being built)
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    @property
    def unique_identifiers(self) -> dict:
        return {**self.tokenizer.unique_identifiers, "idx_sha256": self.idx_sha256}


@dataclasses.dataclass(frozen=True)
class _MaskIds:
    """What ``GPTDatasetConfig`` reads of a tokenizer, for a dataset of 0/1 loss weights."""

    vocab_size: int
    eod: int = -2  # not read (no EOD masking or resets); apart from pad, or megatron warns
    pad: int = -1

    @property
    def unique_identifiers(self) -> dict:
        return {"class": "loss_mask", "vocab_size": self.vocab_size}


def window_weights(values):
    """Loss weights ``[seq]`` of one training window from its loss-mask values ``[seq]`` at the
    labels (see :func:`loss_mask_prefix`): label ``j`` is the window's token ``j + 1``, so a
    value ``1 + d`` keeps its loss when ``d <= j + 1`` (what it looks up starts inside the
    window), drops it otherwise; 0 and 1 are kept as they are."""
    import torch

    values = torch.as_tensor(values).long()
    reach = torch.arange(1, values.numel() + 1)
    return ((values == 1) | ((values > 1) & (values - 1 <= reach))).float()


class LossMaskedDataset:
    """Samples of ``data`` whose ``loss_mask`` is multiplied by the window weights
    (:func:`window_weights`) of the aligned samples' ``labels`` of ``mask`` (a GPT dataset over
    the loss-mask values with the same documents and sample order)."""

    def __init__(self, data, mask):
        if len(data) != len(mask):
            raise ValueError(f"loss mask has {len(mask)} samples, the data {len(data)}")
        self.data, self.mask = data, mask

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict:
        sample = dict(self.data[index])
        weights = window_weights(self.mask[index]["labels"])
        sample["loss_mask"] = sample["loss_mask"] * weights.to(sample["loss_mask"].dtype)
        return sample
