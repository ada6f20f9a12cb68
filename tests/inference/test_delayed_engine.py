"""The engine under DMC with delayed merging (``dmc.merge_delay``) against the megatron model's
eval-mode forward (dense delayed attention over accumulated and raw keys, itself checked against
a float64 loop over Algorithm 1 in tests/ops/test_delayed_merge.py): greedy generation of
batched requests (chunked prefill across the ring's edge, then decode), slots (Algorithm 1's over
the tokens that left the ring, plus the ring), preemption, the byte budget, and the cache's
accounting."""
import dataclasses

import pytest
import torch

from dmc.inference import Engine, SamplingParams
from dmc.inference.delayed_cache import DelayedMergeCache, delayed_ring_bytes
from dmc.inference.allocation import cache_allocation
from test_engine import (CACHE_SHAPE, build, check_against_model, check_preemption,
                         prompts)

pytestmark = pytest.mark.usefixtures("one_thread")


def build_delayed(groups, delay, window=3, c=-1.0, seed=0):
    """A tiny DMC model (eval mode, decisions that merge long runs) with ``merge_delay``."""
    model, runtime = build(groups, window, c, seed=seed)
    runtime.config = dataclasses.replace(runtime.config, merge_delay=delay)
    return model


@pytest.mark.parametrize("groups,delay,window", [(4, 3, 3), (2, 8, 3), (2, 4, None)])
def test_greedy_generation_equals_the_eval_mode_forward(parallel_1x1, groups, delay, window):
    check_greedy(build_delayed(groups, delay, window), delay)


def test_greedy_generation_with_the_triton_kernels(parallel_1x1):
    """``use_triton=True`` (the interpreter on the CPU): the Triton paged kernel with the raw
    ring folded into its reduce step and the Triton write, CUDA's default path."""
    check_greedy(build_delayed(2, 8, 3), 8, use_triton=True, new_tokens=14)


@pytest.mark.gpu
def test_greedy_generation_on_cuda_equals_the_eval_mode_forward(parallel_1x1):
    """The same on CUDA: the ring's writes, the leaving token's Algorithm 1 write and the ring
    attention on the device."""
    model = build_delayed(2, 5)
    assert next(model.parameters()).is_cuda
    check_greedy(model, 5)


def check_greedy(model, delay, use_triton=None, new_tokens=24):
    """Greedy generation of three batched requests (chunked prefill across the ring's edge,
    ``new_tokens`` each) gives the eval-mode forward's tokens, logprobs and slots."""
    prompt_list = prompts((13, 21, 7))
    engine = Engine(model, page_size=4, max_batch=3, chunk_size=5, use_triton=use_triton)
    assert isinstance(engine.cache, DelayedMergeCache) and engine.cache.ring_size == delay + 1
    results = engine.generate(prompt_list, SamplingParams(max_new_tokens=new_tokens))
    check_against_model(model, results, prompt_list, dmc=True, delay=delay)
    assert min(r.compression.overall for r in results) > 1.3, "decisions should merge"
    assert engine.cache.pages_in_use == 0 and not engine.has_unfinished()


def test_out_of_pages_preempts_and_restarts_with_the_same_output(parallel_1x1):
    check_preemption(build_delayed(2, 3), "auto", prompts((10, 12, 9)), 20)


def test_the_byte_budget_and_the_accounting_hold_the_rings(parallel_1x1):
    """kv_cache_bytes covers everything the cache allocates, the rings of every sequence slot
    among it (raw tokens, and the merge ring of window 3); a sequence's bytes are its pages,
    their metadata, the merge state and the ring, as allocated."""
    model = build_delayed(2, 3)
    merge = 3 * (2 * 16 * 4 + 4) + 4  # window 3: float32 keys, values, omegas; the count
    rings = 3 * 2 * 2 * (delayed_ring_bytes(3, 16, 4) + merge)  # max_batch x layers x kv heads
    budget = cache_allocation(num_pages=10, max_seqs=3, window=3, merge_delay=3,
                              **CACHE_SHAPE)["total"]
    assert Engine(model, max_batch=3, kv_cache_bytes=budget - 1).cache.num_pages == 9
    engine = Engine(model, max_batch=3, kv_cache_bytes=budget)
    cache = engine.cache
    assert cache.num_pages == 10
    ring_tensors = (cache.ring_k, cache.ring_v, cache.ring_alpha, cache.ring_omega,
                    cache.open_k, cache.open_v, cache.open_omega, cache.open_count)
    assert sum(t.numel() * t.element_size() for t in ring_tensors) == rings
    engine.add_request(prompts((30,))[0], SamplingParams(max_new_tokens=5))
    engine.step()
    seq = engine.scheduler.running[0]
    held = cache.sequence_bytes(seq.slot)
    assert held["dmc_state"] == sum(t[seq.slot].numel() * t.element_size() for t in ring_tensors)
    assert held["kv"] == cache.pages_in_use * cache.page_bytes
