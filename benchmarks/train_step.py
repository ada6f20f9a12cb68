"""Training-step throughput and peak memory of DMC vs vanilla attention on one machine and model.

Every run uses the same GPTModel (DMC layer spec); "vanilla" switches the layers to megatron's
own attention, "dmc-<backend>" to train mode (Gumbel decisions, window-grouped accumulation,
CR loss) with the attention of :func:`dmc.ops.dmc_attention` computed through the dense
additive bias, FlexAttention ("flex": the decisions' gradient through the mask by its atomic
adds), FlexAttention with that gradient from a swapped forward ("flex-transposed") or from
its key gradient in the zeroed decision channel ("flex-channel"; both
:mod:`dmc.ops.flex_bias_grad`) (``--backends``; default flex-channel, flex-transposed, dense
and flex on CUDA, dense on the CPU, where FlexAttention has no backward), and Eq. 9's window
sums through ``--accumulate`` (default the fused Triton kernels, then the PyTorch path for
comparison, on CUDA; PyTorch on the CPU):
rows ``dmc-<backend>`` with the first, and ``dmc-<last backend>+<accumulate>-sums`` with each
other one. ``--compile on`` runs the DMC rows with ``dmc.compile_elementwise`` (the
decisions and the rotation through ``torch.compile``), ``--compile both`` adds a
``<row>+compiled`` twin after each (the compilation happens in the warm-up steps);
``--merge-delays 0,16`` runs every DMC row also with ``dmc.merge_delay`` 16 (DMC with delayed
merging, ``<row>+delay16``).
Step time is the median of ``--steps`` after
``--warmup``, "host" the median of the host's time to issue a step (before waiting for the
device), "kernels" the summed device time of the profiled step's kernels and "idle" the time
the device ran none between its first and last (``--profile``, CUDA; the longest idle
stretches printed with the kernels around them, and the lines where one more step, under
``torch.cuda.set_sync_debug_mode("warn")``, makes the host wait for the device): a step much
longer than its kernels, with a host time close to it, is bound by the host or waits for the
device inside; peak memory is the CUDA allocator's peak over those steps (none on the CPU);
"saved" is what autograd keeps for the backward of one step (the bytes of the distinct storages
packed by ``saved_tensors_hooks``, parameters left out: the activation memory, on any device).
``--kept-only`` measures that alone (one forward per mode, no timed steps: a large shape on the
CPU); ``--by-site N`` also prints, per mode, the N call sites (innermost ``dmc`` or megatron
frame) whose saved storages weigh most; ``--profile N`` runs one more step of each mode under
torch.profiler and prints its N ops with the most self time (CUDA kernels on a GPU: where a DMC
step's time goes); ``--copy-sites N`` profiles that step with Python stacks and prints the N
(op, call site) pairs of the ops that copy or fill memory with the most self time (which
function of ``dmc`` or megatron, or which autograd node of the backward, launched them).
Prints each row's step time as it is measured and a table at the end, and rewrites the JSON
after every row (a run stopped by a time limit keeps the rows it measured); a DMC row that
fails (say, a kernel that does not compile on that GPU) is recorded with its error, the others
still run, and the exit code is 1.

    python benchmarks/train_step.py --layers 4 --hidden 256 --heads 8 --seq 256 --batch 8
    python benchmarks/train_step.py --layers 2 --hidden 2048 --heads 16 --ffn 5632 \
        --vocab 32000 --seq 2048 --batch 1 --dtype bfloat16 --kept-only --by-site 8
"""
from __future__ import annotations

import argparse
import collections
import sys
import json
import time
import traceback
import warnings
from pathlib import Path

import torch

from dmc.eval.device_activity import device_activity
from dmc.ops.attention import BACKENDS

warnings.filterwarnings("ignore")


def saved_activation_bytes(model, runtime, mode, tokens, positions,
                           sites: collections.Counter | None = None) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of one forward,
    parameters excluded; with ``sites``, each storage's bytes also counted under the call site
    that first saved it (``file:line`` of the innermost ``dmc`` or megatron frame)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in storages:
            storages[storage.data_ptr()] = storage.nbytes()
            if sites is not None:
                sites[saving_site(tensor)] += storage.nbytes()
        # a detached alias: the tensor itself, an output its own node saves, would make a
        # cycle through that node that neither refcounting nor Python's gc frees, and every
        # row after would count this forward's activations in its peak
        return tensor.detach()

    runtime.start_step(0, mode, target_cr=2.0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens, positions, None, labels=tokens).float().mean()
    del loss  # kept until here: a freed storage's address could be reused and merged
    return sum(storages.values())


