"""Training-step throughput of DMC vs vanilla attention on the same machine and model.

Both runs use the same GPTModel (DMC layer spec); "vanilla" switches the layers to megatron's
own attention, "dmc" to train mode (Gumbel decisions, window-grouped accumulation, additive mask
and CR loss). Prints a table and writes JSON.

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


def measure(model, runtime, mode, tokens, positions, steps, warmup):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    timings = []
    for i in range(warmup + steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        runtime.start_step(i, mode, target_cr=2.0)
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= warmup:
            timings.append(time.perf_counter() - start)
    seconds = sorted(timings)[len(timings) // 2]
    return tokens.numel() / seconds, seconds


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
    parser.add_argument("--out", default="benchmarks/results/train_step.json")
    args = parser.parse_args(argv)

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
    for mode, name in (("vanilla", "vanilla"), ("train", "dmc")):
        tok_s, seconds = measure(model, runtime, mode, tokens, positions, args.steps, args.warmup)
        rows[name] = {"tokens_per_s": tok_s, "step_s": seconds}
    ratio = rows["dmc"]["tokens_per_s"] / rows["vanilla"]["tokens_per_s"]
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{'attention':<10} {'tokens/s':>12} {'step (s)':>10}   device: {device_name}")
    for name, row in rows.items():
        print(f"{name:<10} {row['tokens_per_s']:>12.0f} {row['step_s']:>10.3f}")
    print(f"DMC / vanilla tokens/s: {ratio:.3f}")
    result = {"config": vars(args), "device": device_name, "results": rows, "ratio": ratio}
    from pathlib import Path

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
