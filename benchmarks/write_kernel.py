"""Time of one layer's DMC decode write (Algorithm 1, Eq. 9: a token per (sequence, KV head)
merged into its window ring or appended, rotated and written to its page), per call.

The write moves little (per head: the token, the ring of ``window`` keys and values, one page
row), so its time is latency: a chain of dependent loads (the head's length, its decision, the
page of its slot) per program. On CUDA: the Triton kernel as a decode step runs it (the decision
taken in the kernel from the key's decision channel, the importance from the queries', which
it rotates, one query head a KV head; the lengths advanced on the device), under
``--warps`` (default: 1, 2, 4 and 8 warps per program, the setting in use on this GPU marked,
:mod:`dmc.inference.kernels.tuning`); ``--write-tuning FILE`` writes the fastest (the default
kept within 2%) into a kernel tuning file for this GPU. Without a GPU: the compiled CPU kernel
and the PyTorch path with the decisions taken on the host. Inputs: ``--batch`` sequences of
``--kv-heads`` heads of about ``--length`` slots, a ring of ``--window`` rows, pages in shuffled
order, one decision in ``--cr`` appending, each head's open slot holding as many tokens as
such decisions leave it (a geometric draw; ``--full-rings``: every ring full, the write's
most traffic). The default layout is DMC 4x's batch at the GPU decode preset (137 sequences,
16 KV heads, head_dim 128, bf16, 653 slots a head after 2560 tokens). On CUDA a call's time is
the kernel's own (profiled): launched from Python, a call takes longer on the host than the
kernel on the device, so timing calls back to back would time the host. ``--merge-delay D``
(default 16; 0: none) adds a row on CUDA: the write of DMC with delayed merging
(:mod:`dmc.inference.kernels.delayed_write`) at the warps in use, every ring of ``D + 1`` raw
tokens full, so each program also takes the token leaving it through the same write.

    python benchmarks/write_kernel.py --out write_kernel.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_kernel import time_cpu  # noqa: E402

WARMUPS = 3  # the most calls a timer makes before it times (kernel_time_cuda's)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=137)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--length", type=int, default=653, help="slots per head before the calls")
    p.add_argument("--window", type=int, default=12)
    p.add_argument("--cr", type=float, default=4.0, help="one decision in CR appends")
    p.add_argument("--full-rings", action="store_true",
                   help="every open slot holds --window tokens or more (every ring row read); "
                        "default: as many as decisions with one in CR appending leave")
    p.add_argument("--merge-delay", type=int, default=16,
                   help="CUDA: also time delayed merging's write with rings of D + 1 (0: no)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warps", default="1,2,4,8", help="CUDA: comma separated warps per program")
    p.add_argument("--write-tuning", metavar="FILE",
                   help="CUDA: write the fastest warp count into this kernel tuning file "
                        "(created, or its dmc_write section replaced)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.write_tuning and not torch.cuda.is_available():
        p.error("--write-tuning: needs a CUDA device (the tuning file is per GPU)")
    try:
        args.warps = [int(w) for w in args.warps.split(",")]
    except ValueError:
        p.error(f"--warps: accepted comma separated powers of two, got {args.warps!r}")
    if not args.warps or any(w < 1 or w & (w - 1) for w in args.warps):
        p.error(f"--warps: accepted comma separated powers of two, got {args.warps}")
    for flag, value in (("--batch", args.batch), ("--kv-heads", args.kv_heads),
                        ("--length", args.length), ("--window", args.window),
                        ("--iters", args.iters), ("--page-size", args.page_size)):
        if value < 1:
            p.error(f"{flag}: accepted values >= 1, got {value}")
    if args.head_dim < 2 or args.head_dim % 2:
        p.error(f"--head-dim: accepted even values >= 2, got {args.head_dim}")
    if not (math.isfinite(args.cr) and args.cr >= 1):
        p.error(f"--cr: accepted finite values >= 1, got {args.cr}")
    if args.merge_delay < 0:
        p.error(f"--merge-delay: accepted values >= 0, got {args.merge_delay}")
    return args


def write_inputs(args, device: torch.device) -> dict:
    """The cache of one layer (``dmc_write``'s keyword arguments but the decisions): pools
    with room for the ``--iters`` timed calls and the timer's warm-ups to append to every head
    beyond ``--length`` slots, full rings, the new tokens."""
    gen = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    batch, heads, dim, window = args.batch, args.kv_heads, args.head_dim, args.window
    max_pages = math.ceil((args.length + args.iters + WARMUPS) / args.page_size)
    num_pages = batch * heads * max_pages
    tables = torch.randperm(num_pages, generator=gen).view(batch, 1, heads, max_pages)
    ring = (batch, 1, heads, window)

    def normal(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    return dict(
        k_pages=torch.zeros(num_pages, args.page_size, dim, dtype=dtype, device=device),
        v_pages=torch.zeros(num_pages, args.page_size, dim, dtype=dtype, device=device),
        block_tables=tables.to(device, torch.int32),
        open_k=normal(*ring, dim), open_v=normal(*ring, dim),
        open_omega=(0.5 + torch.rand(ring, generator=gen)).to(device),
        open_count=open_tokens(args, gen).to(device),
        inv_freq=(10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)).to(device),
        window=window, layer=0,
        seq_slots=torch.arange(batch, dtype=torch.int32, device=device),
        k=normal(batch, heads, dim), v=normal(batch, heads, dim),
        omega=(0.5 + torch.rand(batch, heads, generator=gen)).to(device),
        positions=torch.full((batch,), 4 * args.length, dtype=torch.long, device=device),
    )


def open_tokens(args, gen: torch.Generator) -> torch.Tensor:
    """``[batch, 1, kv_heads]`` int32 tokens in each head's open slot: ``--window`` with
    ``--full-rings``; else the age of the slot open at a random step when one decision in
    ``--cr`` appends, geometric with mean CR (1 at CR 1)."""
    shape = (args.batch, 1, args.kv_heads)
    if args.full_rings:
        return torch.full(shape, args.window, dtype=torch.int32)
    uniform = torch.rand(shape, generator=gen, dtype=torch.float64).clamp_min(1e-12)
    merge = 1 - 1 / args.cr
    if merge == 0:
        return torch.ones(shape, dtype=torch.int32)
    return (1 + torch.floor(torch.log(uniform) / math.log(merge))).to(torch.int32)


def decisions(args, device: torch.device) -> torch.Tensor:
    """``alpha [batch, kv_heads]`` float32: 1 (merge) for all but one in ``--cr``."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    return (torch.rand(args.batch, args.kv_heads, generator=gen) >= 1 / args.cr).float().to(
        device)


