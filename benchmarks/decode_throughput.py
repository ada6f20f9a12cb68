"""Decode throughput and memory: vanilla vs DMC at forced compression ratios, same engine.

For each mode (vanilla, then DMC at every ``--crs`` value) on the same random Llama weights:

1. a probe run (ample pages) measures the KV pages and bytes one sequence holds at its full length
   (prompt + generated) and the measured CR;
2. ``max_batch`` = how many such sequences fit the KV memory budget (``--budget-pages``);
3. a timed run decodes ``min(max_batch, --batch-cap)`` sequences together inside that budget:
   decode tokens/s = decoded tokens / decode seconds (prefill excluded), averaged over all
   generated tokens.

Forcing a CR on an untrained model: the model is built with a QKV bias; per layer (in order,
since earlier decisions change later hidden states) the k[-1] decision row gets random weights
and a bias set from a calibration forward so that a fraction ``1 - 1/CR`` of tokens has
``k[-1] - c > 0`` (merge); the q[-1] rows are zeroed (uniform importance). The measured CR on the
generated text is reported next to the target.

Prints a table; ``--out FILE.json`` writes the numbers. CPU works (PyTorch kernels, small model);
on CUDA the Triton kernels run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore", module="megatron")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=8, help="KV heads (query groups)")
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--budget-pages", type=int, default=None,
                   help="KV memory budget in pages (default: 8 vanilla sequences)")
    p.add_argument("--crs", default="2,4", help="DMC target CRs, comma separated")
    p.add_argument("--window", type=int, default=12, help="DMC window (0 = exact)")
    p.add_argument("--c", type=float, default=5.0, help="DMC decision offset")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--batch-cap", type=int, default=64,
                   help="most sequences in the timed run (CPU time stays bounded)")
    p.add_argument("--probe", type=int, default=4, help="sequences in the probe run")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="model and cache dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (CPU runs only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def build_models(args):
    """Vanilla model and, per target CR, a DMC model with the same weights and forced
    decisions. Returns (config dict, vanilla model, {cr: dmc model})."""
    from dmc.megatron.model import build_gpt_model, llama_transformer_config
    from dmc.megatron.runtime import DMCConfig, DMCRuntime

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    config = llama_transformer_config(args.layers, args.hidden, args.heads, args.ffn,
                                      num_query_groups=args.groups, params_dtype=dtype,
                                      add_qkv_bias=True)
    max_seq = args.prompt_len + args.gen_len
    vanilla = build_gpt_model(config, args.vocab, max_seq)
    models = {}
    window = args.window or None
    for cr in args.target_crs:
        runtime = DMCRuntime(DMCConfig(window=window, c=args.c))
        model = build_gpt_model(config, args.vocab, max_seq, dmc=runtime)
        model.load_state_dict(vanilla.state_dict())
        runtime.set_mode("eval")
        force_cr(model, cr, args)
        models[cr] = model
    return vanilla, models


@torch.no_grad()
def force_cr(model, cr: float, args) -> None:
    """Set the decision rows of every DMC layer so that about ``1 - 1/cr`` of calibration tokens
    merge (see the module docstring)."""
    from dmc.megatron.attention import dmc_layers

    gen = torch.Generator().manual_seed(args.seed + 1)
    calib = torch.randint(0, args.vocab, (8, args.prompt_len + args.gen_len), generator=gen)
    device = next(model.parameters()).device
    calib = calib.to(device)
    positions = torch.arange(calib.shape[1], device=device).expand_as(calib)
    c = args.c
    for layer in dmc_layers(model):
        dim = layer.hidden_size_per_attention_head
        groups = layer.num_query_groups_per_partition
        per_group = layer.num_attention_heads_per_partition // groups
        weight, bias = layer.linear_qkv.weight, layer.linear_qkv.bias
        k_rows = []
        for g in range(groups):
            base = g * (per_group + 2) * dim
            for i in range(per_group):  # q[-1] rows: omega = sigmoid(c) for every token
                weight[base + i * dim + dim - 1] = 0
                bias[base + i * dim + dim - 1] = 0
            k_row = base + per_group * dim + dim - 1
            weight[k_row] = torch.randn(weight.shape[1], generator=gen).to(weight) / math.sqrt(
                weight.shape[1])
            bias[k_row] = 0
            k_rows.append(k_row)
        captured = []
        hook = layer.linear_qkv.register_forward_hook(
            lambda mod, inp, out: captured.append(out[0][..., k_rows].float()))
        model(calib, positions, None)
        hook.remove()
        raw = captured[0].reshape(-1, groups)  # [tokens, groups]
        threshold = torch.quantile(raw, 1.0 / cr, dim=0)
        for g, k_row in enumerate(k_rows):
            bias[k_row] = c - threshold[g]


def run_mode(name, model, target_cr, args, budget_pages):
    from dmc.inference import CompressionStats, Engine, SamplingParams

    gen = torch.Generator().manual_seed(args.seed + 2)
    max_seq = args.prompt_len + args.gen_len

    def prompts(n):
        return torch.randint(0, args.vocab, (n, args.prompt_len), generator=gen).tolist()

    params = SamplingParams(max_new_tokens=args.gen_len, temperature=1.0, seed=args.seed)
    probe = Engine(model, page_size=args.page_size, max_batch=args.probe, max_seq_len=max_seq,
                   chunk_size=args.chunk_size, seed=args.seed)
    results = probe.generate(prompts(args.probe), params)
    pages_per_seq = max(r.kv_pages for r in results)
    bytes_per_seq = sum(r.kv_bytes for r in results) / len(results)
    fit = budget_pages // pages_per_seq
    batch = max(1, min(fit, args.batch_cap))
    engine = Engine(model, page_size=args.page_size, max_batch=batch, max_seq_len=max_seq,
                    num_pages=budget_pages, chunk_size=args.chunk_size, seed=args.seed)
    engine.generate(prompts(1), SamplingParams(max_new_tokens=2))  # warm-up
    engine.reset_stats()
    started = time.perf_counter()
    timed = engine.generate(prompts(batch), params)
    wall = time.perf_counter() - started
    failed = [r.error for r in results + timed if r.error]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} requests did not finish: {failed[0]}")
    stats = engine.stats
    comp = CompressionStats.combine([r.compression for r in results + timed])
    return {
        "mode": name,
        "target_cr": target_cr,
        "measured_cr": comp.overall,
        "measured_cr_per_layer": comp.per_layer,
        "kv_pages_per_seq": pages_per_seq,
        "kv_bytes_per_seq": bytes_per_seq,
        "max_batch_at_budget": fit,
        "timed_batch": batch,
        "decode_tokens": stats["decode_tokens"],
        "decode_seconds": stats["decode_seconds"],
        "decode_tokens_per_s": stats["decode_tokens"] / max(stats["decode_seconds"], 1e-9),
        "prefill_tokens_per_s": stats["prefill_tokens"] / max(stats["prefill_seconds"], 1e-9),
        "wall_seconds": wall,
        "peak_pages": stats["peak_pages"],
        "preemptions": stats["preemptions"],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    from dmc.megatron.compat import cuda_available
    from dmc.megatron.parallel import initialize_parallel

    cuda = cuda_available()
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.target_crs = [float(x) for x in args.crs.split(",") if x.strip()]
    if any(cr <= 1 for cr in args.target_crs):
        raise SystemExit("--crs: DMC target CRs must be > 1 (vanilla is always measured)")
    if not cuda:
        torch.set_num_threads(max(1, min(args.threads, os.cpu_count() or 1)))
    initialize_parallel(1, 1, seed=args.seed)
    vanilla, models = build_models(args)
    max_seq = args.prompt_len + args.gen_len
    per_head = math.ceil((max_seq - 1) / args.page_size)
    vanilla_pages = per_head * args.layers * args.groups
    budget = args.budget_pages or 8 * vanilla_pages
    rows = [run_mode("vanilla", vanilla, 1.0, args, budget)]
    for cr, model in models.items():
        rows.append(run_mode("dmc", model, cr, args, budget))
    head_dim = args.hidden // args.heads
    page_bytes = 2 * args.page_size * head_dim * torch.tensor([], dtype=getattr(
        torch, args.dtype)).element_size()
    device = torch.cuda.get_device_name() if cuda else "cpu (PyTorch kernels)"
    print(f"decode throughput on {device}: {args.layers} layers, hidden {args.hidden}, "
          f"{args.heads} heads / {args.groups} KV heads, {args.dtype}, prompt {args.prompt_len} "
          f"+ {args.gen_len} generated, page {args.page_size} slots ({page_bytes} B), "
          f"budget {budget} pages ({budget * page_bytes / 2**20:.1f} MiB)")
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "args": vars(args), "budget_pages": budget,
                       "page_bytes": page_bytes, "rows": rows}, f, indent=2)
        print(f"wrote {args.out}")
    return 0


def table(rows) -> str:
    header = ("mode", "target CR", "measured CR", "KV KiB/seq", "pages/seq", "max batch",
              "timed batch", "decode tok/s", "preempt")
    lines = [" | ".join(f"{h:>12}" for h in header)]
    for r in rows:
        cells = (r["mode"], f"{r['target_cr']:.2f}", f"{r['measured_cr']:.2f}",
                 f"{r['kv_bytes_per_seq'] / 1024:.1f}", str(r["kv_pages_per_seq"]),
                 str(r["max_batch_at_budget"]), str(r["timed_batch"]),
                 f"{r['decode_tokens_per_s']:.1f}", str(r["preemptions"]))
        lines.append(" | ".join(f"{c:>12}" for c in cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
