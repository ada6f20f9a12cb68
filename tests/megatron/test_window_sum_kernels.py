"""The fused Triton window sums (:mod:`dmc.megatron.window_sum_kernels`) against the PyTorch
path (:func:`dmc.ops.accumulate.windowed_sums`), forward and backward; on the CPU through the
Triton interpreter (the root conftest sets ``TRITON_INTERPRET=1``), on CUDA under the gpu mark."""
import pytest
import torch

from dmc.ops import partial_accumulate
from dmc.ops.accumulate import WindowWeights, windowed_sums
from dmc.ops.reference import partial_accumulate_reference


def strided_inputs(shape, window, dtype, device, seed=0):
    """Keys and values as views of one ``[seq, batch, 2 * heads * dim]`` projection output (the
    layout the DMC attention hands over), float32 window weights, and upstream gradients laid
    out ``[seq, batch, heads, dim]``."""
    batch, heads, seq, dim = shape
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(seq, batch, 2, heads, dim, generator=gen).to(device, dtype)
    k, v = (qkv[:, :, i].permute(1, 2, 0, 3) for i in range(2))
    alpha = torch.rand(batch, heads, seq, generator=gen).to(device)
    omega = (torch.rand(batch, heads, seq, generator=gen) + 0.1).to(device)
    coeff = WindowWeights.apply(alpha, omega, min(window, seq))
    grads = [torch.randn(seq, batch, heads, dim, generator=gen).to(device).permute(1, 2, 0, 3)
             for _ in range(2)]
    return k, v, coeff, grads


def compare_with_pytorch(shape, window, dtype, device):
    from dmc.megatron.window_sum_kernels import fused_windowed_sums

    k, v, coeff, grads = strided_inputs(shape, window, dtype, device)
    results = []
    for sums in (windowed_sums, fused_windowed_sums):
        leaves = [t.detach().clone().requires_grad_() for t in (k, v, coeff)]
        outputs = sums(*leaves)
        torch.autograd.backward(outputs, grads)
        results.append([o.detach() for o in outputs] + [t.grad for t in leaves])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for name, want, got in zip(("k_sum", "v_sum", "grad_k", "grad_v", "grad_coeff"), *results):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        torch.testing.assert_close(got, want, **tol, msg=name)


@pytest.mark.parametrize("shape,window", [((2, 3, 37, 16), 12), ((1, 2, 70, 24), 5),
                                          ((1, 1, 9, 8), 1), ((2, 1, 5, 8), 12),
                                          ((1, 1, 50, 128), 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_sums_equal_the_pytorch_path_on_cpu(shape, window, dtype):
    """Sequences shorter and longer than the kernel's blocks (at head_dim 128: 32 positions a
    forward program, 16 a backward one), a head size that is not a power of two, window 1 and a
    window longer than the sequence."""
    compare_with_pytorch(shape, window, dtype, "cpu")


def test_partial_accumulate_takes_the_fused_sums():
    """Eq. 9 through the kernel equals the float64 reference (the ``sums`` argument)."""
    from dmc.megatron.window_sum_kernels import fused_windowed_sums

    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 1, 2, 40, 8, generator=gen)
    alpha = torch.rand(1, 2, 40, generator=gen)
    omega = torch.rand(1, 2, 40, generator=gen) + 0.1
    got = partial_accumulate(k, v, alpha, omega, 12, sums=fused_windowed_sums)
    want = partial_accumulate_reference(k, v, alpha, omega, 12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_sums_equal_the_pytorch_path_on_cuda(dtype):
    compare_with_pytorch((2, 4, 300, 128), 12, dtype, "cuda")
