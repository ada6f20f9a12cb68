"""Serving: two engines that differ in one setting, the same requests, one run.

N requests with mixed prompt lengths (uniform in ``[--min-prompt, --max-prompt]``, random tokens,
greedy, each with a budget of new tokens uniform in ``[--min-gen, --gen-len]``; all ``--gen-len``
by default) are all queued at t = 0 on the same random-weight model (DMC with decisions forced
by ``--c``, or vanilla) and served by two engines. ``--compare prefill`` (default):

* ``batched``: each forward holds the decode tokens of running sequences plus whole prefill chunks
  of several prompts, under one token budget (``--step-tokens``);
* ``one-at-a-time``: the same schedule, but every prefill chunk runs in a forward of its own and
  the decode tokens in another.

``--compare overlap``: decode steps through static buffers (``cuda_graphs=True``: CUDA graphs on
a GPU) without and with ``overlap=True`` (:mod:`dmc.inference.overlap`: a decode step launched
before the previous one is read back, going on as requests end); mixed budgets (``--min-gen``)
make requests end at different steps. Each engine also reports the fraction of its decode steps
that continued the pipeline without a drain.

Reported per engine: end-to-end seconds (until the last request finished), time to first token
(mean, median, p90, max, from the moment the requests were queued), inter-token latency (the
gaps between a request's consecutive tokens as ``Engine.stream`` hands them out: median and
p99; tokens handed out together count a gap of 0) and time per output token (per request, its
first to its last token over the tokens between, then the mean), generated tokens/s; and the
ratios second / first engine. The engines alternate ``--repeats`` times after a warm-up (order
rotated) and the median of each figure is kept. Both must produce the same tokens (checked).

    python benchmarks/serving.py --requests 16 --out serving.json
    python benchmarks/serving.py --compare overlap --requests 32 --max-batch 16 --min-gen 8 \
        --gen-len 64
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

# the two engines of each comparison: their names and Engine settings, the reference first
COMPARISONS = {
    "prefill": {"batched": dict(batch_prefill=True), "one-at-a-time": dict(batch_prefill=False)},
    "overlap": {"graphs": dict(cuda_graphs=True), "graphs+overlap": dict(cuda_graphs=True,
                                                                        overlap=True)},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=384)
    p.add_argument("--gen-len", type=int, default=16, help="most new tokens of a request")
    p.add_argument("--min-gen", type=int,
                   help="fewest new tokens of a request (default: --gen-len, all equal)")
    p.add_argument("--compare", choices=sorted(COMPARISONS), default="prefill",
                   help="the setting the two engines differ in")
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
    args.min_gen = args.gen_len if args.min_gen is None else args.min_gen
    for name in ("requests", "min_prompt", "gen_len", "min_gen", "max_batch", "chunk_size",
                 "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.max_prompt < args.min_prompt:
        p.error(f"--max-prompt must be >= --min-prompt ({args.min_prompt})")
    if args.gen_len < args.min_gen:
        p.error(f"--gen-len must be >= --min-gen ({args.min_gen})")
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


def make_params(args, count: int, seed: int) -> list:
    """Greedy sampling with each request's budget of new tokens, uniform in ``[--min-gen,
    --gen-len]``."""
    from dmc.inference import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    budgets = torch.randint(args.min_gen, args.gen_len + 1, (count,), generator=gen)
    return [SamplingParams(max_new_tokens=int(n)) for n in budgets]


def serve(model, args, settings: dict, prompts, params) -> tuple[dict, list]:
    """One engine (``settings``: its Engine arguments beyond the shared ones) serving
    ``prompts`` queued together: its figures and results."""
    from dmc.inference import Engine

    engine = Engine(model, page_size=args.page_size, max_batch=args.max_batch,
                    chunk_size=args.chunk_size, step_tokens=args.step_tokens, seed=args.seed,
                    **settings)
    started = time.perf_counter()
    results, arrivals = [None] * len(prompts), [[] for _ in prompts]
    for delta in engine.stream(prompts, params):
        arrivals[delta.index] += [time.perf_counter()] * len(delta.tokens)
        if delta.result is not None:
            results[delta.index] = delta.result
    seconds = time.perf_counter() - started
    ttft = sorted(r.time_to_first_token for r in results)
    gaps = sorted(b - a for times in arrivals for a, b in zip(times, times[1:]))
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for times in arrivals if len(times) > 1]
    generated = sum(len(r.tokens) for r in results)
    stats = engine.stats
    return {"end_to_end_s": seconds, "ttft_mean_s": statistics.fmean(ttft),
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
            "ttft_max_s": ttft[-1], "itl_p50_s": statistics.median(gaps) if gaps else 0.0,
            "itl_p99_s": gaps[int(0.99 * (len(gaps) - 1))] if gaps else 0.0,
            "tpot_mean_s": statistics.fmean(tpot) if tpot else 0.0,
            "tokens_per_s": generated / seconds,
            "preemptions": stats.preemptions,
            "continued_fraction": stats.continued_steps / max(stats.decode_steps, 1)}, results


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    model = build_model(args)
    prompts = make_prompts(args, args.requests, args.seed + 1)
    params = make_params(args, args.requests, args.seed + 3)
    warm = min(4, args.requests)
    engines = COMPARISONS[args.compare]
    for settings in engines.values():
        serve(model, args, settings, make_prompts(args, warm, args.seed + 2), params[:warm])
    runs = {name: [] for name in engines}
    for repeat in range(args.repeats):
        order = list(engines) if repeat % 2 == 0 else list(engines)[::-1]
        outputs = {}
        for name in order:
            figures, results = serve(model, args, engines[name], prompts, params)
            runs[name].append(figures)
            outputs[name] = [r.tokens for r in results]
        if len({str(tokens) for tokens in outputs.values()}) != 1:
            raise SystemExit(f"{' and '.join(engines)} generated different tokens")
    summary = {name: {key: statistics.median(run[key] for run in figures)
                      for key in figures[0]} for name, figures in runs.items()}
    first, second = engines
    ratios = {key: summary[second][key] / summary[first][key] if summary[first][key] else None
              for key in ("end_to_end_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s",
                          "itl_p50_s", "itl_p99_s", "tpot_mean_s")}
    report = {"config": vars(args) | {"device": "cuda" if torch.cuda.is_available() else "cpu",
                                      "prompt_lengths": [len(p) for p in prompts],
                                      "new_token_budgets": [p.max_new_tokens for p in params]},
              "median": summary, "ratio": f"{second} / {first}", "ratios": ratios, "runs": runs}
    print_table(summary, report["ratio"], ratios)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


def print_table(summary: dict, ratio: str, ratios: dict) -> None:
    columns = ("end_to_end_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_max_s",
               "itl_p50_s", "itl_p99_s", "tpot_mean_s", "tokens_per_s", "continued_fraction")
    print(f"{'engine':<15}" + "".join(f"{c:>19}" for c in columns))
    for name, figures in summary.items():
        print(f"{name:<15}" + "".join(f"{figures[c]:>19.4f}" for c in columns))
    print(f"ratio {ratio}: " + "  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()
                                         if v is not None))


if __name__ == "__main__":
    main()
