"""The torch ops a decode step issues: per layer, a fixed number that grows with neither the
batch nor the cached length (each op is a kernel launch on a GPU, where launches rather than bytes
bound the step of a small model; and a CUDA graph needs a step whose work is fixed).

Counted with ``torch.profiler`` on tiny CPU models: the top-level ``aten`` ops of a steady decode
step that compute something (views, shape queries and allocations left out), for models of 2 and 3
layers; the difference is what one layer costs, the rest what the step costs once (sampling, the
page reservation and its settling)."""
import pytest
import torch

from dmc.inference import Engine, SamplingParams
from dmc.megatron.model import build_gpt_model, llama_transformer_config
from dmc.megatron.runtime import DMCConfig, DMCRuntime
from tiny_models import VOCAB, spread_decisions

pytestmark = pytest.mark.usefixtures("one_thread")

NOT_COMPUTING = {
    "view", "reshape", "_reshape_alias", "_unsafe_view", "as_strided", "select", "slice",
    "unsqueeze", "squeeze", "expand", "expand_as", "permute", "transpose", "t", "alias", "detach",
    "lift_fresh", "split", "split_with_sizes", "chunk", "unbind", "narrow", "view_as", "flatten",
    "unflatten", "contiguous", "numel", "size", "dim", "stride", "item", "_local_scalar_dense",
    "is_nonzero", "result_type", "to", "empty", "empty_like", "empty_strided",
}
# measured 2026-11-27 (ops per layer, the CPU's PyTorch path): vanilla 27, DMC 49, DMS 48 (46
# and 46 before zero_decision_channel became a product with a mask: its ones, zero_ and mul
# against the cat's two ops, for one pass over the tensor and its gradient in training);
# 2026-11-26: vanilla 27, DMC 42, DMS 46 (DMS 65 on 2026-11-24, when reserving a step's pages
# ran its ops only if some head needed a page, which in these steps the 3-layer DMS model did
# and the 2-layer one did not); 63, 55, 83 before the layers of a step shared its RoPE tables,
# validated sequence rows and vanilla's page reservation. (On CUDA the DMC and DMS layers
# rotate and decide in one Triton launch instead.)
OPS_PER_LAYER = {"vanilla": 30, "dmc": 52, "dms": 70}


def build(kind: str, layers: int):
    torch.manual_seed(0)
    config = llama_transformer_config(layers, 64, 4, 96, num_query_groups=2)
    if kind == "vanilla":
        return build_gpt_model(config, VOCAB, 128)
    runtime = DMCRuntime(DMCConfig(window=3, c=-1.0) if kind == "dmc"
                         else DMCConfig(method="dms", dms_window=4, c=0.0))
    model = build_gpt_model(config, VOCAB, 128, dmc=runtime)
    if kind == "dmc":
        spread_decisions(model)
    runtime.set_mode("eval")
    return model


def ops_per_step(kind: str, layers: int, batch: int, warm_steps: int = 4) -> int:
    """Computing top-level aten ops of a steady decode step: every one of 3 steps issues the
    same (pages of 64 slots: no head crosses a page boundary in these steps)."""
    engine = Engine(build(kind, layers), page_size=64, max_batch=batch, chunk_size=16)
    generator = torch.Generator().manual_seed(1)
    for n in range(batch):
        prompt = torch.randint(0, VOCAB, (5 + 3 * n,), generator=generator).tolist()
        engine.add_request(prompt, SamplingParams(max_new_tokens=40, temperature=0.7))
    while engine.stats.decode_steps < warm_steps:
        engine.step()
    counts = []
    for _ in range(3):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.step()
        counts.append(sum(1 for event in prof.events() if computes(event)))
    assert len(set(counts)) == 1, counts
    return counts[0]


def computes(event) -> bool:
    """A top-level aten op (not called by another) that computes something."""
    parent = event.cpu_parent
    top = parent is None or not parent.name.startswith("aten::")
    return event.name.startswith("aten::") and top and event.name[6:] not in NOT_COMPUTING


@pytest.mark.parametrize("kind", sorted(OPS_PER_LAYER))
def test_a_decode_layer_issues_a_fixed_number_of_ops(parallel_1x1, kind):
    two, three = ops_per_step(kind, 2, batch=2), ops_per_step(kind, 3, batch=2)
    assert 10 <= three - two <= OPS_PER_LAYER[kind], (two, three)
    # neither a longer cache (later steps) nor a larger batch adds ops: no loop over sequences,
    # heads or pages in the step
    assert ops_per_step(kind, 2, batch=2, warm_steps=24) == two
    assert ops_per_step(kind, 2, batch=4) == two
