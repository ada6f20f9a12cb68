"""Decode throughput at equal KV memory, the paper's protocol (Nawrot et al. 2024, Sec. 5.3).

Every mode serves requests of a prompt of P random tokens plus G generated tokens (sampled at
temperature 1, no stop token) with the largest batch whose cache fits ONE memory budget:

1. a probe run per mode (``--probe`` sequences, ample pages; every mode probed before any
   timed cache is allocated, an overlapped twin taking its plain twin's probe) measures the
   pages each sequence holds at its full length P + G, the peak state a policy keeps per
   sequence, and the measured CR. DMC's and DMS's pages vary with the text (forced DMC 4x at
   the gpu preset's layout: 9791-10889 pages over 4 sequences, mean 10463): the batch's pages
   are the prediction bound of a sum over the probed spread
   (:func:`~dmc.eval.kv_budget.batch_pages_bound`; the gpu preset probes 64 sequences of
   those modes and a trained model's, at most 4 of the others), or, below 8 probed sequences,
   the batch times the largest (the CPU presets');
2. the budget counts everything the cache allocates (:func:`cache_allocation`): the K/V pages,
   and per sequence slot the block-table row of every (layer, KV head), its length, and the DMC
   open-slot merge state (window ring of pre-RoPE keys and values in the model's dtype, their
   float32 weights, the token count), under DMS the window ring of ``w + 1`` keys, values and
   eviction flags in the cache dtype, under delayed merging the ring of ``d + 1`` raw keys and
   values (cache dtype) and their two float32 decisions; plus the policy's state per sequence.
   The batch is the largest that fits with a page per (layer, KV head) to spare (the
   scheduler's margin for
   admitting a prompt while others run: without it the last sequence of a batch can wait for
   the others to finish) and, per sequence, the pages the scheduler reserves for one decode
   step beyond what the step takes (the probe's most, ``step_reserve_per_seq``: a DMC, DMS or
   delayed-merging head whose next slot starts a page is given one whether or not it appends,
   which it learns on the device; without them a full pool preempts at the end of
   generation); the pool gets every page the budget has left;
3. all modes run together, interleaved step by step (one ``Engine.step`` of each mode in turn,
   the order rotated every round), so that drift of the machine lands on every mode alike;
   with ``--overlap`` (``Engine(overlap=True)``: a decode step launched before the previous one
   is read back) in blocks of :data:`OVERLAP_BLOCK` steps, an overlapped step timed from the
   end of the previous one without waiting for the device (the block's first step, after the
   other modes ran, is not timed);
4. throughput is tokens/s over the last ``--steady`` decode steps at the full batch (steps that
   prefill nothing and decode every sequence): the steady state at the longest contexts; also
   batch / the median of those step times, which a busy machine's bursts disturb less.

Modes (``--modes``, comma separated):

* ``vanilla``: the base model, uncompressed cache;
* ``dmc:CR``: the base weights with forced decisions (random models only): per layer, in order
  (earlier decisions change later hidden states), the k[-1] decision row gets random weights and
  a bias from a calibration forward such that a fraction ``1 - 1/CR`` of tokens merges; the q[-1]
  rows are zeroed (uniform importance). The measured CR is reported next to the target;
* ``delay:CR``: as ``dmc:CR`` with ``dmc.merge_delay`` = ``--merge-delay`` d (DMC with delayed
  merging: a ring of the last d + 1 raw tokens in front of Algorithm 1's slots), the tokens
  older than the ring merging so that the CR at the full length P + G is CR (P + G must be at
  least CR * (d + 1));
* ``dms:CR``: the base weights as a DMS model (window ``--dms-window``; on CUDA the Triton paged
  kernel with the window ring folded into its reduce step) with forced decisions: per layer, in
  order, the borrowed row (q[-1] of the first query head of each KV group, pre-RoPE) gets random
  weights and a bias from a calibration forward such that the tokens older than the window keep
  the fraction that gives CR at the full length P + G (the window's ``w + 1`` tokens always
  stay: P + G must be at least CR * (w + 1));
* ``gqa:F``: a random model of the same shape with ``F`` times fewer KV heads (random models
  only);
* ``policy:NAME:CR``: the base model with a training-free policy (``dmc.policies``) at CR;
  ``NAME`` may name its schedule, ``NAME@SCHEDULE`` (``prefill``, ``prefill/N``, ``streaming``;
  default: its paper's). Under ``prefill`` the decode phase grows, which the probe's pages at the
  full length P + G count;
* ``model``: the checkpoint given with ``--model`` as it was trained (DMC decisions when it is a
  DMC model), with its measured CR.

``--model PATH`` (an inference ``.pt`` file or a training checkpoint, run or checkpoints folder)
replaces the random base model; its shape then comes from the checkpoint.

Each mode also gets its roofline (:mod:`dmc.eval.roofline`): the bytes a steady step reads
(weights, the K/V pages held, the DMC merge state it updates, the window ring it reads),
the bandwidth it achieves, and the fraction of its bound ``max(bytes / read bandwidth, flops /
GEMM rate)`` it reaches at the median step time, the bandwidth and GEMM rate measured by
microbenchmarks after the run, in the same process and thread count.

Presets: ``gpu`` (default with CUDA): a ~1B-shaped Llama (16 layers, hidden 2048, 16 heads, FFN
5504, vocab 32000), bf16, P = G = 2048, 12 GiB per mode (lowered to an equal share where the
GPU does not hold every mode's cache beside the models and 6 GiB for activations: five modes
on an 80 GB H100), prompts prefilled 32768 tokens a step, modes vanilla, DMC 2x / 4x / 8x and
DMS 4x;
``cpu`` (default otherwise): 2 layers, hidden 256, 4 heads, P = 256, G = 64, 8 MiB per mode, fp32,
vanilla and DMC 2x / 4x; ``cpu-kv``: a KV-heavy CPU shape where the cache, not the weights,
dominates a step (2 layers, hidden 512, 8 heads and 8 KV heads, P = 1024, G = 64, 136 MiB per
mode), vanilla, DMC 2x / 4x, GQA 2x / 4x (add ``dms:4`` for DMS, ``delay:4`` for delayed
merging). Any flag overrides its preset
value.

Prints a table; ``--out FILE.json`` writes every number (and, every :data:`PARTIAL_EVERY`
interleaved steps of the timed run, the figures so far, marked ``"partial": true``). On CUDA
the Triton kernels run, on CPU
the PyTorch ones.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import warnings

import torch

from dmc.eval.decode_modes import (FORCED, MODE_SYNTAX, Mode, build_models, model_config,
                                   parse_mode)
from dmc.eval.device_activity import device_activity
from dmc.eval.kv_budget import batch_pages_bound, cache_allocation, fit_batch
from dmc.eval.roofline import attention_flops, measure_machine, roofline, weight_bytes_and_flops
from dmc.inference.ring_cache import WindowRingCache

warnings.filterwarnings("ignore", module="megatron")

STARTED = time.perf_counter()
OVERLAP_BLOCK = 16  # steps a mode runs in turn when some mode overlaps its steps
PARTIAL_EVERY = 128  # interleaved steps between two partial writes of --out
PRESETS = {
    "gpu": dict(layers=16, hidden=2048, heads=16, groups=16, ffn=5504, vocab=32000,
                prompt_len=2048, gen_len=2048, steady=512, budget_mib=12 * 1024,
                modes="vanilla,dmc:2,dmc:4,dmc:8,dms:4", dtype="bfloat16", probe=64,
                prefill_tokens=32768),
    "cpu": dict(layers=2, hidden=256, heads=4, groups=4, ffn=512, vocab=512,
                prompt_len=256, gen_len=64, steady=32, budget_mib=8, modes="vanilla,dmc:2,dmc:4",
                dtype="float32", probe=2),
    "cpu-kv": dict(layers=2, hidden=512, heads=8, groups=8, ffn=1024, vocab=512,
                   prompt_len=1024, gen_len=64, steady=32, budget_mib=136,
                   modes="vanilla,dmc:2,dmc:4,gqa:2,gqa:4", dtype="float32", probe=2),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="default sizes (default: gpu with CUDA, cpu otherwise)")
    p.add_argument("--modes", help=f"comma separated: {MODE_SYNTAX}")
    p.add_argument("--model", help="a trained checkpoint replacing the random base model")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--groups", type=int, help="KV heads (query groups)")
    p.add_argument("--ffn", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--prompt-len", type=int, help="P: prompt tokens per request")
    p.add_argument("--gen-len", type=int, help="G: generated tokens per request")
    p.add_argument("--steady", type=int,
                   help="N: tokens/s over the last N decode steps at the full batch")
    p.add_argument("--budget-mib", type=float, help="cache memory budget per mode, MiB (on a GPU "
                   "a preset's is lowered to what the device holds for every mode beside the "
                   "models and a reserve for activations; one given here is kept or refused)")
    p.add_argument("--prefill-tokens", type=int,
                   help="most prompt tokens prefilled in one step beside the decode tokens "
                        "(default: every prompt at once; the gpu preset 32768, which keeps a "
                        "prefill's activations small)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--window", type=int, default=12, help="DMC window of forced modes (0 = exact)")
    p.add_argument("--c", type=float, default=5.0,
                   help="DMC / DMS decision offset of forced modes")
    p.add_argument("--dms-window", type=int, default=32,
                   help="DMS eviction delay w of dms:CR modes (512 in NVIDIA's recipe)")
    p.add_argument("--merge-delay", type=int, default=16,
                   help="merge delay d of delay:CR modes (dmc.merge_delay)")
    p.add_argument("--chunk-size", type=int, help="prefill chunk per sequence (default: P)")
    p.add_argument("--probe", type=int, help="sequences in each probe run")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=1, help="CPU threads (CPU runs only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graphs", action="store_true",
                   help="decode-only steps replayed from a CUDA graph per batch size (eager on "
                        "the CPU); vanilla, GQA and DMC modes (policies and DMS run eagerly)")
    p.add_argument("--overlap", choices=["off", "on", "both"], default="off",
                   help="with --cuda-graphs: serve every mode but the policies with "
                        "Engine(overlap=True) (a step's host work while the previous step's "
                        "device work runs): on; both: each such mode twice, with and without")
    p.add_argument("--profile", action="store_true",
                   help="profile one decode step of each mode halfway through generation "
                        "(torch.profiler; the step is left out of the timings) and print its "
                        "busiest kernels")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    from dmc.megatron.compat import cuda_available

    args.cuda = cuda_available()
    args.preset = args.preset or ("gpu" if args.cuda else "cpu")
    args.budget_given = args.budget_mib is not None
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.mode_list = [parse_mode(m) for m in args.modes.split(",") if m.strip()]
    except ValueError as err:
        p.error(str(err))
    kinds = [m.kind for m in args.mode_list]
    if not args.mode_list:
        p.error(f"--modes: no mode given; accepted: {MODE_SYNTAX}")
    if args.model and set(FORCED + ("gqa",)) & set(kinds):
        p.error("--modes: dmc:CR, delay:CR, dms:CR and gqa:FACTOR need the random base model (no "
                "--model); with --model use vanilla, model, policy:NAME:CR")
    if "model" in kinds and not args.model:
        p.error("--modes: 'model' needs --model PATH")
    if args.overlap != "off" and not args.cuda_graphs:
        p.error(f"--overlap: {args.overlap} needs --cuda-graphs (accepted without it: off)")
    for name in ("prompt_len", "gen_len", "steady", "page_size", "probe", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.steady >= args.gen_len:
        p.error(f"--steady: must be < --gen-len ({args.gen_len}), got {args.steady}")
    try:  # the random model's shape (a --model checkpoint brings its own)
        model_config(args, args.groups)
    except ValueError as err:
        p.error(str(err))
    if args.budget_mib <= 0:
        p.error(f"--budget-mib: must be > 0, got {args.budget_mib}")
    if args.prefill_tokens is not None and args.prefill_tokens < 1:
        p.error(f"--prefill-tokens: must be >= 1, got {args.prefill_tokens}")
    if args.chunk_size is not None and args.chunk_size < 1:
        p.error(f"--chunk-size: must be >= 1, got {args.chunk_size}")
    if not math.isfinite(args.c):
        p.error(f"--c: must be a finite number, got {args.c}")
    if args.window < 0:
        p.error(f"--window: must be >= 0 (0 = exact), got {args.window}")
    if args.dms_window < 0:
        p.error(f"--dms-window: must be >= 0, got {args.dms_window}")
    if args.merge_delay < 1:
        p.error(f"--merge-delay: must be >= 1, got {args.merge_delay}")
    rings = {"dms": ("--dms-window", args.dms_window), "delay": ("--merge-delay", args.merge_delay)}
    for m in args.mode_list:
        flag, w = rings.get(m.kind, (None, 0))
        if flag and args.prompt_len + args.gen_len < m.value * (w + 1):
            p.error(f"{flag}: {m.kind}:{m.value:g} needs P + G >= CR * ({w} + 1) = "
                    f"{m.value * (w + 1):g} (the window always stays), got "
                    f"{args.prompt_len + args.gen_len} tokens")
        if m.kind == "gqa" and (m.value != int(m.value) or args.groups % int(m.value)):
            p.error(f"--modes: gqa:{m.value:g} must be a whole divisor of --groups "
                    f"{args.groups}")
    args.chunk_size = args.chunk_size or args.prompt_len
    return args


# ---------------------------------------------------------------------------- runs
class Run:
    """One mode's engine in the interleaved timed run, with its per-step records."""

    def __init__(self, mode: Mode, engine, batch: int, prompts, params):
        self.mode, self.engine, self.batch = mode, engine, batch
        self.results = []
        self.error = None  # what stopped this mode's run (the others go on)
        # (seconds, decode tokens, prefill tokens, KV bytes, slots, device seconds, timed) per
        # step; timed: False for an overlapped step that follows a pause (below)
        self.steps = []
        self.profiled = []  # the same of steps run under the profiler (not timed)
        self.profile_ms = {}  # op -> self milliseconds in the profiled step
        for prompt in prompts:
            engine.add_request(prompt, params)

    def step(self, cuda: bool, first: bool = True) -> None:
        """One ``Engine.step``, timed from an idle device to an idle device; overlapped, from
        the end of the previous step of the block (``first``: after the other modes' steps,
        whose device work absorbed this mode's step in flight: not timed)."""
        stats = self.engine.stats
        before = (stats.decode_tokens, stats.prefill_tokens, stats.decode_device_seconds)
        overlap = self.mode.overlap
        if cuda and (first or not overlap):
            torch.cuda.synchronize()
        started = time.perf_counter()
        self.results += self.engine.step()
        if cuda and not overlap:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        cache = self.engine.cache
        slots = int(cache.allocator.lengths.sum())
        if isinstance(cache, WindowRingCache):  # the filled ring rows of every head
            slots += int(cache.written.clamp(max=cache.ring_size).sum()) * cache.num_kv_heads
        self.steps.append((seconds, stats.decode_tokens - before[0],
                           stats.prefill_tokens - before[1],
                           cache.pages_in_use * cache.page_bytes, slots,
                           stats.decode_device_seconds - before[2], not (overlap and first)))

    def steady(self, n: int) -> tuple[int, int, float, float]:
        """The last ``n`` steps that decoded the full batch and prefilled nothing: (steps,
        tokens, seconds, median step seconds)."""
        full = self._full(n)
        median = sorted(s[0] for s in full)[len(full) // 2] if full else 0.0
        return len(full), sum(s[1] for s in full), sum(s[0] for s in full), median

    def host_seconds(self, n: int) -> float:
        """The median over those steps of the step's time not spent on the device's work
        (:class:`~dmc.inference.device_span.DeviceSpan`): scheduling, page reservation, the
        step's inputs, reading the tokens back, bookkeeping."""
        host = sorted(s[0] - s[5] for s in self._full(n))
        return host[len(host) // 2] if host else 0.0

    def steady_cache(self, n: int) -> tuple[float, float]:
        """Mean K/V page bytes and cached slots the cache held after those steps."""
        full = self._full(n) or [(0, 0, 0, 0, 0, 0, True)]
        return (sum(s[3] for s in full) / len(full), sum(s[4] for s in full) / len(full))

    def _full(self, n: int) -> list[tuple]:
        return [s for s in self.steps if s[2] == 0 and s[1] == self.batch and s[6]][-n:]


def progress(message: str) -> None:
    """A line on stderr with the seconds since the start (so a run stopped by a time limit
    still shows how far it got)."""
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", file=sys.stderr, flush=True)


def prompts_for(args, n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, args.vocab, (n, args.prompt_len), generator=gen).tolist()


def engine_for(model, dmc, policy, args, max_batch: int, num_pages: int | None,
               overlap: bool = False):
    """An engine whose step may prefill every prompt at once (as many as the pages allow), so
    that the batch starts decoding together."""
    from dmc.inference import Engine

    return Engine(model, dmc, policy=policy and policy(), page_size=args.page_size,
                  max_batch=max_batch, max_seq_len=args.prompt_len + args.gen_len,
                  num_pages=num_pages, chunk_size=args.chunk_size,
                  step_tokens=step_tokens(args, max_batch), seed=args.seed,
                  cuda_graphs=graphs_for(policy, args), overlap=overlap)


def with_overlap(models: dict, how: str) -> dict:
    """``models`` (``{mode: (model, dmc, policy)}``) with the modes ``Engine(overlap=True)``
    serves (every one without a policy: those the CUDA graphs serve) overlapped (``how`` "on")
    or also overlapped ("both": each followed by its twin, the same model); "off": unchanged."""
    if how == "off":
        return models
    out = {}
    for mode, built in models.items():
        served = built[2] is None
        if how == "both" or not served:
            out[mode] = built
        if served:
            out[mode._replace(overlap=True)] = built
    return out


def step_tokens(args, max_batch: int) -> int:
    """An engine step's token budget: every prompt at once, or the batch's decode tokens plus
    ``--prefill-tokens`` of prompts (at least one chunk, as the scheduler needs)."""
    every = max_batch * (args.prompt_len + 1)
    if args.prefill_tokens is None:
        return every
    return min(every, max_batch + max(args.prefill_tokens, args.chunk_size))


ACTIVATION_RESERVE = 6 * 2**30  # bytes a GPU keeps beside the caches: prefill activations,
# CUDA graphs, the allocator's slack


def device_budget(requested: int, free: int, modes: int, given: bool) -> int:
    """The cache budget per mode on a GPU with ``free`` bytes once the models are loaded:
    ``requested``, or, when that does not fit ``modes`` caches beside
    :data:`ACTIVATION_RESERVE`, the share that does (``given``: the user's ``--budget-mib``,
    refused instead of lowered: ValueError)."""
    fits = (free - ACTIVATION_RESERVE) // modes
    if requested <= fits:
        return requested
    if given or fits <= 0:
        raise ValueError(f"--budget-mib: {modes} caches of {requested / 2**20:g} MiB do not fit "
                         f"the {free / 2**30:.1f} GiB free on this GPU beside "
                         f"{ACTIVATION_RESERVE / 2**30:g} GiB for activations; at most "
                         f"{max(fits, 0) / 2**20:.0f} MiB per mode")
    return fits


def graphs_for(policy, args) -> bool:
    """``--cuda-graphs`` where the engine supports it: every mode but the policies."""
    return args.cuda_graphs and policy is None


def probe(mode, model, dmc, policy, args, params) -> dict:
    """Pages and policy state one sequence holds at its full length, the measured CR, the
    cache's DMC window (None: exact, vanilla or DMS) and the dtype of its ring, DMS window (None:
    not DMS) and merge delay (None: not delayed merging), and the most pages the scheduler
    reserved for one sequence's decode step beyond those the step took
    (``step_reserve_per_seq``, 0 for vanilla)."""
    from dmc.inference import CompressionStats
    from dmc.inference.scheduler import worst_new_pages

    count = probe_count(mode, args)
    engine = engine_for(model, dmc, policy, args, count, probe_pages(mode, args, count))
    for prompt in prompts_for(args, count, args.seed + 1):
        engine.add_request(prompt, params)
    results, state, reserve, last = [], 0, 0, None
    while engine.has_unfinished():
        decoding = [s for s in engine.scheduler.running if s.decoding]
        worst = sum(worst_new_pages(engine.cache, [s.slot for s in decoding], 1))  # settles
        held = engine.cache.pages_in_use
        if last is not None:  # the last step decoded only: reserved `need`, took held - before
            decoded, need, before = last
            reserve = max(reserve, math.ceil((need - (held - before)) / decoded))
        prefilled = engine.stats.prefill_tokens
        ended = engine.step()
        results += ended
        decode_only = not ended and engine.stats.prefill_tokens == prefilled
        last = (len(decoding), worst, held) if decoding and decode_only else None
        for seq in engine.scheduler.running:
            state = max(state, engine.sequence_bytes(seq.slot)["policy_state"])
    failed = [r.error for r in results if r.error]
    if failed:
        raise RuntimeError(f"{mode.label}: probe request did not finish: {failed[0]}")
    comp = CompressionStats.combine([r.compression for r in results])
    return {"window": engine.cache.window, "ring_dtype": engine.cache.open_k.dtype,
            "dms_window": getattr(engine.cache, "dms_window", None),
            "merge_delay": getattr(engine.cache, "merge_delay", None),
            "pages_probed": [r.kv_pages for r in results],  # each sequence's at its end
            "peak_pages_per_seq": math.ceil(engine.stats.peak_pages / count),
            "probe_preemptions": engine.stats.preemptions,  # 0 unless its pool ran short
            "policy_state_per_seq": state,
            "step_reserve_per_seq": reserve,
            "kv_bytes_per_seq": sum(r.kv_bytes for r in results) / len(results),
            "probe_cr": comp.overall, "probe_cr_per_layer": comp.per_layer}


VARIABLE = FORCED + ("model",)  # the modes whose pages vary with the text: learned or forced
# decisions; the others' (vanilla, GQA, a policy's fixed budgets) need a few sequences only


def probe_count(mode, args) -> int:
    """Sequences the probe of ``mode`` runs: ``--probe``, or at most 4 where a sequence's pages
    do not vary (no spread to estimate, and 64 uncompressed gpu-preset sequences would hold
    20 GiB)."""
    return args.probe if mode.kind in VARIABLE else min(args.probe, 4)


def probe_pages(mode, args, count: int) -> int | None:
    """The page pool of a probe of ``count`` sequences: for a forced CR, 1.5 times the pages
    they hold at that CR and a page per head more (a 64-sequence probe of DMC 4x at the gpu
    preset: 7.5 GiB, not the 20 of room for them uncompressed); None (that room) otherwise."""
    if mode.kind not in FORCED:
        return None
    heads = count * args.layers * args.groups
    full = heads * math.ceil((args.prompt_len + args.gen_len) / args.page_size)
    return math.ceil(1.5 * full / mode.value) + heads


def batch_pages(row: dict):
    """``batch -> pages`` a batch of the probed mode holds at its longest, the scheduler's step
    reservation included: :func:`~dmc.eval.kv_budget.batch_pages_bound` over the probed
    sequences' pages (their spread, where enough were probed), at least the probe's peak per
    sequence (a peak before the end: a policy's prefill schedule)."""
    bound = batch_pages_bound(row["pages_probed"])
    floor, reserve = row["peak_pages_per_seq"], row["step_reserve_per_seq"]
    return lambda batch: max(bound(batch), batch * floor) + batch * reserve


def run_all(args, models: dict, budget: int, save=None) -> list[dict]:
    """Probe every mode, size its batch to the budget, run all modes interleaved; the rows.
    ``save(rows)``, when given, receives the rows measured so far every
    :data:`PARTIAL_EVERY` interleaved steps (no rooflines: a run stopped by a time limit still
    leaves figures)."""
    from dmc.inference import SamplingParams

    params = SamplingParams(max_new_tokens=args.gen_len, temperature=1.0)
    probed = {}  # every mode probed before any timed cache takes the memory: a probe of many
    for mode, built in models.items():  # sequences holds their uncompressed pages at first
        twin = next((m for m in probed if models[m] is built), None)  # an overlapped twin
        probed[mode] = probed[twin] if twin else probe(mode, *built, args, params)
    if args.cuda:  # the probes' pools back to the device whole: a timed cache split out of a
        gc.collect()  # cached probe segment would strand its rest
        torch.cuda.empty_cache()
    runs, rows = [], {}
    for mode, (model, dmc, policy) in models.items():
        row = {"mode": mode.label, "kind": mode.kind, "target": mode.value,
               "cuda_graphs": graphs_for(policy, args), "overlap": mode.overlap,
               **probed[mode]}
        kv_heads = int(args.groups / mode.value) if mode.kind == "gqa" else args.groups
        shape = dict(num_layers=args.layers, num_kv_heads=kv_heads,
                     head_dim=args.head_dim, page_size=args.page_size,
                     window=row.pop("window"), dtype=getattr(torch, args.dtype),
                     max_seq_len=args.prompt_len + args.gen_len,
                     dms_window=row.pop("dms_window"), merge_delay=row.pop("merge_delay"),
                     ring_dtype=row.pop("ring_dtype"),
                     device="cuda" if args.cuda else "cpu")
        pages_for = batch_pages(row)
        batch, num_pages = fit_batch(budget, pages_for, row["policy_state_per_seq"], shape,
                                     headroom_pages=args.layers * kv_heads)
        if batch == 0:
            raise SystemExit(f"--budget-mib: {args.budget_mib} MiB holds no {mode.label} "
                             f"sequence of {args.prompt_len + args.gen_len} tokens")
        engine = engine_for(model, dmc, policy, args, batch, num_pages, mode.overlap)
        row["memory"] = cache_allocation(num_pages=num_pages, max_seqs=batch, **shape)
        row["memory"]["policy_state"] = batch * row["policy_state_per_seq"]
        row.update(batch=batch, num_pages=num_pages,
                   pages_per_seq=math.ceil(pages_for(max(batch, 1)) / max(batch, 1)))
        rows[mode] = row
        runs.append(Run(mode, engine, batch, prompts_for(args, batch, args.seed + 2), params))
        progress(f"{mode.label}: probe CR {row['probe_cr']:.2f}, {row['pages_per_seq']} pages "
                 f"per sequence, batch {batch}")
    # overlapped modes keep a step in flight between their steps: every mode then runs
    # blocks of OVERLAP_BLOCK steps in turn, not single steps
    block = OVERLAP_BLOCK if any(run.mode.overlap for run in runs) else 1
    rounds, profiled_round = 0, args.gen_len // 2 // block if args.profile else -1
    while any(r.engine.has_unfinished() and not r.error for r in runs):
        shift = rounds % len(runs)
        for run in runs[shift:] + runs[:shift]:
            for index in range(block):
                if run.error or not run.engine.has_unfinished():
                    break
                try:
                    if rounds == profiled_round and index == block // 2:
                        profile_step(run, args.cuda)
                    else:
                        run.step(args.cuda, first=index == 0)
                except Exception as error:  # one mode's fault must not lose the others' figures
                    run.error = f"{type(error).__name__}: {error}"
                    progress(f"{run.mode.label}: stopped by {run.error}")
        rounds += 1
        if rounds * block % 256 == 0:
            progress(f"{rounds * block} interleaved steps")
        if save is not None and rounds * block % PARTIAL_EVERY < block:
            save(measure(args, runs, rows))
    progress(f"timed run done after {rounds} rounds")
    print_profile_excess(runs)
    for run in runs:
        failed = [r.error for r in run.results if r.error]
        if failed and not run.error:
            raise RuntimeError(f"{run.mode.label}: {len(failed)} requests did not finish: "
                               f"{failed[0]}")
        steps = run.steady(args.steady)[0]
        if steps < args.steady and not run.error:
            print(f"warning: {run.mode.label}: only {steps} decode steps ran at the full batch "
                  f"(--steady {args.steady}); the figure averages those")
    measure(args, runs, rows)
    add_rooflines(args, [r for r in runs if not r.error], rows)
    return list(rows.values())


def measure(args, runs: list[Run], rows: dict) -> list[dict]:
    """Each row's figures from its run's steps and finished requests so far (a failed run: its
    ``error``), each as a multiple of vanilla's; returns the rows."""
    from dmc.inference import CompressionStats

    for run in runs:
        row = rows[run.mode]
        if run.error:
            row["error"] = run.error
            continue
        steps, tokens, seconds, median = run.steady(args.steady)
        stats = run.engine.stats
        row.update(
            steady_steps=steps, steady_tokens=tokens, steady_seconds=seconds,
            tokens_per_s=tokens / seconds if seconds else 0.0,
            median_step_tokens_per_s=run.batch / median if median else 0.0,
            # overlapped, a step's time covers its host work and the device work of another
            median_host_seconds=None if run.mode.overlap else run.host_seconds(args.steady),
            all_decode_tokens_per_s=stats.decode_tokens / max(stats.decode_seconds, 1e-9),
            prefill_tokens_per_s=stats.prefill_tokens / max(stats.prefill_seconds, 1e-9),
            wall_seconds=sum(s[0] for s in run.steps), preemptions=stats.preemptions,
            peak_pages=stats.peak_pages,
        )
        if run.results:
            comp = CompressionStats.combine([r.compression for r in run.results])
            row.update(measured_cr=comp.overall, measured_cr_per_layer=comp.per_layer)
    done = [r for r in rows.values() if "error" not in r and "tokens_per_s" in r]
    for row in done:  # against vanilla served the same way (with or without overlap)
        vanilla = next((r for r in sorted(done, key=lambda r: r["overlap"] != row["overlap"])
                        if r["kind"] == "vanilla"), None)
        for key, ratio in (("tokens_per_s", "speedup_vs_vanilla"),
                           ("median_step_tokens_per_s", "median_speedup_vs_vanilla")):
            row[ratio] = row[key] / vanilla[key] if vanilla and vanilla[key] else None
    return list(rows.values())


def profile_step(run: Run, cuda: bool, kernels: int = 25) -> None:
    """One step of ``run`` under torch.profiler: prints (stderr) its host time, the device time
    of its kernels, how many ran, and the ``kernels`` busiest ones; keeps each op's self time
    (ms) in ``run.profile_ms`` for :func:`print_profile_excess`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run.step(cuda)
    run.profiled.append(run.steps.pop())
    events = prof.key_averages()
    device = device_activity(prof) if cuda else {"kernel_s": 0.0, "launches": 0}
    device_us, launches = device["kernel_s"] * 1e6, device["launches"]
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    run.profile_ms = {e.key: getattr(e, sort) / 1e3 for e in events}
    print(f"profile of one {run.mode.label} step (batch {run.batch}): "
          f"{run.profiled[-1][0] * 1e3:.2f} ms wall, kernels {device_us / 1e3:.2f} ms on the "
          f"device ({launches} launches)\n{events.table(sort_by=sort, row_limit=kernels)}",
          file=sys.stderr, flush=True)


def print_profile_excess(runs: list[Run], count: int = 15) -> None:
    """For each profiled mode but vanilla, the ``count`` ops whose self time in its profiled
    step exceeds vanilla's (served the same way, with or without overlap) the most (stderr):
    where a mode's step spends more than vanilla's."""
    profiled = [run for run in runs if run.profile_ms]
    for run in profiled:
        vanilla = next((v for v in sorted(profiled, key=lambda v: v.mode.overlap
                                          != run.mode.overlap) if v.mode.kind == "vanilla"), None)
        if vanilla is None or run.mode.kind == "vanilla":
            continue
        excess = sorted(((ms - vanilla.profile_ms.get(name, 0.0), name)
                         for name, ms in run.profile_ms.items()), reverse=True)[:count]
        print(f"{run.mode.label}: the {count} ops whose time in the profiled step exceeds "
              f"{vanilla.mode.label}'s most (batch {run.batch} against {vanilla.batch})\n"
              + "\n".join(f"  {ms:+9.3f} ms  {name[:100]}" for ms, name in excess if ms > 0),
              file=sys.stderr, flush=True)


def add_rooflines(args, runs: list[Run], rows: dict) -> None:
    """Each row's steady step cost (``step_bytes``: weights, K/V pages held, ``dmc_state``: the
    DMC merge state, the DMS window ring, or both the merge state and the raw ring under delayed
    merging; ``step_flops``, over paged and ring slots) and
    :func:`~dmc.eval.roofline.roofline` at its median step time, against the machine now."""
    machine = measure_machine(torch.device("cuda" if args.cuda else "cpu"),
                              getattr(torch, args.dtype))
    for run in runs:
        row = rows[run.mode]
        weights, linear = weight_bytes_and_flops(run.engine.model, run.batch)
        kv, slots = run.steady_cache(args.steady)
        memory = row["memory"]
        state = 0
        if run.engine.kv.keeps_merge_state:
            state = memory.get("dms_ring", memory["dmc_state"] + memory.get("delay_ring", 0))
        cache = run.engine.cache
        step_bytes = {"weights": weights, "kv": kv, "dmc_state": state}
        step_bytes["total"] = sum(step_bytes.values())
        flops = linear + attention_flops(slots, args.heads // cache.num_kv_heads, cache.head_dim)
        row.update(step_bytes=step_bytes, step_flops=flops, machine=machine._asdict(),
                   roofline=roofline(step_bytes["total"], flops, run.steady(args.steady)[3],
                                     machine))


def table(rows) -> str:
    """The rows as text: tok/s over the steady steps and from their median step time, each as a
    multiple of vanilla's."""
    header = ("mode", "measured CR", "pages/seq", "batch", "budget used", "steady steps",
              "tok/s", "x vanilla", "median tok/s", "x vanilla", "host ms/step", "preempt",
              "MiB/step", "GB/s", "roofline")
    first = max([12] + [len(r["mode"]) for r in rows])
    lines = [" | ".join([f"{header[0]:>{first}}"] + [f"{h:>12}" for h in header[1:]])]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['mode']:>{first}} | failed: {r['error']}")
            continue
        def ratio(key):
            return "-" if r[key] is None else f"{r[key]:.2f}"

        cells = (r["mode"], f"{r['measured_cr']:.2f}", str(r["pages_per_seq"]), str(r["batch"]),
                 f"{r['memory']['total'] / 2**20:.2f} MiB", str(r["steady_steps"]),
                 f"{r['tokens_per_s']:.1f}", ratio("speedup_vs_vanilla"),
                 f"{r['median_step_tokens_per_s']:.1f}", ratio("median_speedup_vs_vanilla"),
                 "-" if r["median_host_seconds"] is None else
                 f"{r['median_host_seconds'] * 1e3:.2f}", str(r["preemptions"]),
                 f"{r['step_bytes']['total'] / 2**20:.1f}",
                 f"{r['roofline']['achieved_bytes_per_s'] / 1e9:.2f}",
                 f"{r['roofline']['fraction']:.3f} {r['roofline']['bound'][:3]}")
        lines.append(" | ".join([f"{cells[0]:>{first}}"] + [f"{c:>12}" for c in cells[1:]]))
    return "\n".join(lines)


