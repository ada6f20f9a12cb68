"""Achieved memory bandwidth of the paged decode kernel, as a fraction of a device copy.

The kernel reads every cached K and V slot of every (sequence, KV head) once per query group;
its useful traffic is ``sum(lengths) * head_dim * 2 * bytes`` (plus q and the output). The
reference is a device-to-device ``copy_`` of a buffer of the same size, whose bandwidth is counted
as bytes read + bytes written. Lengths are per (sequence, KV head); ``--cr`` > 1 draws DMC-like
variable lengths around ``length / cr`` (``--spread``: within that mean times ``1 +- spread``).
Pages are handed out in shuffled order (as after many allocations and frees).

``--compare-cr R`` times a second layout of about the same K/V bytes: ``R`` times the sequences,
each head ``R`` times shorter (``--compare-spread``, default 0.05: a forced-CR DMC model's heads
differ by a few percent), as DMC at ``R``-fold compression holds the cache of vanilla's batch;
its rows carry `` at cr R`` and the table ends with its kernel time against the first layout's
(1.0: the kernel is as fast per byte on many short heads as on few long ones).

On CUDA: the Triton kernel (at this GPU's tuned setting, :mod:`dmc.inference.kernels.tuning`);
``--sweep`` times it under every tuning of a small grid as well (each tuning's output checked
against the first row's), and ``--write-tuning FILE`` writes the fastest per layout into a
kernel tuning file for this GPU (the kernel's default kept within 2% of the best; with
``--compare-cr`` a row for launches over as few (sequence, KV head) pairs as the first layout's,
another for as many as the second's), which ``DMC_KERNEL_TUNING=FILE`` puts to use, or which
ships as ``dmc/inference/kernels/tunings/``. Without a GPU: the CPU paths, each a row: the
compiled kernel (``paged_cpu.c``, when a C compiler is present), the PyTorch batched path, and
with ``--cpu-reference`` the slot-by-slot reference; on the CPU the copy is also timed as a
plain read (``sum``), the bound of a kernel that only reads. ``--out FILE.json`` writes the
numbers.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--length", type=int, default=4096, help="slots per head (before --cr)")
    p.add_argument("--cr", type=float, default=1.0, help="DMC-like variable lengths ~ length/cr")
    p.add_argument("--spread", type=float, default=None,
                   help="lengths within mean x (1 +- spread) (default 0.5 with --cr > 1, else 0)")
    p.add_argument("--compare-cr", type=float, default=None, metavar="R",
                   help="also time R x the sequences with R x shorter heads (equal bytes)")
    p.add_argument("--compare-spread", type=float, default=0.05,
                   help="--spread of the --compare-cr layout")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--num-splits", type=int, default=None, help="split-K (default: heuristic)")
    p.add_argument("--cpu-reference", action="store_true",
                   help="without CUDA: also time the slot-by-slot PyTorch reference")
    p.add_argument("--sweep", action="store_true",
                   help="CUDA: also time every (block_n, num_warps, num_stages) of a small grid "
                        "and print the fastest")
    p.add_argument("--write-tuning", metavar="FILE",
                   help="with --sweep on CUDA: write the fastest tuning per layout into this "
                        "kernel tuning file (created, or its paged_decode section replaced)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    for flag in ("batch", "q_heads", "kv_heads", "head_dim", "length", "page_size", "iters"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: accepted values >= 1, got {getattr(args, flag)}")
    if args.q_heads % args.kv_heads:
        p.error(f"--q-heads: accepted multiples of --kv-heads ({args.kv_heads}), got "
                f"{args.q_heads}")
    if args.num_splits is not None and args.num_splits < 1:
        p.error(f"--num-splits: accepted values >= 1, got {args.num_splits}")
    if args.write_tuning and not (args.sweep and torch.cuda.is_available()):
        p.error("--write-tuning: needs --sweep on a CUDA device (the tuning file is per GPU)")
    for flag, value in (("--spread", args.spread), ("--compare-spread", args.compare_spread)):
        if value is not None and not 0 <= value < 1:
            p.error(f"{flag}: accepted 0 <= spread < 1, got {value}")
    if any(not (math.isfinite(cr) and cr >= 1) for cr in (args.cr, args.compare_cr or 1)):
        p.error(f"--cr / --compare-cr: accepted finite values >= 1, got {args.cr} / "
                f"{args.compare_cr}")
    return args


@dataclasses.dataclass(frozen=True)
class Layout:
    """Sequences of ``kv_heads`` heads whose lengths lie within ``mean x (1 +- spread)``."""

    batch: int
    mean: float
    spread: float
    suffix: str = ""  # appended to the row names of this layout


def layouts(args) -> list[Layout]:
    """The run's layout, then the ``--compare-cr`` one: ``R`` times the sequences, heads ``R``
    times shorter."""
    spread = args.spread if args.spread is not None else (0.5 if args.cr > 1 else 0.0)
    main = Layout(args.batch, args.length / args.cr, spread)
    if args.compare_cr is None:
        return [main]
    ratio = args.compare_cr
    return [main, Layout(round(args.batch * ratio), main.mean / ratio, args.compare_spread,
                         f" at cr {ratio:g}")]


def make_inputs(args, device, layout: Layout):
    """q, K and V pages, block tables and lengths of ``layout`` on ``device`` (made once per run,
    device and layout: the sweep times every tuning on the same inputs)."""
    key = (str(device), layout)
    if key not in _INPUTS:
        _INPUTS.clear()  # one layout's pools at a time on the device
        _INPUTS[key] = _random_inputs(args, device, layout)
    return _INPUTS[key]


_INPUTS: dict = {}


def head_lengths(layout: Layout, kv_heads: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, kv_heads]`` lengths drawn uniformly within ``mean x (1 +- spread)``, >= 1."""
    unit = 2 * torch.rand(layout.batch, kv_heads, generator=gen, dtype=torch.float64) - 1
    return (layout.mean * (1 + layout.spread * unit)).round().long().clamp(min=1)


