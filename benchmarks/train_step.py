"""Training-step throughput and peak memory of DMC vs vanilla attention on one machine and model.

Every run uses the same GPTModel (DMC layer spec); "vanilla" switches the layers to megatron's
own attention, "dmc-dense" and "dmc-flex" to train mode (Gumbel decisions, window-grouped
accumulation, CR loss) with the attention of :func:`dmc.ops.dmc_attention` computed through the
dense additive bias or FlexAttention (``--backends``; default both on CUDA, dense on the CPU,
where FlexAttention has no backward). Step time is the median of ``--steps`` after
``--warmup``; peak memory is the CUDA allocator's peak over those steps (none on the CPU);
"saved" is what autograd keeps for the backward of one step (the bytes of the distinct storages
packed by ``saved_tensors_hooks``, parameters left out: the activation memory, on any device).
Prints a table and writes JSON.

    python benchmarks/train_step.py --layers 4 --hidden 256 --heads 8 --seq 256 --batch 8
"""
from __future__ import annotations

import argparse
import sys
import json
import time
import warnings

import torch

warnings.filterwarnings("ignore")


def saved_activation_bytes(model, runtime, mode, tokens, positions) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of one forward,
    parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    runtime.start_step(0, mode, target_cr=2.0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens, positions, None, labels=tokens).float().mean()
    del loss
    return sum(storages.values())


def measure(model, runtime, mode, tokens, positions, steps, warmup):
    """(tokens/s, median step seconds, peak allocated bytes or None) of ``steps`` train steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    timings = []
    cuda = torch.cuda.is_available()
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
            if i == warmup:
                torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        runtime.start_step(i, mode, target_cr=2.0)
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            timings.append(time.perf_counter() - start)
    seconds = sorted(timings)[len(timings) // 2]
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return tokens.numel() / seconds, seconds, peak


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=None)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--window", type=int, default=12)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backends", help="comma separated DMC attention backends of "
                        "dense, flex (default: dense,flex on CUDA, dense on the CPU)")
    parser.add_argument("--out", default="benchmarks/results/train_step.json")
    args = parser.parse_args(argv)
    args.backends = args.backends or ("dense,flex" if torch.cuda.is_available() else "dense")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or set(backends) - {"dense", "flex"}:
        parser.error(f"--backends: accepted dense, flex (comma separated), got {args.backends!r}")
    if "flex" in backends and not torch.cuda.is_available():
        parser.error("--backends: flex needs CUDA (FlexAttention has no backward on the CPU)")

    from dmc.megatron.model import build_gpt_model, llama_transformer_config
    from dmc.megatron.parallel import initialize_parallel
    from dmc.megatron.runtime import DMCConfig, DMCRuntime

    initialize_parallel(1, 1, seed=0)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    config = llama_transformer_config(args.layers, args.hidden, args.heads, args.ffn,
                                      num_query_groups=args.groups, params_dtype=dtype)
    runtime = DMCRuntime(DMCConfig(window=args.window))
    model = build_gpt_model(config, args.vocab, args.seq, dmc=runtime)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    positions = torch.arange(args.seq, device=device).expand(args.batch, args.seq)
    rows = {}
    for mode, name, backend in [("vanilla", "vanilla", None)] + [
            ("train", f"dmc-{b}", b) for b in backends]:
        if backend:
            runtime.config.attention_backend = backend
        tok_s, seconds, peak = measure(model, runtime, mode, tokens, positions, args.steps,
                                       args.warmup)
        saved = saved_activation_bytes(model, runtime, mode, tokens, positions)
        rows[name] = {"tokens_per_s": tok_s, "step_s": seconds, "peak_bytes": peak,
                      "saved_bytes": saved}
    base = rows["vanilla"]
    for row in rows.values():
        row["time_vs_vanilla"] = row["step_s"] / base["step_s"]
        row["memory_vs_vanilla"] = (row["peak_bytes"] / base["peak_bytes"]
                                    if row["peak_bytes"] else None)
        row["saved_vs_vanilla"] = row["saved_bytes"] / base["saved_bytes"]
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{'attention':<10} {'tokens/s':>12} {'step (s)':>10} {'x vanilla time':>15} "
          f"{'peak GiB':>9} {'x vanilla mem':>14} {'saved GiB':>10} {'x vanilla':>10}   "
          f"device: {device_name}")
    for name, row in rows.items():
        peak = "-" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**30:.2f}"
        mem = "-" if row["memory_vs_vanilla"] is None else f"{row['memory_vs_vanilla']:.3f}"
        print(f"{name:<10} {row['tokens_per_s']:>12.0f} {row['step_s']:>10.3f} "
              f"{row['time_vs_vanilla']:>15.3f} {peak:>9} {mem:>14} "
              f"{row['saved_bytes'] / 2**30:>10.3f} {row['saved_vs_vanilla']:>10.3f}")
    result = {"config": vars(args), "device": device_name, "results": rows}
    from pathlib import Path

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
