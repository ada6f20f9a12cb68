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
