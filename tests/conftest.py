"""Shared test set-up and fixtures.

Triton kernels run under the interpreter on machines without CUDA; the variable must be set
before any kernel module is imported, hence here at the top of the root conftest.
"""
import importlib.util
import os
import random
import sys
import warnings
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, os.cpu_count() or 1))
warnings.filterwarnings("ignore", module="megatron")


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module (the benchmarks are not a package;
    import with ``from conftest import load_benchmark``)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where dataclasses look up the module's globals
    spec.loader.exec_module(module)
    return module


def pytest_collection_modifyitems(config, items):
    """``gpu``-marked tests skip on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu mark)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def parallel_1x1():
    """Single-process megatron set-up (gloo on CPU), torn down after the module."""
    from dmc.megatron.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(1, 1, seed=1234)
    yield
    destroy_parallel()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread is as fast as two and does not stall in OpenMP barriers
    when the machine is oversubscribed (seen: 10 s vs 75 s for the engine tests)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


WORDS = ("the king queen crown sword night day love death honour blood rose storm sea ship "
         "letter father daughter son brother ghost witch forest castle battle peace").split()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A prepared data folder (SentencePiece vocab 320) from a generated corpus."""
    from dmc.data import prepare_data

    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for doc in range(6):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 14))) + "."
                 for _ in range(300)]
        (root / f"doc{doc}.txt").write_text("\n".join(lines))
    out = tmp_path_factory.mktemp("prepared")
    prepare_data([str(root)], out, vocab_size=320, valid_fraction=0.2, quiet=True)
    return out


def text_corpus(folder):
    """Six .txt files of random lines of a few words (a corpus `prepare_data` reads)."""
    folder.mkdir()
    words = random.Random(0)
    for i in range(6):
        text = "\n".join(" ".join(words.choice(["to", "be", "or", "not", "the", "king", "queen",
                                                  "lord", "sweet", "night", "day", "love"])
                                     for _ in range(12)) for _ in range(250))
        (folder / f"doc{i}.txt").write_text(text)
    return folder


def tiny_overrides(data, run_dir, **extra):
    """Dotted overrides for a 2-layer GQA model trained on ``data`` (import with
    ``from conftest import tiny_overrides``)."""
    values = {
        "run_dir": run_dir, "data.path": data, "model.num_layers": 2, "model.hidden_size": 64,
        "model.num_attention_heads": 4, "model.num_query_groups": 2, "model.ffn_hidden_size": 128,
        "model.max_seq_length": 64, "data.seq_length": 32, "data.micro_batch_size": 2,
        "data.global_batch_size": 4, "optim.lr": 3e-3, "logging.eval_iters": 2,
        "logging.progress_bar": False, "dmc.c": 1.0, "dmc.window": 4,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]