def _random_inputs(args, device, layout: Layout):
    gen = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    batch = layout.batch
    lengths = head_lengths(layout, args.kv_heads, gen)
    pages_per_head = (lengths + args.page_size - 1) // args.page_size
    num_pages = int(pages_per_head.sum())
    max_pages = int(pages_per_head.max())
    order = torch.randperm(num_pages, generator=gen)
    tables = torch.full((batch, args.kv_heads, max_pages), -1, dtype=torch.int32)
    cursor = 0
    for b in range(batch):
        for h in range(args.kv_heads):
            n = int(pages_per_head[b, h])
            tables[b, h, :n] = order[cursor:cursor + n].to(torch.int32)
            cursor += n
    shape = (num_pages, args.page_size, args.head_dim)
    k_pages = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_pages = torch.randn(shape, generator=gen).to(dtype).to(device)
    q = torch.randn(batch, args.q_heads, args.head_dim, generator=gen).to(dtype).to(device)
    return q, k_pages, v_pages, tables.to(device), lengths.to(torch.int32).to(device)


def useful_bytes(q, lengths, head_dim, element):
    kv = int(lengths.sum()) * head_dim * 2 * element
    return kv + 2 * q.numel() * q.element_size()


def time_cuda(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def time_cpu(fn, iters):
    fn()
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - started) / iters


def measure(args, device, kernel, timer, layout: Layout):
    q, k_pages, v_pages, tables, lengths = make_inputs(args, device, layout)
    scale = args.head_dim ** -0.5
    moved = useful_bytes(q, lengths, args.head_dim, k_pages.element_size())
    max_length = int(lengths.max())
    seconds = timer(lambda: kernel(q, k_pages, v_pages, tables, lengths, scale, max_length),
                    args.iters)
    size = int(lengths.sum()) * args.head_dim * 2 * k_pages.element_size()
    src = torch.ones(size, dtype=torch.uint8, device=device)  # touched: no shared zero page
    dst = torch.empty_like(src)
    copy_seconds = timer(lambda: dst.copy_(src), args.iters)
    kernel_bw = moved / seconds
    copy_bw = 2 * size / copy_seconds  # read + write
    out = {
        "kv_bytes": size, "kernel_seconds": seconds, "kernel_GBps": kernel_bw / 1e9,
        "copy_seconds": copy_seconds, "copy_GBps": copy_bw / 1e9,
        "fraction_of_copy": kernel_bw / copy_bw, "mean_length": float(lengths.float().mean()),
        "max_length": max_length, "batch": layout.batch,
    }
    if device.type == "cpu":  # a plain read of the same bytes: what a reading kernel can reach
        words = src.view(torch.float32)
        out["read_GBps"] = size / timer(lambda: words.sum(), args.iters) / 1e9
    return out