def saving_site(tensor: torch.Tensor) -> str:
    """``file:line [shape] dtype`` of the innermost ``dmc`` or megatron frame saving ``tensor``
    (the CPU shim ``dmc/megatron/compat.py`` skipped)."""
    frames = [f for f in traceback.extract_stack()[:-2] if ours(f.filename)]
    where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
    return f"{where} {list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def ours(path: str) -> bool:
    """Whether a frame's file is one of ``dmc``'s (a relative path under a test runner too) or
    megatron's, the CPU shim ``dmc/megatron/compat.py`` left out."""
    return (path.startswith("dmc/") or "/dmc/" in path or "megatron/core" in path) \
        and "compat.py" not in path


def train_step(model, runtime, mode, tokens, positions, optimizer, step: int) -> float:
    """One optimizer step of ``mode`` on ``tokens``, waiting for the device at its end; returns
    the seconds the host took to issue it (up to that wait: on a GPU, a step whose host time is
    close to its whole time is bound by the host, or waits for the device inside)."""
    start = time.perf_counter()
    runtime.start_step(step, mode, target_cr=2.0)
    loss = model(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    issued = time.perf_counter() - start
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return issued


def measure(model, runtime, mode, tokens, positions, steps, warmup, profile_ops=0,
            copy_sites=0):
    """A dict of ``steps`` train steps: tokens_per_s, step_s (the median step), host_s (the
    median of the host's time to issue a step), peak_bytes (None on the CPU), and of one more
    step under torch.profiler its ``profile_ops`` busiest ops (``ops``), its ``copy_sites``
    busiest data-movement call sites (``copy_sites``) and what its device did (``kernel_s``,
    ``launches``, ``idle_s``, ``gaps``: :func:`device_activity`; None and none on the CPU),
    and with ``profile_ops`` on CUDA, where one more step waits for the device (``syncs``,
    :func:`sync_sites`; None otherwise)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    timings, issued = [], []
    cuda = torch.cuda.is_available()
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
            if i == warmup:
                torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        host = train_step(model, runtime, mode, tokens, positions, optimizer, i)
        if i >= warmup:
            timings.append(time.perf_counter() - start)
            issued.append(host)
    seconds = sorted(timings)[len(timings) // 2]
    peak = torch.cuda.max_memory_allocated() if cuda else None
    profiled = busiest_ops(lambda: train_step(model, runtime, mode, tokens, positions,
                                              optimizer, warmup + steps),
                           profile_ops, copy_sites)
    syncs = sync_sites(lambda: train_step(model, runtime, mode, tokens, positions, optimizer,
                                          warmup + steps + 1)) if cuda and profile_ops > 0 else None
    return dict(tokens_per_s=tokens.numel() / seconds, step_s=seconds,
                host_s=sorted(issued)[len(issued) // 2], peak_bytes=peak, syncs=syncs,
                **profiled)


SYNC_WARNING = "synchroniz"  # in the warning of torch.cuda.set_sync_debug_mode("warn")


def sync_sites(step) -> dict[str, int]:
    """Where ``step()`` makes the host wait for the device (``.item()``, a copy to the host,
    ``nonzero``: what ``torch.cuda.set_sync_debug_mode("warn")`` warns about; the step's own
    final ``synchronize`` is not among them), as ``{"file:line": count}`` of the Python line
    that called the op, most first. A step that waits inside leaves the device idle while the
    host catches up."""
    sites = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if SYNC_WARNING in str(warning.message):
            sites[f"{Path(warning.filename).name}:{warning.lineno}"] += 1
    return dict(sites.most_common())


COPY_OPS = ("aten::copy_", "aten::cat", "aten::_to_copy", "aten::clone", "aten::fill_",
            "aten::zero_", "aten::contiguous")  # the ops that move or fill memory


def busiest_ops(step, count: int, copy_sites: int = 0) -> dict:
    """``ops``: every op of ``step()`` under torch.profiler (none when ``count`` and
    ``copy_sites`` are 0), by self time on the device (CUDA kernels) or, without CUDA, on the
    CPU, most first: name, milliseconds, calls, one entry a name (the profiler lists a Triton
    kernel's launch and the kernel, or a region's host and device spans, under one name: the
    longer is kept); ``copy_sites``: the ``copy_sites`` (op, call site) pairs of
    :data:`COPY_OPS` with the most self time (:func:`op_sites`); and ``kernel_s``, ``idle_s``
    and ``gaps`` of :func:`device_activity` (None, None and none without CUDA: against the
    step's time, how busy the step keeps the device, and where it waits)."""
    if count <= 0 and copy_sites <= 0:
        return {"ops": [], "copy_sites": [], "kernel_s": None, "launches": None,
                "idle_s": None, "gaps": []}
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    options = {}
    if copy_sites > 0:  # the Python stack of every op (the verbose config records it here)
        verbose = getattr(torch._C._profiler, "_ExperimentalConfig", None)
        options = dict(with_stack=True,
                       **({"experimental_config": verbose(verbose=True)} if verbose else {}))
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                 **options) as prof:
        step()
    attribute = "self_device_time_total" if cuda else "self_cpu_time_total"
    return {"ops": one_per_name(prof.key_averages(), attribute),
            "copy_sites": op_sites(prof, attribute, copy_sites) if copy_sites > 0 else [],
            **(device_activity(prof) if cuda else {"kernel_s": None, "launches": None,
                                                    "idle_s": None, "gaps": []})}


def one_per_name(averages, attribute: str) -> list[dict]:
    """``{name, ms, calls}`` of each name among profiler averages (``key``, ``count`` and the
    microseconds ``attribute``), the longest entry where a name has several, most first."""
    longest = {}
    for e in averages:
        op = {"name": e.key, "ms": getattr(e, attribute) / 1e3, "calls": e.count}
        if e.key not in longest or op["ms"] > longest[e.key]["ms"]:
            longest[e.key] = op
    return sorted(longest.values(), key=lambda op: -op["ms"])


BACKWARD = "autograd::engine::evaluate_function: "  # the profiler's name of a backward node


def op_sites(prof, attribute: str, count: int) -> list[dict]:
    """The ``count`` (op of :data:`COPY_OPS`, call site) pairs of a profile with the most self
    time: name, site (the innermost ``dmc`` or megatron function on the op's Python stack; for
    an op without one, run by the autograd engine, ``backward of <node>``, the backward node
    that ran it, e.g. ``MulBackward0``; else the innermost frame), milliseconds, calls."""
    totals = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.name not in COPY_OPS:
            continue
        frames = [frame for frame in event.stack or [] if ours(frame)]
        site = (frames[0] if frames else backward_node(event)
                or (event.stack[0] if event.stack else "(autograd engine)"))
        total = totals[(event.name, site.rsplit("/", 1)[-1])]
        total[0] += getattr(event, attribute) / 1e3
        total[1] += 1
    rows = [{"name": name, "site": site, "ms": ms, "calls": calls}
            for (name, site), (ms, calls) in totals.items()]
    return sorted(rows, key=lambda row: -row["ms"])[:count]


def backward_node(event) -> str | None:
    """``backward of <node>``: the autograd node among ``event``'s enclosing profiler events,
    None when the op ran outside the backward."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(BACKWARD):
            return f"backward of {parent.name.removeprefix(BACKWARD)}"
        parent = parent.cpu_parent
    return None


def excess_ops(ops: list[dict], base: list[dict], count: int) -> list[dict]:
    """The ``count`` ops of ``ops`` whose self time exceeds ``base``'s (vanilla's) the most:
    name, excess milliseconds, calls here and there (where a DMC step's extra time goes)."""
    there = {op["name"]: op for op in base}
    excess = [{"name": op["name"], "ms": op["ms"] - there.get(op["name"], {}).get("ms", 0.0),
               "calls": op["calls"], "vanilla_calls": there.get(op["name"], {}).get("calls", 0)}
              for op in ops]
    return sorted((e for e in excess if e["ms"] > 0), key=lambda e: -e["ms"])[:count]


def row_plan(backends: list[str], sums: list[str], compile_rows: str = "off",
             delays: tuple[int, ...] = (0,)) -> list[tuple]:
    """``(mode, row name, attention backend, accumulate backend, compiled, merge delay)`` of
    every row: vanilla, each attention backend with the first accumulate backend, then the last
    attention backend with each other accumulate backend (one comparison of the window sums is
    enough: they do not depend on the attention); ``compile_rows`` "on": the DMC rows with
    ``dmc.compile_elementwise``, "both": each DMC row then its ``+compiled`` twin; each of
    those once per ``delays`` (``dmc.merge_delay``; a row of delay d > 0 named ``+delayD``)."""
    dmc = ([(f"dmc-{b}", b, sums[0]) for b in backends]
           + [(f"dmc-{backends[-1]}+{a}-sums", backends[-1], a) for a in sums[1:]])
    variants = {"off": (False,), "on": (True,), "both": (False, True)}[compile_rows]
    return [("vanilla", "vanilla", None, None, False, 0)] + [
        ("train", name + ("+compiled" if compiled else "") + (f"+delay{delay}" if delay else ""),
         backend, accumulate, compiled, delay)
        for delay in delays for name, backend, accumulate in dmc for compiled in variants]


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
                        "flex-channel, flex-transposed, dense, flex (default: all four on CUDA, "
                        "in this order; dense on the CPU)")
    parser.add_argument("--accumulate", help="comma separated backends of Eq. 9's window sums "
                        "(dmc.accumulate_backend: torch, triton; default triton,torch on CUDA, "
                        "torch on the CPU)")
    parser.add_argument("--compile", choices=["off", "on", "both"], default="off",
                        help="DMC rows with dmc.compile_elementwise (torch.compile of the "
                             "decisions and the rotation): off, on, or both (a twin row each)")
    parser.add_argument("--merge-delays", default="0",
                        help="comma separated dmc.merge_delay of the DMC rows (DMC with delayed "
                             "merging for d > 0, a row each: e.g. 0,16)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="parameters' dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--kept-only", action="store_true",
                        help="measure the activations kept for the backward only (no timed steps)")
    parser.add_argument("--by-site", type=int, default=0, metavar="N",
                        help="print the N call sites whose saved storages weigh most, per mode")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the timed steps, one more step of each mode under "
                             "torch.profiler: its N ops with the most self time (CUDA kernels "
                             "on a GPU) printed and in the JSON as busiest_ops, and for a DMC "
                             "row the N whose time exceeds vanilla's most (excess_over_vanilla)")
    parser.add_argument("--copy-sites", type=int, default=0, metavar="N",
                        help="profile that step with Python stacks and print, per mode, the N "
                             "(op, call site) pairs of the ops that copy or fill memory (copy_, "
                             "cat, dtype conversions, clone, fill_) with the most self time "
                             "(copy_sites in the JSON)")
    parser.add_argument("--out", default="benchmarks/results/train_step.json")
    args = parser.parse_args(argv)
    for name in ("layers", "hidden", "heads", "ffn", "vocab", "seq", "batch", "window", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: must be >= 1, got {getattr(args, name)}")
    for flag, value in (("--by-site", args.by_site), ("--profile", args.profile),
                        ("--copy-sites", args.copy_sites), ("--warmup", args.warmup)):
        if value < 0:
            parser.error(f"{flag}: must be >= 0, got {value}")
    if args.hidden % args.heads:
        parser.error(f"--hidden: accepted multiples of --heads ({args.heads}), got {args.hidden}")
    if args.groups is not None and (args.groups < 1 or args.heads % args.groups):
        parser.error(f"--groups: accepted divisors of --heads ({args.heads}), got {args.groups}")
    args.backends = args.backends or ("flex-channel,flex-transposed,dense,flex"
                                      if torch.cuda.is_available() else "dense")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    accepted = [b for b in BACKENDS if b != "auto"]
    if not backends or set(backends) - set(accepted):
        parser.error(f"--backends: accepted {', '.join(accepted)} (comma separated), got "
                     f"{args.backends!r}")
    if set(backends) - {"dense"} and not torch.cuda.is_available():
        parser.error("--backends: the flex backends need CUDA (FlexAttention has no "
                     "backward on the CPU)")
    args.accumulate = args.accumulate or ("triton,torch" if torch.cuda.is_available()
                                          else "torch")
    sums = [a.strip() for a in args.accumulate.split(",") if a.strip()]
    if not sums or set(sums) - {"torch", "triton"}:
        parser.error(f"--accumulate: accepted torch, triton (comma separated), got "
                     f"{args.accumulate!r}")
    try:
        delays = tuple(int(d) for d in args.merge_delays.split(","))
    except ValueError:
        delays = ()
    if not delays or min(delays) < 0 or max(delays) >= args.seq - 1:
        parser.error(f"--merge-delays: accepted integers >= 0 and < --seq - 1 = {args.seq - 1} "
                     f"(comma separated; a longer delay leaves no query a merged slot to see), "
                     f"got {args.merge_delays!r}")
    if "triton" in sums and not torch.cuda.is_available():
        parser.error("--accumulate: triton needs CUDA here (the Triton interpreter is for tests)")

    from dmc.megatron.model import build_gpt_model, llama_transformer_config
    from dmc.megatron.parallel import initialize_parallel
    from dmc.megatron.runtime import DMCConfig, DMCRuntime

    initialize_parallel(1, 1, seed=0)
    dtype = getattr(torch, args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32"))
    config = llama_transformer_config(args.layers, args.hidden, args.heads, args.ffn,
                                      num_query_groups=args.groups, params_dtype=dtype)
    runtime = DMCRuntime(DMCConfig(window=args.window))
    model = build_gpt_model(config, args.vocab, args.seq, dmc=runtime)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    positions = torch.arange(args.seq, device=device).expand(args.batch, args.seq)
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rows, ops = {}, {}
    for mode, name, backend, accumulate, compiled, delay in row_plan(backends, sums,
                                                                       args.compile, delays):
        if backend:
            runtime.config.attention_backend = backend
            runtime.config.accumulate_backend = accumulate
            runtime.config.compile_elementwise = compiled
            runtime.config.merge_delay = delay
        try:
            rows[name] = measure_row(args, model, runtime, mode, name, tokens, positions)
            ops[name] = rows[name].pop("ops", [])
            if mode != "vanilla" and ops[name] and ops.get("vanilla"):
                excess = rows[name]["excess_over_vanilla"] = excess_ops(
                    ops[name], ops["vanilla"], args.profile)
                print(f"{name}: the {len(excess)} ops whose self time exceeds vanilla's most")
                for op in excess:
                    print(f"  {op['ms']:+10.2f} ms  x{op['calls']:<5} (vanilla x"
                          f"{op['vanilla_calls']}) {op['name']}")
        except Exception as error:  # a DMC row that fails (a kernel that does not compile on
            if mode == "vanilla":   # this GPU) leaves the others measured; the exit code says so
                raise
            rows[name] = {"error": f"{type(error).__name__}: {error}"}
            print(f"{name}: failed: {rows[name]['error']}", file=sys.stderr)
        write_results(args, device_name, rows)  # after every row: a run stopped by a time
        row = rows[name]                        # limit keeps the rows it measured
        if row.get("step_s"):
            kernels = "" if row["kernel_s"] is None else \
                (f"; in the profiled step its {row['launches']} kernels ran "
                 f"{row['kernel_s']:.3f} s and the device idled {row['idle_s']:.3f} s between "
                 f"them")
            print(f"{name}: {row['step_s']:.3f} s a step, x{row['time_vs_vanilla']:.3f} "
                  f"vanilla; the host issued it in {row['host_s']:.3f} s{kernels}", flush=True)
    failed = [name for name, row in rows.items() if "error" in row]
    print(f"{'attention':<20} {'tokens/s':>12} {'step (s)':>10} {'x vanilla time':>15} "
          f"{'host (s)':>9} {'kernels (s)':>12} {'idle (s)':>9} "
          f"{'peak GiB':>9} {'x vanilla mem':>14} {'saved GiB':>10} {'x vanilla':>10}   "
          f"device: {device_name}")

    def cell(value, form):
        return "-" if value is None else format(value, form)

    for name, row in rows.items():
        if "error" in row:
            print(f"{name:<20} failed: {row['error']}")
            continue
        peak = None if row["peak_bytes"] is None else row["peak_bytes"] / 2**30
        print(f"{name:<20} {cell(row['tokens_per_s'], '.0f'):>12} {cell(row['step_s'], '.3f'):>10} "
              f"{cell(row['time_vs_vanilla'], '.3f'):>15} {cell(row['host_s'], '.3f'):>9} "
              f"{cell(row['kernel_s'], '.3f'):>12} {cell(row['idle_s'], '.3f'):>9} "
              f"{cell(peak, '.2f'):>9} "
              f"{cell(row['memory_vs_vanilla'], '.3f'):>14} "
              f"{row['saved_bytes'] / 2**30:>10.3f} {row['saved_vs_vanilla']:>10.3f}")
    return 1 if failed else 0


def write_results(args, device_name: str, rows: dict) -> None:
    """Each measured row's ratios to vanilla (the first row), then the JSON at ``--out``."""
    base = rows["vanilla"]
    for row in (row for row in rows.values() if "error" not in row):
        row["time_vs_vanilla"] = row["step_s"] / base["step_s"] if row["step_s"] else None
        row["memory_vs_vanilla"] = (row["peak_bytes"] / base["peak_bytes"]
                                    if row["peak_bytes"] else None)
        row["saved_vs_vanilla"] = row["saved_bytes"] / base["saved_bytes"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "device": device_name, "results": rows},
                              indent=1))


