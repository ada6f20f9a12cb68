"""Serving: batched chunked prefill vs one prefill at a time, same requests, one run.

N requests with mixed prompt lengths (uniform in ``[--min-prompt, --max-prompt]``, random tokens,
greedy, ``--gen-len`` new tokens each) are all queued at t = 0 on the same random-weight model
(DMC with decisions forced by ``--c``, or vanilla) and served by two engines that differ only in
``batch_prefill``:

* ``batched``: each forward holds the decode tokens of running sequences plus whole prefill chunks
  of several prompts, under one token budget (``--step-tokens``);
* ``one-at-a-time``: the same schedule, but every prefill chunk runs in a forward of its own and
  the decode tokens in another.

Reported per engine: end-to-end seconds (until the last request finished), time to first token
(mean, median, p90, max, from the moment the requests were queued), generated tokens/s; and the
ratios one-at-a-time / batched. The engines alternate ``--repeats`` times after a warm-up (order
rotated) and the median of each figure is kept. Both must produce the same tokens (checked).

    python benchmarks/serving.py --requests 16 --out serving.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=384)
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--mode", choices=["dmc", "vanilla"], default="dmc")
    p.add_argument("--window", type=int, default=12, help="DMC window (0 = exact)")
    p.add_argument("--c", type=float, default=0.0,
                   help="DMC decision offset (0 on random weights: about half the tokens merge)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=4, help="KV heads")
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--step-tokens", type=int,
                   help="token budget of a forward (default: max_batch + 4 x chunk_size)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="CPU threads (CPU runs only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    for name in ("requests", "min_prompt", "gen_len", "max_batch", "chunk_size", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.max_prompt < args.min_prompt:
        p.error(f"--max-prompt must be >= --min-prompt ({args.min_prompt})")
    args.step_tokens = args.step_tokens or args.max_batch + 4 * args.chunk_size
    return args


def build_model(args):
    from dmc.megatron.config import DMCConfig, ModelConfig
    from dmc.megatron.model import build_model_from_config

    config = ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                         num_attention_heads=args.heads, num_query_groups=args.groups,
                         ffn_hidden_size=args.ffn, vocab_size=args.vocab,
                         max_seq_length=args.max_prompt + args.gen_len)
    dmc = None if args.mode == "vanilla" else DMCConfig(window=args.window or None, c=args.c)
    torch.manual_seed(args.seed)
    model = build_model_from_config(config, dmc)
    if torch.cuda.is_available():
        model = model.cuda()
    return model


def make_prompts(args, count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (count,), generator=gen)
    return [torch.randint(0, args.vocab, (int(n),), generator=gen).tolist() for n in lengths]


def serve(model, args, batched: bool, prompts) -> tuple[dict, list]:
    """One engine serving ``prompts`` queued together: its figures and results."""
    from dmc.inference import Engine, SamplingParams

    engine = Engine(model, page_size=args.page_size, max_batch=args.max_batch,
                    chunk_size=args.chunk_size, step_tokens=args.step_tokens,
                    batch_prefill=batched, seed=args.seed)
    started = time.perf_counter()
    results = engine.generate(prompts, SamplingParams(max_new_tokens=args.gen_len))
    seconds = time.perf_counter() - started
    ttft = sorted(r.time_to_first_token for r in results)
    generated = sum(len(r.tokens) for r in results)
    return {"end_to_end_s": seconds, "ttft_mean_s": statistics.fmean(ttft),
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
            "ttft_max_s": ttft[-1], "tokens_per_s": generated / seconds,
            "preemptions": engine.stats.preemptions}, results


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    model = build_model(args)
    prompts = make_prompts(args, args.requests, args.seed + 1)
    warm = make_prompts(args, min(4, args.requests), args.seed + 2)
    engines = {"batched": True, "one-at-a-time": False}
    for batched in engines.values():
        serve(model, args, batched, warm)
    runs = {name: [] for name in engines}
    for repeat in range(args.repeats):
        order = list(engines) if repeat % 2 == 0 else list(engines)[::-1]
        outputs = {}
        for name in order:
            figures, results = serve(model, args, engines[name], prompts)
            runs[name].append(figures)
            outputs[name] = [r.tokens for r in results]
        if outputs["batched"] != outputs["one-at-a-time"]:
            raise SystemExit("batched and one-at-a-time prefill generated different tokens")
    summary = {name: {key: statistics.median(run[key] for run in figures)
                      for key in figures[0]} for name, figures in runs.items()}
    ratios = {key: summary["one-at-a-time"][key] / summary["batched"][key]
              for key in ("end_to_end_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s")}
    report = {"config": vars(args) | {"device": "cuda" if torch.cuda.is_available() else "cpu",
                                      "prompt_lengths": [len(p) for p in prompts]},
              "median": summary, "one_at_a_time_over_batched": ratios, "runs": runs}
    print_table(summary, ratios)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


def print_table(summary: dict, ratios: dict) -> None:
    columns = ("end_to_end_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_max_s",
               "tokens_per_s")
    print(f"{'engine':<15}" + "".join(f"{c:>14}" for c in columns))
    for name, figures in summary.items():
        print(f"{name:<15}" + "".join(f"{figures[c]:>14.3f}" for c in columns))
    print(f"{'ratio 1-at-a-time/batched':<27}"
          + "  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
