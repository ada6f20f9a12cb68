"""One tiny DMC training step under a given TP/PP layout, for each CR prior (global, local); run
by test_distributed.py through torchrun (gloo). Writes, per prior, the LM loss, the CR loss, the
kept slots per head and per sequence, and full gradients keyed by global parameter name to
``--out`` (rank 0 gathers); the same for a DMS model (``dmc.method: dms``) under ``"dms"`` and,
global prior only, for DMS adapter decisions (``dms_decision: adapter``) under
``"dms_adapter"``."""
from __future__ import annotations

import argparse
import dataclasses
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler  # noqa: E402

from dmc.megatron.attention import dmc_layers  # noqa: E402
from dmc.megatron.model import build_gpt_model, llama_transformer_config  # noqa: E402
from dmc.megatron.parallel import destroy_parallel, initialize_parallel  # noqa: E402
from dmc.megatron.runtime import DMCConfig, DMCRuntime  # noqa: E402
from dmc.ops import PRIORS  # noqa: E402

LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ, MBS, MICRO = 2, 64, 4, 2, 96, 128, 24, 2, 2
TARGET_CR = 2.125  # between the kept fractions of micro-batch 1's two sequences (0.45, 0.48)
# DMS: soft decisions (logits ~ +-1 / tau) that keep about half of the slots, window 4 of 24
DMS_CONFIG = DMCConfig(method="dms", dms_window=4, c=0.0, dms_logit_scale=2.5, tau=0.5)
DMS_TARGET_CR = 4.0
# DMS adapter decisions (decision_proj, column-parallel over KV heads): logits ~ +-1 / tau too
DMS_ADAPTER_CONFIG = dataclasses.replace(DMS_CONFIG, dms_decision="adapter", dms_logit_scale=1.0)
HEAD_BALANCE_WEIGHT = 0.5  # DMC-C's Eq. 13: each head's term depends on the other rank's heads
HEAD_CR_CAP = 2.2  # below the CR of some heads (kept fractions vary around 0.45)


def column_shards(name):
    return any(s in name for s in ("linear_qkv", "linear_fc1", "output_layer", "word_embeddings",
                                   "decision_proj"))


def gather_full(name, tensor, tp_group):
    """Reassembles a TP-sharded tensor into its TP=1 layout."""
    world = dist.get_world_size(tp_group)
    if world == 1 or tensor.dim() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=tp_group)
    if "linear_fc1" in name:  # each shard is [gate_r; up_r]
        gates, ups = zip(*(p.chunk(2, dim=0) for p in parts))
        return torch.cat(list(gates) + list(ups), dim=0)
    return torch.cat(parts, dim=0 if column_shards(name) else 1)


def shard_of_full(name, full, tp_rank, tp_world):
    """This rank's TP shard of a TP=1 tensor (inverse of :func:`gather_full`)."""
    if tp_world == 1 or full.dim() == 1:
        return full
    if "linear_fc1" in name:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_world)[tp_rank], up.chunk(tp_world)[tp_rank]])
    return full.chunk(tp_world, dim=0 if column_shards(name) else 1)[tp_rank]


