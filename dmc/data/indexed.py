"""Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) and the GPT dataset over them.

megatron-core is imported inside the functions: importing it takes seconds, and parsing the
command line (``dmc --help``) should not pay for that.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from dmc.data.tokenizer import Tokenizer

CACHE_DIRNAME = "cache"


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
    (no attention mask: attention builds its own). ``num_samples=None`` gives one epoch; more
    samples than an epoch holds repeat the data in new shuffles. Every rank must call this
    (megatron builds on rank 0 first when torch.distributed is initialised). Megatron caches its
    sample indices in ``cache_dir``, by default ``cache/`` beside the ``.bin`` file.
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
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=str(cache_dir if cache_dir is not None else prefix.parent / CACHE_DIRNAME),
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config)
    return builder.build()[0]
