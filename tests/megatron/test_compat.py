"""The CPU compat layer's ``device="cuda"`` rewriting mode and its suspension while serving."""
import pytest
import torch
from torch.overrides import TorchFunctionMode

from dmc.megatron import compat


class CountingMode(TorchFunctionMode):
    """Counts the torch calls it sees."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def rewriting(monkeypatch):
    """The rewriting mode pushed as :func:`compat.apply_cpu_compat` pushes it (popped after)."""
    if torch.cuda.is_available():
        pytest.skip("the rewriting mode exists only without CUDA")
    mode = compat._STATE["mode"]
    pushed = mode is None
    if pushed:
        mode = compat.CudaToCpuMode()
        mode.__enter__()
        monkeypatch.setitem(compat._STATE, "mode", mode)
    yield mode
    if pushed:
        mode.__exit__(None, None, None)


def test_suspended_inside_the_block_and_back_after(rewriting):
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    with compat.cuda_rewrite_suspended():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(2, device="cuda")  # the literal reaches torch: no CUDA here
    assert torch.zeros(2, device="cuda").device.type == "cpu"


def test_a_mode_pushed_on_top_is_left_alone(rewriting):
    with CountingMode() as counting:
        with compat.cuda_rewrite_suspended():
            torch.ones(3).sum()
            assert torch.zeros(1, device="cuda").device.type == "cpu"  # not suspended
        assert counting.calls >= 3
    assert torch.zeros(2, device="cuda").device.type == "cpu"


def test_cpu_autocast_keeps_a_float32_residual_stream(parallel_1x1):
    """Under CPU bf16 autocast over float32 parameters: the linear layers compute in bfloat16
    (forward and backward), the residual stream's norms read it in float32, gradients reach every
    parameter in float32."""
    if torch.cuda.is_available():
        pytest.skip("the CPU patches apply only without CUDA")
    from dmc.megatron.model import build_gpt_model, llama_transformer_config
    from dmc.megatron.runtime import DMCConfig, DMCRuntime

    runtime = DMCRuntime(DMCConfig())
    model = build_gpt_model(llama_transformer_config(2, 64, 4, 128, num_query_groups=2), 96, 32,
                            dmc=runtime)
    runtime.set_mode("vanilla")
    seen = {}

    def record(name):
        def hook(_, inputs, out):
            out = out[0] if isinstance(out, tuple) else out  # linear layers: (output, bias)
            seen[name] = (inputs[0].dtype, out.dtype)
        return hook

    for name, module in model.named_modules():
        if name.endswith(("input_layernorm", "pre_mlp_layernorm", "final_layernorm",
                          "linear_fc2")):
            module.register_forward_hook(record(name))
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, torch.arange(16)[None], None, labels=tokens).float().mean()
    loss.backward()
    norms = {n: dtypes for n, dtypes in seen.items() if n.endswith("layernorm")}
    assert len(norms) == 5 and set(norms.values()) == {(torch.float32, torch.float32)}
    fc2 = [dtypes for n, dtypes in seen.items() if n.endswith("linear_fc2")]
    assert len(fc2) == 2 and set(fc2) == {(torch.bfloat16, torch.bfloat16)}
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
