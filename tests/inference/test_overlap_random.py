"""Random serving scenarios (slow): the engine with overlapped decode steps against the engine
without, the block tables' and lengths' device copies kept apart as on a GPU. Each scenario
draws a model kind, requests (prompt lengths, budgets, greedy or sampled, top-k, stop tokens),
the batch size, the prefill chunk and a pool that may run out; every request must end with the
same tokens, reason, compression and pages, and every page must come back."""
import random

import pytest
import torch

from dmc.inference import Engine, SamplingParams
from test_delayed_engine import build_delayed
from test_dms_engine import build_dms
from test_engine import build, prompts
from test_overlap import keep_device_copies_apart

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

KINDS = {"mha": lambda: build(4, "vanilla")[0], "gqa": lambda: build(2, "vanilla")[0],
         "dmc": lambda: build(2, 3)[0], "exact": lambda: build(4, None)[0],
         "dms": lambda: build_dms(2, 4), "merge_delay": lambda: build_delayed(2, 4)}


def scenario(seed: int):
    """A model kind, prompts, sampling settings and engine options drawn from ``seed``."""
    rng = random.Random(seed)
    kind = rng.choice(sorted(KINDS))
    count = rng.randint(2, 8)
    prompt_list = prompts([rng.randint(1, 40) for _ in range(count)], seed=seed)
    params = []
    for _ in range(count):
        param = SamplingParams(max_new_tokens=rng.randint(1, 30),
                               temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([0, 0, 5]))
        if rng.random() < 0.4:
            param.stop_tokens = [rng.randrange(64)]
        params.append(param)
    groups = 4 if kind in ("mha", "exact") else 2
    options = dict(page_size=4, max_batch=rng.randint(1, 5), chunk_size=rng.choice([3, 5, 16]),
                   num_pages=rng.choice([None, 40 * groups, 80 * groups]), cuda_graphs=True)
    return kind, prompt_list, params, options


@pytest.mark.parametrize("block", range(4))
def test_random_scenarios_end_as_without_overlap(parallel_1x1, monkeypatch, block):
    keep_device_copies_apart(monkeypatch)
    models = {}
    for seed in range(block * 25, block * 25 + 25):
        kind, prompt_list, params, options = scenario(seed)
        model = models.setdefault(kind, KINDS[kind]())
        runs = []
        for overlap in (False, True):
            engine = Engine(model, overlap=overlap, **options)
            runs.append(engine.generate(prompt_list, params))
            allocator = engine.cache.allocator
            assert engine.cache.pages_in_use == 0, (seed, kind, overlap)
            assert torch.equal(allocator.device_tables, allocator.tables), (seed, kind)
            assert torch.equal(allocator.device_lengths, allocator.lengths), (seed, kind)
        for plain, overlapped in zip(*runs):
            assert plain.tokens == overlapped.tokens, (seed, kind, options)
            assert plain.finish_reason == overlapped.finish_reason, (seed, kind)
            assert torch.equal(plain.compression.slots, overlapped.compression.slots), (seed, kind)
            assert plain.kv_pages == overlapped.kv_pages, (seed, kind)