def report(args, results: dict, device_name: str) -> None:
    """One table row per path (and layout); the ``--compare-cr`` layout's kernel time against
    the first's, path by path; JSON with every number when ``--out`` is given."""
    print(f"paged decode on {device_name}: {args.q_heads} q / {args.kv_heads} kv heads, head_dim "
          f"{args.head_dim}, {args.dtype}, page {args.page_size}")
    header = ("path", "batch", "mean length", "KV MiB", "kernel us", "kernel GB/s", "copy GB/s",
              "fraction", "read GB/s", "of read")
    print(" | ".join(f"{h:>{26 if i == 0 else 12}}" for i, h in enumerate(header)))
    for path, result in results.items():
        read = result.get("read_GBps")
        cells = (path, str(result["batch"]), f"{result['mean_length']:.0f}",
                 f"{result['kv_bytes'] / 2**20:.1f}", f"{result['kernel_seconds'] * 1e6:.1f}",
                 f"{result['kernel_GBps']:.1f}", f"{result['copy_GBps']:.1f}",
                 f"{result['fraction_of_copy']:.3f}", "-" if read is None else f"{read:.1f}",
                 "-" if read is None else f"{result['kernel_GBps'] / read:.3f}")
        print(" | ".join(f"{c:>{26 if i == 0 else 12}}" for i, c in enumerate(cells)))
    for path, ratio in short_head_cost(results).items():
        print(f"{path}: kernel time per K/V byte at cr {args.compare_cr:g} x{ratio:.3f} the "
              f"first layout's")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device_name, "args": vars(args), "paths": results}, f, indent=2)
        print(f"wrote {args.out}")


def cpu_paths(args) -> dict:
    """The CPU rows: compiled kernel (if it builds here), PyTorch batched, reference."""
    from dmc.inference.kernels import paged_decode_batched, paged_decode_reference
    from dmc.inference.kernels.native import native_paged_decode

    paths = {}
    if native_paged_decode(*make_small_inputs(args)) is not None:
        paths["compiled"] = lambda q, k, v, t, lengths, scale, _: native_paged_decode(
            q, k, v, t, lengths, scale)
    paths["pytorch"] = lambda q, k, v, t, lengths, scale, _: paged_decode_batched(
        q, k, v, t, lengths, scale, native=False)
    if args.cpu_reference:
        paths["reference"] = lambda q, k, v, t, lengths, scale, _: paged_decode_reference(
            q, k, v, t, lengths, scale)
    return paths


def make_small_inputs(args):
    """A one-page input of the run's dtype and head size: does the compiled kernel take it?"""
    dtype = getattr(torch, args.dtype)
    pages = torch.zeros(1, args.page_size, args.head_dim, dtype=dtype)
    tables = torch.zeros(1, args.kv_heads, 1, dtype=torch.int32)
    lengths = torch.ones(1, args.kv_heads, dtype=torch.int32)
    return torch.zeros(1, args.q_heads, args.head_dim), pages, pages, tables, lengths, 1.0


SWEEP = [(block_n, warps, stages) for block_n in (32, 64, 128) for warps in (4, 8)
         for stages in (2, 3, 4)]


def short_head_cost(results: dict) -> dict[str, float]:
    """For each path with a ``--compare-cr`` row (``"<path> at cr R"``): its kernel seconds per
    K/V byte over the first layout's (1.0: as fast per byte on many short heads)."""
    costs = {}
    for name, row in results.items():
        base, _, ratio = name.partition(" at cr ")
        if ratio and base in results:
            first = results[base]
            costs[base] = ((row["kernel_seconds"] / row["kv_bytes"])
                           / (first["kernel_seconds"] / first["kv_bytes"]))
    return costs


def sweep(args, layout: Layout, expected: torch.Tensor, device: torch.device = None,
          timer=time_cuda) -> dict:
    """``{"sweep bN wW sS<suffix>": result}`` of the Triton kernel on ``layout`` under each
    tuning of ``SWEEP``, each result with its ``tuning`` and whether its output ``matches``
    ``expected`` (the "triton" row's, at this GPU's setting, to bf16 rounding); prints the
    fastest. ``device`` default CUDA (a CPU device and ``time_cpu``: the interpreter, tests)."""
    from dmc.inference.kernels.paged_decode import paged_decode

    device = device or torch.device("cuda")
    results = {}
    for block_n, warps, stages in SWEEP:
        def kernel(q, k, v, t, lengths, scale, max_length):
            return paged_decode(q, k, v, t, lengths, scale, num_splits=args.num_splits,
                                max_length=max_length, block_n=block_n, num_warps=warps,
                                num_stages=stages)

        row = measure(args, device, kernel, timer, layout)
        row.update(tuning=[block_n, warps, stages],
                   matches=bool(torch.allclose(run_once(args, kernel, layout, device).float(),
                                               expected.float(), atol=2e-2, rtol=2e-2)))
        results[f"sweep b{block_n} w{warps} s{stages}{layout.suffix}"] = row
    best = max(results, key=lambda name: results[name]["fraction_of_copy"])
    print(f"fastest tuning: {best} ({results[best]['fraction_of_copy']:.3f} of copy)")
    for name in (name for name, row in results.items() if not row["matches"]):
        print(f"{name}: its output differs from the triton row's (not eligible for a tuning "
              f"file)")
    return results


