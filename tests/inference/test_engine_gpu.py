"""The engine on a CUDA GPU (Triton kernels): greedy generation equals the eval-mode megatron
model, and a decode step waits for the device once (gpu mark: skipped without CUDA; the CPU
versions are in test_engine.py)."""
import warnings

import pytest
import torch

from dmc.inference import Engine, SamplingParams
from test_engine import build, check_against_model, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_thread")]

@pytest.mark.parametrize("groups,window", [(4, None), (2, 3), (2, 12), (2, "vanilla")])
def test_greedy_generation_on_cuda_equals_eval_model(parallel_1x1, groups, window):
    model, runtime = build(groups, window)
    assert next(model.parameters()).is_cuda
    engine = Engine(model, page_size=4, max_batch=4, chunk_size=5)
    assert engine.device.type == "cuda" and engine.cache.k_pages.is_cuda
    prompt_list = prompts()
    results = engine.generate(prompt_list, SamplingParams(max_new_tokens=32))
    assert all(r.finish_reason == "length" and len(r.tokens) == 32 for r in results)
    if runtime is not None:
        assert min(r.compression.overall for r in results) > 1.5
    check_against_model(model, results, prompt_list, dmc=runtime is not None)
    assert engine.cache.pages_in_use == 0


@pytest.mark.parametrize("window", [3, "vanilla"])
def test_decode_step_waits_for_the_device_once(parallel_1x1, window):
    """A decode step synchronises with the host exactly once: the copy that brings back the
    sampled tokens together with the lengths the deferred DMC writes reached. Decisions, append
    slots and lengths stay on the device, pages are reserved on the host beforehand, host data
    goes to the device without a stream sync."""
    model, _ = build(2, window)
    engine = Engine(model, page_size=4, max_batch=2, chunk_size=16)
    for prompt in prompts((9, 13)):
        engine.add_request(prompt, SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9))
    engine.step()  # prefill and first tokens
    engine.step()  # a first decode step: kernels compiled, pages in place
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchronizing" in str(w.message)]
    assert len(syncs) == 1, syncs
