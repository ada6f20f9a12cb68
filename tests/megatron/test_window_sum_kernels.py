"""The fused Triton kernels of Eq. 9's window-grouped form (:mod:`dmc.megatron.window_sum_kernels`)
against the PyTorch path (:func:`dmc.ops.accumulate.windowed_accumulate`) and float64, forward
and backward; on the CPU through the Triton interpreter (the root conftest sets
``TRITON_INTERPRET=1``), on CUDA under the gpu mark."""
from types import SimpleNamespace

import pytest
import torch

from dmc.megatron.model import build_gpt_model
from dmc.megatron.runtime import DMCConfig, DMCRuntime
from dmc.ops import partial_accumulate
from dmc.ops.accumulate import WindowedSum, WindowWeights, window_weights, windowed_accumulate
from dmc.ops.reference import partial_accumulate_reference

from tiny_models import VOCAB, spread_decisions, tiny_config
from triton_aot import compile_in_subprocess


def strided_inputs(shape, window, dtype, device, seed=0):
    """Keys and values as views of one ``[seq, batch, 2 * heads * dim]`` projection output (the
    layout the DMC attention hands over), decisions and importances, and upstream gradients laid
    out ``[seq, batch, heads, dim]`` in the keys' dtype (what the attention hands back to a
    bf16 model's sums)."""
    batch, heads, seq, dim = shape
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(seq, batch, 2, heads, dim, generator=gen).to(device, dtype)
    k, v = (qkv[:, :, i].permute(1, 2, 0, 3) for i in range(2))
    alpha = torch.rand(batch, heads, seq, generator=gen).to(device)
    omega = (torch.rand(batch, heads, seq, generator=gen) + 0.1).to(device)
    grads = [torch.randn(seq, batch, heads, dim, generator=gen).to(device, dtype)
             .permute(1, 2, 0, 3) for _ in range(2)]
    return k, v, alpha, omega, grads


def compare_with_pytorch(shape, window, dtype, device):
    """Sums and the gradients of keys, values, decisions and importances; and the sums alone
    under the same weights (the gradient of the weights included)."""
    from dmc.megatron.window_sum_kernels import FusedWindowedSum, fused_windowed_accumulate

    k, v, alpha, omega, grads = strided_inputs(shape, window, dtype, device)
    window = min(window, shape[2])
    coeff = WindowWeights.apply(alpha, omega, window).detach()
    runs = {"accumulate": (windowed_accumulate, fused_windowed_accumulate, (k, v, alpha, omega)),
            "sums": (lambda *x: (WindowedSum.apply(x[0], x[2]), WindowedSum.apply(x[1], x[2])),
                     FusedWindowedSum.apply, (k, v, coeff))}
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for run, (pytorch, fused, inputs) in runs.items():
        results = []
        for path in (pytorch, fused):
            leaves = [t.detach().clone().requires_grad_() for t in inputs]
            extra = (window,) if run == "accumulate" else ()
            outputs = path(*leaves, *extra)
            torch.autograd.backward(outputs, grads)
            results.append([o.detach() for o in outputs] + [t.grad for t in leaves])
        for i, (want, got) in enumerate(zip(*results)):
            want = torch.zeros_like(got) if want is None else want  # window 1: alpha unused
            if i < 2:  # the sums: float32 from the PyTorch path, in the input's dtype here
                assert got.dtype == inputs[i].dtype, (run, i)
                want = want.to(got.dtype)
            assert got.dtype == want.dtype and got.shape == want.shape, (run, i)
            torch.testing.assert_close(got, want, **tol, msg=f"{run}: output {i}")


