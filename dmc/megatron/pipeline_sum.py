"""A differentiable running sum of one small vector across pipeline stages.

The CR loss (Eq. 10, global prior) puts its hinge on each sequence's kept-slot count over the
*whole* model. Under pipeline parallelism each stage only sees its own layers, so stage s adds its
``[batch]`` counts to the running sums received from stage s-1 and passes the result on; the last
stage applies the per-sequence hinge. Backward runs the chain in reverse: the last stage sends
d loss / d sums back, and each earlier stage receives them in the backward of its output. The
gradient is then exactly that of the single-stage loss, whether or not the stages agree on the
side of each sequence's hinge.

The vectors travel over a separate gloo group per pipeline group (CPU tensors), so they never
interleave with megatron's activation send/recv. Order of events for micro-batch m (1F1B or
not): stage s sends its sum in forward(m) before its activations leave, and stage s+1 receives
it in forward(m) after its activations arrived; gradients go back the same way in backward(m).
Interleaved (virtual) pipeline stages are not supported.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

_STATE = {"group": None, "ranks": None, "pending": []}


def init_pipeline_scalar_groups() -> None:
    """Creates one gloo group per pipeline-parallel group (collective over the world; call it
    after megatron's groups exist, on every rank)."""
    _STATE.update(group=None, ranks=None, pending=[])
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    mine = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for ranks in sorted({tuple(r) for r in everyone}):
        group = dist.new_group(list(ranks), backend="gloo")
        if dist.get_rank() in ranks:
            _STATE.update(group=group, ranks=list(ranks))


def _peer(offset: int) -> int:
    ranks = _STATE["ranks"]
    if ranks is None:
        raise RuntimeError("pipeline_sum: call init_pipeline_scalar_groups() first")
    return ranks[parallel_state.get_pipeline_model_parallel_rank() + offset]


def _isend(value: torch.Tensor, peer: int) -> None:
    buffer = value.detach().double().cpu().reshape(-1)
    _STATE["pending"] = [w for w in _STATE["pending"] if not w[0].is_completed()]
    _STATE["pending"].append((dist.isend(buffer, peer, group=_STATE["group"]), buffer))


def _recv(peer: int, like: torch.Tensor) -> torch.Tensor:
    """Receives a tensor of ``like``'s shape (both stages know it: the micro-batch size)."""
    buffer = torch.zeros(like.numel(), dtype=torch.float64)
    dist.recv(buffer, peer, group=_STATE["group"])
    return buffer.to(device=like.device, dtype=like.dtype).reshape(like.shape)


class _SendOn(torch.autograd.Function):
    """Identity on ``output``; sends ``total`` to the next stage and, in backward, receives
    d loss / d total from it."""

    @staticmethod
    def forward(ctx, output, total):
        ctx.like = total.detach()
        _isend(total, _peer(+1))
        return output

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, _recv(_peer(+1), ctx.like)


def running_sum(local: torch.Tensor) -> torch.Tensor:
    """Sum of ``local`` over this stage and the earlier ones (differentiable; on the first
    stage, ``local`` itself)."""
    if _STATE["group"] is None or parallel_state.is_pipeline_first_stage():
        return local
    prefix = _recv(_peer(-1), local).requires_grad_(True)
    prefix.register_hook(lambda grad: _isend(grad, _peer(-1)))
    return prefix + local


def pass_on(output: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """On a stage before the last: ``output`` unchanged, with ``total`` sent to the next stage
    and its gradient brought back when ``output`` is back-propagated."""
    return _SendOn.apply(output, total)
