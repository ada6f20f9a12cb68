"""The engine on a CUDA GPU (Triton kernels): greedy generation equals the eval-mode megatron
model, and a decode step checked for host synchronisations (gpu mark: skipped without CUDA; the
CPU versions are in test_engine.py)."""
import pytest
import torch

from dmc.inference import Engine, SamplingParams
from test_engine import build, check_against_model, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_thread")]

HOST_SYNCS = (
    "the decode step synchronises with the host today: Engine._run times each forward between "
    "torch.cuda.synchronize calls; ModelRunner.forward copies token ids, positions and picked "
    "rows from host lists (torch.tensor(..., device=cuda)) and the decode positions back "
    "(decode_positions.cpu()) for the policy; PagedKVCache.write copies the DMC decisions to "
    "the host (alpha.cpu()) to allocate pages; BlockAllocator.publish copies the host block "
    "tables and lengths to the device after each allocation; sampling (dmc/inference/sampling.py) "
    "reads the chosen tokens and their log-probs back with .tolist()"
)


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


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason=HOST_SYNCS)
@pytest.mark.parametrize("window", [3, "vanilla"])
def test_decode_step_has_no_host_sync(parallel_1x1, window):
    model, _ = build(2, window)
    engine = Engine(model, page_size=4, max_batch=2, chunk_size=16)
    for prompt in prompts((9, 13)):
        engine.add_request(prompt, SamplingParams(max_new_tokens=8))
    engine.step()  # prefill and first tokens
    engine.step()  # a first decode step: kernels compiled, pages in place
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
