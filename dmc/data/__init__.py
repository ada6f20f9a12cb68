"""Corpus -> tokenizer -> megatron indexed dataset (``dmc data prepare``); GPT dataset over it.

megatron-core is imported only when a dataset is written or built (see :mod:`dmc.data.indexed`).
"""

from dmc.data.cli import add_prepare_arguments, run_prepare
from dmc.data.corpus import Document, read_documents, split_documents
from dmc.data.indexed import build_gpt_dataset, read_indexed_dataset, write_indexed_dataset
from dmc.data.prepare import load_meta, prepare_data, split_prefix
from dmc.data.shakespeare import shakespeare_files
from dmc.data.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
    train_sentencepiece,
)

__all__ = [
    "Document",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "add_prepare_arguments",
    "build_gpt_dataset",
    "load_meta",
    "load_tokenizer",
    "prepare_data",
    "read_documents",
    "read_indexed_dataset",
    "run_prepare",
    "shakespeare_files",
    "split_documents",
    "split_prefix",
    "train_sentencepiece",
    "write_indexed_dataset",
]