def kernel_tuning(args) -> dict | None:
    """On CUDA the Triton kernels' launch settings for this GPU
    (:func:`dmc.inference.kernels.tuning.tuning_for`: ``$DMC_KERNEL_TUNING``, a shipped file or
    the defaults), as the run's JSON records them."""
    if not args.cuda:
        return None
    from dmc.inference.kernels.tuning import tuning_for

    return tuning_for(torch.device("cuda")).to_json()


def main(argv=None) -> int:
    args = parse_args(argv)
    from dmc.megatron.parallel import initialize_parallel

    if not args.cuda:
        torch.set_num_threads(max(1, min(args.threads, os.cpu_count() or 1)))
    initialize_parallel(1, 1, seed=args.seed)
    models = with_overlap(build_models(args), args.overlap)
    budget = int(args.budget_mib * 2**20)
    if args.cuda:
        torch.cuda.empty_cache()  # the calibration forwards' blocks count as free again
        try:
            budget = device_budget(budget, torch.cuda.mem_get_info()[0], len(models),
                                   args.budget_given)
        except ValueError as error:
            print(f"decode_throughput: {error}", file=sys.stderr)
            return 2
        if budget != int(args.budget_mib * 2**20):
            progress(f"--budget-mib: the preset's {args.budget_mib:g} MiB per mode do not fit "
                     f"{len(models)} modes on this GPU; {budget / 2**20:.0f} MiB each")
            args.budget_mib = budget / 2**20
    device = torch.cuda.get_device_name() if args.cuda else "cpu (PyTorch kernels)"
    config = {k: v for k, v in vars(args).items() if k != "mode_list"}
    tuning = kernel_tuning(args)

    def save(rows, partial=True):
        if args.out:  # a partial file first, renamed: a kill leaves the last whole one
            with open(args.out + ".partial", "w") as f:
                json.dump({"device": device, "args": config, "budget_bytes": budget,
                           "kernel_tuning": tuning, "partial": partial, "rows": rows}, f,
                          indent=2)
            os.replace(args.out + ".partial", args.out)

    rows = run_all(args, models, budget, save)
    print(f"decode throughput on {device} ({args.preset} preset): {args.layers} layers, hidden "
          f"{args.hidden}, {args.heads} heads / {args.groups} KV heads, {args.dtype}, prompt "
          f"{args.prompt_len} + {args.gen_len} generated, page {args.page_size}, budget "
          f"{args.budget_mib:g} MiB per mode, tokens/s over the last {args.steady} full-batch "
          f"decode steps, modes interleaved step by step"
          + (f", model {args.model}" if args.model else ", random weights")
          + (", decode steps of every mode but the policies through DecodeGraphs (CUDA graphs "
             "on a GPU)" if args.cuda_graphs else ""))
    print(table(rows))
    if tuning:
        print("Triton kernels' launch settings: " + json.dumps(tuning))
    if args.out:
        save(rows, partial=False)
        print(f"wrote {args.out}")
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