def deferred_write(args, device: torch.device) -> tuple[dict, torch.Tensor]:
    """``dmc_write``'s keyword arguments for a decode step's deferred write (the decisions in
    the keys' last channel, read by the kernel: merge where it is > c = 0; the importance read
    from the queries', one a KV head, which the kernel rotates) and the heads' lengths
    ``[batch, 1, kv_heads]`` int32 (``--length``) the write advances."""
    from dmc.inference.kernels import DecisionChannel
    from dmc.ops.algorithm1 import KeyDecision
    from dmc.ops.rope import rope_tables

    inputs = write_inputs(args, device)
    inputs["k"][..., -1] = 2 * decisions(args, device) - 1
    lengths = torch.full((args.batch, 1, args.kv_heads), args.length, dtype=torch.int32,
                         device=device)
    cos, sin = rope_tables(inputs["positions"][:, None], inputs["inv_freq"])
    query = (inputs["v"].clone(), cos, sin, DecisionChannel(args.kv_heads, 5.0))
    return dict(inputs, slots=None, append=None, omega=None, query=query,
                decide=(lengths, KeyDecision(0.0))), lengths


def triton_rows(args, device: torch.device) -> dict:
    """``{warps: seconds}``: the kernel as a decode step launches it, per warp count (on a CPU
    device: the Triton interpreter, the tests), the lengths reset to ``--length`` before
    each."""
    from dmc.inference.kernels.dmc_write import dmc_write

    call_args, lengths = deferred_write(args, device)
    rows = {}
    for warps in args.warps:
        def call():
            dmc_write(**call_args, num_warps=warps)

        lengths.fill_(args.length)
        rows[warps] = (kernel_time_cuda(call, args.iters, "_dmc_write_kernel")
                       if device.type == "cuda" else time_cpu(call, args.iters))
    return rows


def delayed_write_args(args, device: torch.device) -> tuple[dict, torch.Tensor]:
    """:func:`~dmc.inference.kernels.delayed_write.delayed_write`'s arguments for the same
    layer with rings of ``--merge-delay + 1`` raw tokens, all full, whose decisions (one in CR
    appending) the leaving tokens carry, and the heads' lengths it advances."""
    from dmc.ops.algorithm1 import KeyDecision

    call_args, lengths = deferred_write(args, device)
    gen = torch.Generator().manual_seed(args.seed + 2)
    rows = (args.batch, 1, args.kv_heads, args.merge_delay + 1)
    ring = [torch.randn(*rows, args.head_dim, generator=gen).to(device, getattr(torch, args.dtype))
            for _ in range(2)]
    ring_alpha = (torch.rand(rows, generator=gen) >= 1 / args.cr).float().to(device)
    ring_omega = (0.5 + torch.rand(rows, generator=gen)).to(device)
    names = ("k_pages", "v_pages", "block_tables", "open_k", "open_v", "open_omega",
             "open_count", "inv_freq", "window", "layer", "positions", "k", "v", "query")
    return dict({name: call_args[name] for name in names}, lengths=lengths, ring_k=ring[0],
                ring_v=ring[1], ring_alpha=ring_alpha, ring_omega=ring_omega,
                rows=call_args["seq_slots"], omega=None, alpha=KeyDecision(0.0)), lengths


