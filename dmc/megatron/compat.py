"""What megatron-core 0.16 needs to run on a machine without CUDA (gloo; fp32, or bf16 autocast).

Applied only when CUDA is absent (:func:`apply_cpu_compat` is a no-op otherwise):
- ``torch.cuda.current_device()`` yields the CPU device (RoPE moves ``inv_freq`` there);
- ``torch.cuda.synchronize()`` is a no-op (the checkpoint writer calls it);
- a :class:`torch.overrides.TorchFunctionMode` rewrites ``device="cuda"`` literals found in
  megatron's default causal mask, pipeline schedules and optimizers to the CPU, and
  ``Tensor.cuda()`` (tied embeddings under pipeline parallelism) to the tensor itself;
- :class:`CPURNGStatesTracker` replaces megatron's CUDA RNG tracker
  (``model_parallel_cuda_manual_seed`` calls ``torch.cuda.get_rng_state``);
- ``clip_grad_by_total_norm_fp32`` (it asserts CUDA tensors) is replaced by
  :func:`clip_grads_by_total_norm`, so the optimizer's gradient clipping works on the CPU;
- for ``precision: bf16`` on a CPU (``torch.autocast("cpu")`` over float32 parameters):
  megatron's linear autograd function restores CPU autocast in its backward, and the residual
  stream stays float32 (:func:`_float32_residual_under_autocast`).
The transformer config must also turn the CUDA-only fusions off: :data:`CPU_CONFIG_OVERRIDES`.

The mode intercepts every torch call (about 1,300 per DMC decode step); code that never meets a
``device="cuda"`` literal (the serving engine's step) runs under :func:`cuda_rewrite_suspended`.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
from torch.overrides import TorchFunctionMode

CPU_CONFIG_OVERRIDES = {
    "use_cpu_initialization": True,
    "masked_softmax_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "persist_layer_norm": False,
}

_STATE = {"applied": False, "mode": None}


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites every ``device=cuda...`` keyword argument of a torch call to ``cpu``, and makes
    ``Tensor.cuda()`` return the tensor (megatron moves the tied output weight of a pipeline's
    last stage with it before the embedding all-reduce)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        kwargs = kwargs or {}
        if _is_cuda_device(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


class CPURNGStatesTracker:
    """Named CPU generator states with megatron's tracker interface (add, fork, get/set)."""

    def __init__(self, **_):
        self.reset()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name, seed):
        if seed in self.seeds_:
            raise ValueError(f"CPURNGStatesTracker: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"CPURNGStatesTracker: rng state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"CPURNGStatesTracker: rng state {name!r} was never added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def clip_grads_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Scales every gradient by ``max_norm / total_norm`` when that is below 1 (in place)."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    for param in parameters:
        grad = getattr(param, attr, None)
        if grad is not None:
            grad.detach().mul_(clip_coeff)


def _autocast_linear_on_cpu() -> None:
    """Megatron's linear layer is an autograd function whose forward and backward restore CUDA's
    autocast state only; on the CPU its backward would multiply a bfloat16 gradient by a
    float32 weight. Redecorated for CPU autocast, the backward runs in the forward's dtype."""
    from megatron.core.tensor_parallel import layers

    linear = layers.LinearWithGradAccumulationAndAsyncCommunication
    linear.forward = staticmethod(
        torch.amp.custom_fwd(inspect.unwrap(linear.forward), device_type="cpu"))
    linear.backward = staticmethod(
        torch.amp.custom_bwd(inspect.unwrap(linear.backward), device_type="cpu"))


def _float32_residual_under_autocast() -> None:
    """Megatron casts the residual stream to the dtype of the branch added to it (so that
    pipeline stages exchange bf16 tensors under CUDA's AMP); under CPU autocast that would
    carry the whole residual stream in bfloat16. Here the branch takes the residual's dtype
    instead: float32 parameters keep a float32 residual stream, the matmuls stay bfloat16
    (autocast's O1 split; a no-op when both are float32)."""
    from megatron.core.fusions import fused_bias_dropout

    add = fused_bias_dropout._bias_dropout_add_func

    def add_in_residual_dtype(x_with_bias, residual, prob, training):
        x, bias = x_with_bias
        if x.dtype != residual.dtype:
            x_with_bias = (x.to(residual.dtype), None if bias is None else bias.to(residual.dtype))
        return add(x_with_bias, residual, prob, training)

    fused_bias_dropout._bias_dropout_add_func = add_in_residual_dtype


def apply_cpu_compat() -> None:
    """Patches torch/megatron for CPU use; idempotent; does nothing when CUDA is available."""
    if cuda_available() or _STATE["applied"]:
        return
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grads_by_total_norm
    optimizer.clip_grad_by_total_norm_fp32 = clip_grads_by_total_norm
    _autocast_linear_on_cpu()
    _float32_residual_under_autocast()
    mode = CudaToCpuMode()
    mode.__enter__()
    _STATE.update(applied=True, mode=mode)


@contextlib.contextmanager
def cuda_rewrite_suspended():
    """Leaves the ``device="cuda"`` rewriting mode for the duration of the block (when it is
    the innermost torch function mode; any other mode pushed on top of it stays untouched)."""
    mode = _STATE["mode"]
    stack = torch._C._len_torch_function_stack()
    if mode is None or not stack or torch._C._get_function_stack_at(stack - 1) is not mode:
        yield
        return
    mode.__exit__(None, None, None)
    try:
        yield
    finally:
        mode.__enter__()


def model_parallel_manual_seed(seed: int) -> None:
    """``model_parallel_cuda_manual_seed`` on GPU; on CPU the same three named states
    (data-parallel, tensor-model-parallel = seed + 2718 + tp_rank, expert) in a CPU tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(seed)
    if cuda_available():
        mrandom.model_parallel_cuda_manual_seed(seed)
        return
    tracker = CPURNGStatesTracker()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
