"""The CR-loss plumbing of DMC training (Eq. 10): what each DMC layer's forward adds to the loss.

Per forward, a layer's kept slots ``sum(1 - alpha)`` per sequence are summed over the
tensor-parallel ranks; the layer then applies the hinge itself (App. G's ``local`` prior) or adds
them to the model-wide sum (the paper's ``global`` prior): the first DMC layer of a pipeline stage
starts the stage's sum, the last one adds it to the earlier stages'
(:mod:`dmc.megatron.pipeline_sum`), and the last stage applies the hinge per sequence. The loss
rides on the layer's output through megatron's aux-loss path (``MoEAuxLossAutoScaler``), so it
backpropagates under pipelining; its detached value is kept on the runtime
(:meth:`DMCRuntime.pop_cr_losses`).
"""
from __future__ import annotations

import torch
import torch.distributed.nn as dist_nn
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from dmc.megatron import pipeline_sum
from dmc.ops import compression_loss_from_sums, head_balance_loss, head_cap_loss_from_sums


def attach_cr_loss(layer, output: torch.Tensor, kept_per_head: torch.Tensor,
                   seq: int) -> torch.Tensor:
    """``output`` with the CR loss attached (Eq. 10, the hinge per sequence, plus the per-head
    cap when ``dmc.head_cr_cap`` is set); ``kept_per_head [batch, local_kv_heads]`` is
    ``layer``'s differentiable kept-slot count per sequence and head, ``seq`` its tokens."""
    runtime, config = layer.dmc, layer.config
    if runtime.config.head_cr_cap is not None:
        output = _attach_head_cap(layer, output, kept_per_head, seq)
    kept = kept_per_head.sum(dim=1)
    if layer.world_size > 1:
        kept = reduce_from_tensor_model_parallel_region(kept, group=layer.tp_group)
    per_layer = seq * config.num_query_groups
    if runtime.config.prior == "local":
        loss = compression_loss_from_sums(kept, per_layer, runtime.target_cr,
                                          num_groups=config.num_layers)
        return _attach(runtime, output, loss)
    return _attach_global(layer, output, kept, per_layer * config.num_layers)


def _attach_global(layer, output, kept, model_count):
    """The paper's global prior: one hinge per sequence over every layer and KV head of the
    model. The first DMC layer of the stage starts the stage's ``[batch]`` sum, the last one
    adds it to the sum of the earlier pipeline stages; the last stage applies the hinge, earlier
    stages pass their running sum on."""
    runtime = layer.dmc
    if layer is runtime.layers[0]:
        runtime.stage_kept.clear()
    runtime.stage_kept.append(kept)
    if layer is not runtime.layers[-1]:
        return output
    stage_kept = torch.stack(runtime.stage_kept).sum(dim=0)
    runtime.stage_kept.clear()
    total_kept = pipeline_sum.running_sum(stage_kept)
    if not parallel_state.is_pipeline_last_stage():
        return pipeline_sum.pass_on(output, total_kept)
    return _attach(runtime, output,
                   compression_loss_from_sums(total_kept, model_count, runtime.target_cr))


def _attach_head_cap(layer, output, kept_per_head, seq):
    """The per-head cap's share of this layer's local heads; summed over the tensor-parallel
    ranks (each rank's gradient reaches its own heads) so the logged value is the layer's."""
    config = layer.config
    loss = head_cap_loss_from_sums(kept_per_head, seq, layer.dmc.config.head_cr_cap,
                                   config.num_layers * config.num_query_groups)
    if layer.world_size > 1:
        loss = reduce_from_tensor_model_parallel_region(loss, group=layer.tp_group)
    return _attach(layer.dmc, output, loss)


def attach_head_balance_loss(layer, output: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """``output`` with DMC-C's balance term attached (App. E, Eq. 13, the mean over heads:
    :func:`dmc.ops.head_balance_loss`) times ``dmc.head_balance_weight``; ``alpha [batch,
    local_kv_heads, seq]`` is the decisions the CR loss sees. Under tensor parallelism the
    heads' mean is summed over the ranks forward and backward (each rank's term depends on
    every rank's heads through it), and the term over the ranks' own heads, forward only."""
    config = layer.config
    head_sum = alpha.sum(dim=1)  # [batch, seq]
    if layer.world_size > 1:
        head_sum = dist_nn.all_reduce(head_sum, group=layer.tp_group)
    loss = head_balance_loss(alpha, head_sum / config.num_query_groups,
                             config.num_layers * config.num_query_groups)
    if layer.world_size > 1:
        loss = reduce_from_tensor_model_parallel_region(loss, group=layer.tp_group)
    return _attach(layer.dmc, output, loss * layer.dmc.config.head_balance_weight)


def _attach(runtime, output, loss):
    """Logs the Eq. 10 value; backpropagates it times ``runtime.cr_loss_weight``."""
    runtime.cr_losses.append(loss.detach())
    return MoEAuxLossAutoScaler.apply(output, loss * runtime.cr_loss_weight)