def measure_row(args, model, runtime, mode, name, tokens, positions) -> dict:
    """One row of the table: the timed steps (unless ``--kept-only``), the activations kept,
    and with ``--profile`` / ``--copy-sites`` / ``--by-site`` the busiest ops, the busiest
    call sites of the ops that copy or fill memory and the heaviest saving sites (printed as
    they come)."""
    timed = (dict(tokens_per_s=None, step_s=None, host_s=None, peak_bytes=None, ops=[],
                  copy_sites=[], kernel_s=None, launches=None, idle_s=None, gaps=[],
                  syncs=None)
             if args.kept_only else
             measure(model, runtime, mode, tokens, positions, args.steps, args.warmup,
                     args.profile, args.copy_sites))
    busiest, copies = timed.pop("ops"), timed.pop("copy_sites")
    sites = collections.Counter() if args.by_site else None
    row = dict(timed, saved_bytes=saved_activation_bytes(model, runtime, mode, tokens,
                                                         positions, sites))
    if busiest and args.profile:
        row["busiest_ops"] = busiest[:args.profile]
        print(f"{name}: the {args.profile} ops of one step with the most self time")
        for op in row["busiest_ops"]:
            print(f"  {op['ms']:10.2f} ms  x{op['calls']:<5} {op['name']}")
        row["ops"] = busiest  # main() compares them with vanilla's, then drops them
    if row["syncs"] is not None:
        print(f"{name}: {sum(row['syncs'].values())} waits for the device inside a step"
              + "".join(f"\n  {count:5d}  {site}" for site, count in row["syncs"].items()))
    if row["gaps"]:
        print(f"{name}: the {len(row['gaps'])} longest stretches the device idled in the "
              f"profiled step")
        for gap in row["gaps"]:
            print(f"  {gap['ms']:10.3f} ms  after {gap['after'][:60]}  before "
                  f"{gap['before'][:60]}")
    if copies:
        row["copy_sites"] = copies
        print(f"{name}: the {len(copies)} (op, call site) pairs that copy or fill memory with "
              f"the most self time")
        for op in copies:
            print(f"  {op['ms']:10.2f} ms  x{op['calls']:<5} {op['name']:<16} {op['site']}")
    if sites is not None:
        row["saved_by_site"] = dict(sites.most_common(args.by_site))
        print(f"{name}: the {args.by_site} call sites whose saved storages weigh most")
        for site, size in sites.most_common(args.by_site):
            print(f"  {size / 2**20:10.2f} MiB  {site}")
    return row


if __name__ == "__main__":
    sys.exit(main())