def init_by_global_name(model):
    """Weights that depend on the global parameter name only, so every TP/PP layout starts
    from the same model (megatron's own init draws layers in stage order)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_world = parallel_state.get_tensor_model_parallel_world_size()
    for name, param in model.named_parameters():
        full_shape = list(param.shape)
        if tp_world > 1 and param.dim() > 1:
            full_shape[0 if column_shards(name) else 1] *= tp_world
        gen = torch.Generator().manual_seed(sum(map(ord, global_name(name))) * 7919)
        full = torch.randn(full_shape, generator=gen)
        full = 1 + 0.1 * full if param.dim() == 1 else 0.05 * full
        with torch.no_grad():
            param.copy_(shard_of_full(name, full, tp_rank, tp_world))


def global_name(name):
    layers_per_stage = LAYERS // parallel_state.get_pipeline_model_parallel_world_size()
    offset = parallel_state.get_pipeline_model_parallel_rank() * layers_per_stage
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def run_step(model, runtime, prior, head_cr_cap=None, head_balance_weight=0.0):
    """One training step (MICRO micro-batches) under ``prior`` (and the per-head CR cap, DMC-C's
    balance term);
    returns the LM loss, the CR loss, the kept slots per (layer, KV head) and per (micro-batch,
    sequence), and full gradients."""
    runtime.config = dataclasses.replace(runtime.config, prior=prior, head_cr_cap=head_cr_cap,
                                         head_balance_weight=head_balance_weight)
    for param in model.parameters():
        param.grad = None
    layers = dmc_layers(model)
    for layer in layers:
        layer.reset_cr_stats()
    per_sequence = torch.zeros(MICRO, MBS, dtype=torch.float64)
    for layer in layers:
        def record(alpha, layer_record=type(layer)._record_kept.__get__(layer)):
            kept = layer_record(alpha)
            per_sequence[runtime.microbatch] += kept.detach().double().sum(dim=1)
            return kept
        layer._record_kept = record

    gen = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen) for _ in range(MICRO)]
    data = iter(batches)
    micro = iter(range(MICRO))

    def forward_step(_, model):
        runtime.microbatch = next(micro)
        batch = next(data)
        tokens, labels = batch[:, :-1], batch[:, 1:]
        position_ids = torch.arange(SEQ).expand(MBS, SEQ)
        output = model(tokens, position_ids, None, labels=labels)

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"lm": loss.detach()}

        return output, loss_func

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / MICRO))
    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=None, model=[model],
        num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=MBS,
    )
    lm = torch.tensor(sum(r["lm"].item() for r in results) / MICRO if results else 0.0)
    cr_loss = torch.tensor(sum(l.item() for l in runtime.pop_cr_losses()) / MICRO)
    kept = torch.zeros(LAYERS, GROUPS, dtype=torch.float64)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for layer in layers:
        local = layer.cr_kept.numel()
        kept[layer.layer_number - 1, tp_rank * local:(tp_rank + 1) * local] = layer.cr_kept
    for t in (lm, cr_loss, kept, per_sequence):
        dist.all_reduce(t)  # LM/CR loss: replicated over TP ranks; kept: one owner per part
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    grads = {}
    for name, param in model.named_parameters():
        grads[global_name(name)] = gather_full(name, param.grad, tp_group)
    all_grads = [None] * dist.get_world_size()
    dist.all_gather_object(all_grads, grads)
    merged = {}
    for part in all_grads:
        merged.update(part)
    return {"lm": lm / tp, "cr_loss": cr_loss / tp, "kept": kept,
            "kept_per_sequence": per_sequence, "grads": merged}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    initialize_parallel(args.tp, args.pp, seed=7)
    config = llama_transformer_config(LAYERS, HIDDEN, HEADS, FFN, num_query_groups=GROUPS)
    out = {}
    for method, dmc_config, target_cr in (("dmc", DMCConfig(window=4, c=0.0), TARGET_CR),
                                          ("dms", DMS_CONFIG, DMS_TARGET_CR),
                                          ("dms_adapter", DMS_ADAPTER_CONFIG, DMS_TARGET_CR)):
        runtime = DMCRuntime(dmc_config, mode="train", target_cr=target_cr, step=5)
        model = build_gpt_model(config, VOCAB, SEQ, dmc=runtime)
        init_by_global_name(model)
        priors = ("global",) if method == "dms_adapter" else PRIORS
        results = {prior: run_step(model, runtime, prior) for prior in priors}
        if method == "dmc":
            results["global+cap"] = run_step(model, runtime, "global", HEAD_CR_CAP)
            results["global+balance"] = run_step(model, runtime, "global",
                                                 head_balance_weight=HEAD_BALANCE_WEIGHT)
        out.update(results if method == "dmc" else {method: results})
    if dist.get_rank() == 0:
        torch.save(out, args.out)
    destroy_parallel()


if __name__ == "__main__":
    main()