def delayed_seconds(args, device: torch.device, warps: int) -> float:
    """Seconds a call of delayed merging's write at ``warps`` (CUDA: the kernel's device time;
    a CPU device: the interpreter, the tests)."""
    from dmc.inference.kernels.delayed_write import delayed_write

    call_args, lengths = delayed_write_args(args, device)
    lengths.fill_(args.length)

    def call():
        delayed_write(**call_args, num_warps=warps)

    return (kernel_time_cuda(call, args.iters, "_delayed_write_kernel")
            if device.type == "cuda" else time_cpu(call, args.iters))


def kernel_time_cuda(fn, iters: int, kernel: str) -> float:
    """Seconds of device time per call of ``fn`` in kernels whose name holds ``kernel``,
    over ``iters`` profiled calls after :data:`WARMUPS` others."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(WARMUPS):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return mean_kernel_seconds(prof.events(), kernel)


def mean_kernel_seconds(events, kernel: str) -> float:
    """The mean duration in seconds of the device events (``device_type`` CUDA) among profiler
    ``events`` whose name holds ``kernel``; ValueError where none ran."""
    from torch.autograd import DeviceType

    spans = [e.time_range.elapsed_us() for e in events
             if e.device_type == DeviceType.CUDA and kernel in e.name]
    if not spans:
        raise ValueError(f"no kernel named like {kernel!r} in the profile")
    return sum(spans) / len(spans) / 1e6


def row_names(seconds_by_warps: dict, in_use: int) -> dict:
    """``{"triton wN": seconds}``, the warp count in use on the device marked."""
    return {f"triton w{warps}" + (" (in use)" if warps == in_use else ""): seconds
            for warps, seconds in seconds_by_warps.items()}


def write_tuning_file(args, seconds_by_warps: dict, device_name: str) -> None:
    """``--write-tuning``: the fastest warp count (:func:`~dmc.inference.kernels.tuning.
    pick_fastest`) into the file's ``dmc_write`` section, with its source."""
    import datetime

    from dmc.inference.kernels.tuning import DEFAULT_WRITE_WARPS, pick_fastest, update_tuning

    warps = pick_fastest(seconds_by_warps, DEFAULT_WRITE_WARPS)
    timings = ", ".join(f"{w} warps {s * 1e6:.1f} us" for w, s in seconds_by_warps.items())
    source = (f"benchmarks/write_kernel.py on {device_name}, {datetime.date.today()} (batch "
              f"{args.batch}, {args.kv_heads} KV heads, head_dim {args.head_dim}, window "
              f"{args.window}, {args.dtype}, a call: one layer's deferred write): {timings}")
    update_tuning(args.write_tuning, device_name, "dmc_write", source, write_warps=warps)
    print(f"wrote {args.write_tuning}: dmc_write {warps} warps")


def cpu_rows(args) -> dict:
    """``{"compiled" | "pytorch": seconds}``: the CPU paths, the decisions taken on the host."""
    from dmc.inference.kernels import dmc_write_inplace
    from dmc.inference.kernels.native import native_dmc_write

    device = torch.device("cpu")
    inputs, alpha = write_inputs(args, device), decisions(args, device)
    append = alpha <= 0.5
    slots = torch.full_like(append, args.length - 1, dtype=torch.long) + append.long()
    call_args = dict(inputs, slots=slots, append=append)
    rows = {}
    if native_dmc_write(**call_args):
        rows["compiled"] = time_cpu(lambda: dmc_write_inplace(**call_args), args.iters)
    rows["pytorch"] = time_cpu(lambda: dmc_write_inplace(**call_args, native=False), args.iters)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        from dmc.inference.kernels.tuning import tuning_for

        in_use = tuning_for(torch.device("cuda")).write_warps
        by_warps = triton_rows(args, torch.device("cuda"))
        rows = row_names(by_warps, in_use)
        if args.merge_delay:
            rows[f"delayed d{args.merge_delay} w{in_use}"] = delayed_seconds(
                args, torch.device("cuda"), in_use)
    else:
        rows = cpu_rows(args)
    device = torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)"
    programs = args.batch * args.kv_heads
    print(f"DMC decode write on {device}: batch {args.batch}, {args.kv_heads} KV heads "
          f"({programs} programs), head_dim {args.head_dim}, window {args.window}, {args.dtype}, "
          f"{'full rings' if args.full_rings else f'open slots as at CR {args.cr:g}'}")
    print(f"{'path':>20} | {'us a call':>10} | {'ns a head':>10}")
    for name, seconds in rows.items():
        print(f"{name:>20} | {seconds * 1e6:10.1f} | {seconds * 1e9 / programs:10.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "args": vars(args), "programs": programs,
                       "seconds": rows}, f, indent=2)
        print(f"wrote {args.out}")
    if args.write_tuning:
        write_tuning_file(args, by_warps, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