def run_once(args, kernel, layout: Layout, device: torch.device) -> torch.Tensor:
    """``kernel``'s output on ``layout``'s inputs on ``device``."""
    q, k_pages, v_pages, tables, lengths = make_inputs(args, device, layout)
    return kernel(q, k_pages, v_pages, tables, lengths, args.head_dim ** -0.5,
                  int(lengths.max()))


def swept(results: dict, layout: Layout) -> dict:
    """``{(block_n, num_warps, num_stages): result}`` of the sweep on ``layout`` whose output
    matched the triton row's."""
    return {tuple(row["tuning"]): row for name, row in results.items()
            if name.startswith("sweep") and row["matches"] and name.endswith(layout.suffix)
            and (layout.suffix or " at cr " not in name)}


def tuning_rows(args, results: dict, runs: list[Layout]):
    """The decode rows of a tuning file from a sweep over the layouts ``runs``: per layout,
    fewest (sequence, KV head) pairs first, the fastest tuning whose output matched
    (:func:`~dmc.inference.kernels.tuning.pick_fastest`: the kernel's default kept within 2%),
    up to the geometric mean of its pairs and the next layout's (the last row unbounded); a row
    that repeats the next one's tuning is dropped."""
    from dmc.inference.kernels.tuning import DecodeTuning, pick_fastest

    ordered = sorted(runs, key=lambda layout: layout.batch)
    rows = []
    for layout, following in zip(ordered, ordered[1:] + [None]):
        eligible = swept(results, layout)
        if not eligible:
            raise ValueError(f"no tuning of the sweep{layout.suffix} matched the triton row")
        block_n, warps, stages = pick_fastest(
            {tuning: row["kernel_seconds"] for tuning, row in eligible.items()},
            DecodeTuning().launch)
        bound = None if following is None else math.isqrt(
            layout.batch * following.batch * args.kv_heads ** 2)
        rows.append(DecodeTuning(block_n, warps, stages, bound))
    return tuple(row for i, row in enumerate(rows)
                 if i == len(rows) - 1 or row.launch != rows[i + 1].launch)


def write_tuning_file(args, results: dict, device_name: str) -> None:
    """``--write-tuning``: the sweep's :func:`tuning_rows` into the file, with their source
    (per layout the default's and the fastest tuning's fraction of copy)."""
    import datetime

    from dmc.inference.kernels.tuning import DecodeTuning, update_tuning

    runs = layouts(args)
    chosen = tuning_rows(args, results, runs)
    described = []
    for layout in runs:
        eligible = swept(results, layout)
        fastest = max(eligible, key=lambda tuning: eligible[tuning]["fraction_of_copy"])
        default = eligible.get(DecodeTuning().launch)
        described.append(
            f"batch {layout.batch}, heads of {results['triton' + layout.suffix]['mean_length']:.0f}"
            f" slots on average: {fastest} {eligible[fastest]['fraction_of_copy']:.3f} of copy"
            + ("" if default is None else f", the default {DecodeTuning().launch} "
               f"{default['fraction_of_copy']:.3f}"))
    flags = "--sweep" + ("" if args.compare_cr is None else f" --compare-cr {args.compare_cr:g}")
    source = (f"benchmarks/paged_kernel.py {flags} on {device_name}, {datetime.date.today()} "
              f"({args.q_heads} query / {args.kv_heads} KV heads, head_dim {args.head_dim}, "
              f"{args.dtype}): " + "; ".join(described))
    update_tuning(args.write_tuning, device_name, "paged_decode", source, decode=chosen)
    print(f"wrote {args.write_tuning}: paged_decode " + ", ".join(
        f"{row.launch} up to {row.max_heads or 'any number of'} heads" for row in chosen))


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch.cuda.is_available():
        from dmc.inference.kernels.paged_decode import paged_decode

        def kernel(q, k, v, t, lengths, scale, max_length):
            return paged_decode(q, k, v, t, lengths, scale, num_splits=args.num_splits,
                                max_length=max_length)

        results = {}
        for layout in layouts(args):
            results[f"triton{layout.suffix}"] = measure(args, torch.device("cuda"), kernel,
                                                        time_cuda, layout)
            if args.sweep:
                results.update(sweep(args, layout, run_once(args, kernel, layout,
                                                            torch.device("cuda"))))
        report(args, results, torch.cuda.get_device_name())
        if args.write_tuning:
            write_tuning_file(args, results, torch.cuda.get_device_name())
        return 0
    cpu = torch.device("cpu")
    results = {f"{name}{layout.suffix}": measure(args, cpu, kernel, time_cpu, layout)
               for layout in layouts(args) for name, kernel in cpu_paths(args).items()}
    report(args, results, f"cpu ({torch.get_num_threads()} threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