@pytest.mark.parametrize("shape,window", [((2, 3, 37, 16), 12), ((1, 2, 70, 24), 5),
                                          ((1, 1, 9, 8), 1), ((2, 1, 5, 8), 12),
                                          ((1, 1, 50, 128), 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_equal_the_pytorch_path_on_cpu(shape, window, dtype):
    """Sequences shorter and longer than the kernels' blocks (at head_dim 128: 32 positions a
    forward program, 16 a backward one), a head size that is not a power of two, window 1 and a
    window longer than the sequence."""
    compare_with_pytorch(shape, window, dtype, "cpu")


def compare_with_float32_sums(device, exact):
    """The kernels write a bf16 model's sums in bf16 (no float32 output written and read back
    by a cast): the float32 sums of the same inputs rounded, and from bf16 upstream gradients
    the same gradients (the keys' and values' rounded, the weights' float32 ones equal), which
    the cast's backward would have widened exactly. ``exact``: bit for bit (a GPU rounds to
    nearest even, as torch does); else within one bf16 step (the interpreter truncates)."""
    from dmc.megatron.window_sum_kernels import FusedWindowedSum

    k, v, alpha, omega, grads = strided_inputs((2, 3, 37, 16), 12, torch.bfloat16, device)
    coeff = WindowWeights.apply(alpha, omega, 12).detach()
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        leaves = [k.to(dtype, copy=True).requires_grad_(), v.to(dtype, copy=True).requires_grad_(),
                  coeff.clone().requires_grad_()]
        outputs = FusedWindowedSum.apply(*leaves)
        torch.autograd.backward(outputs, [g.to(dtype) for g in grads])
        results.append([o.detach() for o in outputs] + [t.grad for t in leaves])
    for i, (half, full) in enumerate(zip(*results)):
        assert half.dtype == (torch.float32 if i == 4 else torch.bfloat16), i
        if exact or i == 4:
            assert torch.equal(half, full.to(half.dtype)), i
        else:
            assert ((half.float() - full).abs() <= full.abs() * 2 ** -7).all(), i


def test_bf16_sums_are_the_float32_sums_rounded():
    compare_with_float32_sums("cpu", exact=False)


@pytest.mark.gpu
def test_bf16_sums_are_the_float32_sums_rounded_bit_for_bit_on_cuda():
    compare_with_float32_sums("cuda", exact=True)


@pytest.mark.parametrize("hard", [False, True], ids=["soft", "hard"])
@pytest.mark.parametrize("shape,window", [((2, 3, 40), 12), ((1, 2, 300), 12), ((1, 1, 5), 5),
                                          ((1, 2, 50), 4)])
def test_fused_window_weights_equal_float64(shape, window, hard):
    """Eq. 9's weights and both gradients against :func:`window_weights` in float64, with soft
    decisions and with hard ones (exactly 0 or 1: the backward divides by none of them), and
    sequences longer than a program's block of 128 positions."""
    from dmc.megatron.window_sum_kernels import FusedWindowWeights

    gen = torch.Generator().manual_seed(len(shape) + window)
    alpha = torch.rand(*shape, generator=gen, dtype=torch.float64)
    alpha = (alpha > 0.5).double() if hard else alpha
    omega = torch.rand(*shape, generator=gen, dtype=torch.float64) + 0.1
    grad = torch.randn(*shape, window, generator=gen, dtype=torch.float64)
    exact = [alpha.clone().requires_grad_(), omega.clone().requires_grad_()]
    window_weights(*exact, window).backward(grad)
    fast = [alpha.float().requires_grad_(), omega.float().requires_grad_()]
    coeff = FusedWindowWeights.apply(*fast, window)
    coeff.backward(grad.float())
    torch.testing.assert_close(coeff.double(), window_weights(alpha, omega, window),
                               atol=1e-6, rtol=1e-6)
    for got, want in zip(fast, exact):
        scale = want.grad.abs().max()
        torch.testing.assert_close(got.grad.double() / scale, want.grad / scale, atol=1e-6,
                                   rtol=1e-6)


def test_partial_accumulate_takes_the_fused_kernels():
    """Eq. 9 through the kernels equals the float64 reference (the ``windowed`` argument)."""
    from dmc.megatron.window_sum_kernels import fused_windowed_accumulate

    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 1, 2, 40, 8, generator=gen)
    alpha = torch.rand(1, 2, 40, generator=gen)
    omega = torch.rand(1, 2, 40, generator=gen) + 0.1
    got = partial_accumulate(k, v, alpha, omega, 12, windowed=fused_windowed_accumulate)
    want = partial_accumulate_reference(k, v, alpha, omega, 12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("delay", [0, 3], ids=["dmc", "merge_delay"])
def test_a_train_step_through_the_kernels_is_the_pytorch_paths(parallel_1x1, delay):
    """``dmc.accumulate_backend``: a DMC model's train-mode loss and parameter gradients are
    the same with the fused kernels (interpreted on the CPU) as with the PyTorch path."""
    reference = build_gpt_model(tiny_config(2), VOCAB, 64, dmc=DMCRuntime())
    spread_decisions(reference, scale=1.0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=gen)
    positions = torch.arange(24).expand(2, 24)
    results = []
    for backend in ("torch", "triton"):
        runtime = DMCRuntime(DMCConfig(window=4, c=0.0, accumulate_backend=backend,
                                       merge_delay=delay))
        model = build_gpt_model(tiny_config(2), VOCAB, 64, dmc=runtime)
        model.load_state_dict(reference.state_dict())
        runtime.start_step(0, "train", target_cr=2.0)
        loss = model(tokens, positions, None, labels=tokens).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_the_backend_setting_is_checked(monkeypatch):
    """Bad values name the field; not part of the model; "triton" on the CPU needs the
    interpreter; a float64 model takes the PyTorch path ("auto" on CUDA went to the kernels,
    which failed to cast their float32 sums to float64)."""
    from dmc.megatron.accumulate_backend import window_kernels

    with pytest.raises(ValueError, match="accumulate_backend"):
        DMCConfig(accumulate_backend="cuda")
    assert "accumulate_backend" not in DMCConfig(accumulate_backend="torch").to_dict()
    assert window_kernels("auto", torch.zeros(1)) is None
    cuda64 = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float64)  # as keys
    assert window_kernels("auto", cuda64) is None
    with pytest.raises(ValueError, match="'triton' sums in float32 and takes no float64"):
        window_kernels("triton", cuda64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="accumulate_backend: 'triton' on the CPU needs "
                                         "TRITON_INTERPRET=1"):
        window_kernels("triton", torch.zeros(1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_equal_the_pytorch_path_on_cuda(dtype):
    compare_with_pytorch((2, 4, 300, 128), 12, dtype, "cuda")


def test_kernels_compile_for_hopper():
    """The five kernels of the window sums (weights, sums, both backwards, gather) pass Triton's
    compiler for sm_90 down to a cubin: the interpreter accepted a constexpr reassigned in a
    static_range loop that the compiler refuses (found on an H100, 2026-11-27)."""
    done = compile_in_subprocess("window_sums")
    assert done.returncode == 0, done.stderr[-3000:]
    for kernel in ("_weights_kernel", "_forward_kernel", "_backward_kernel",
                   "_weights_backward_kernel", "_gather_kernel"):
        assert f"{kernel}: compiled for sm_90" in done.stdout
