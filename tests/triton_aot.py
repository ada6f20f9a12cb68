"""Compiles dmc's Triton kernels for an H100 (``sm_90``) on a machine without a GPU.

The interpreter (``TRITON_INTERPRET=1``, what the CPU tests run) executes a kernel's Python and
never meets Triton's compiler: a kernel can pass every CPU test and still not compile (the GPU
kit once found ``j: tl.constexpr`` reassigned in a ``static_range`` loop). Run as a script in
a process without ``TRITON_INTERPRET``, so ``@triton.jit`` makes real ``JITFunction``\\ s: each
case calls dmc's launch code on CPU tensors with ``JITFunction.run`` recording the launches
instead of running them, then compiles each recorded launch with ``triton.compile`` for
``GPUTarget("cuda", 90, 32)`` down to a cubin (Triton's wheel brings ``ptxas``), with the
launch's argument types, constexprs, warps and stages.

    python tests/triton_aot.py paged_decode dmc_write decode_rope rope_append dms_write gumbel \
        window_sums delayed_write

prints one line per compiled launch and exits 1 naming the kernels that fail.
"""
from __future__ import annotations

import os
import subprocess
import sys

CASES = ("paged_decode", "dmc_write", "decode_rope", "rope_append", "dms_write", "gumbel",
         "window_sums", "delayed_write")
_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int64": "i64",
                 "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


def compile_in_subprocess(*cases: str) -> subprocess.CompletedProcess:
    """This script run on ``cases`` in a fresh process without ``TRITON_INTERPRET`` (what the
    tests call: their own process imported the kernels interpreted)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, __file__, *cases], env=env, capture_output=True,
                          text=True, timeout=900)


def record_launches(call) -> list[tuple]:
    """``(kernel, args, kwargs)`` of every Triton launch ``call()`` makes, none run."""
    from triton.runtime.jit import JITFunction

    launches = []
    run = JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append(
        (self, args, kwargs))
    try:
        call()
    finally:
        JITFunction.run = run
    return launches


def _signature(kernel, args, kwargs) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of one recorded launch."""
    import torch

    names = [param.name for param in kernel.params]
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    options = {k: v for k, v in kwargs.items() if k not in names}
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TRITON_TYPES[str(value.dtype).removeprefix("torch.")]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            signature[param.name] = "fp32"
    return signature, constexprs, options


def compile_for_hopper(kernel, args, kwargs) -> None:
    """One recorded launch compiled to a cubin for ``sm_90`` (raises what Triton raises)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, options = _signature(kernel, args, kwargs)
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    if "cubin" not in compiled.asm:
        raise RuntimeError(f"{kernel.fn.__name__}: no cubin among {sorted(compiled.asm)}")


def _paged_decode():
    """GQA in bf16 with two splits (both kernels), MHA in float32 in one, a DMS ring (the split
    kernel's ring mode) in bf16; the bf16 GQA launch again under every setting a shipped
    tuning file holds (``dmc/inference/kernels/tunings``)."""
    import torch

    from dmc.inference.kernels import run_paged_decode
    from dmc.inference.kernels.dms_decode import dms_decode_attention
    from dmc.inference.kernels.paged_decode import paged_decode
    from dmc.inference.kernels.tuning import shipped_tunings

    for dtype, q_heads, kv_heads, splits in ((torch.bfloat16, 8, 2, 2), (torch.float32, 4, 4, 1)):
        pages, page_size, dim, batch = 8, 16, 128, 2
        k_pages = torch.zeros(pages, page_size, dim, dtype=dtype)
        tables = torch.zeros(batch, kv_heads, 4, dtype=torch.int32)
        lengths = torch.full((batch, kv_heads), 40, dtype=torch.int32)
        q = torch.zeros(batch, q_heads, dim, dtype=dtype)
        run_paged_decode(q, k_pages, k_pages.clone(), tables, lengths, dim ** -0.5,
                         use_triton=True, num_splits=splits, max_length=64)
        launches = {row.launch for tuning in shipped_tunings().values() for row in tuning.decode}
        for block_n, warps, stages in sorted(launches) if dtype == torch.bfloat16 else ():
            paged_decode(q, k_pages, k_pages.clone(), tables, lengths, dim ** -0.5,
                         num_splits=splits, max_length=64, block_n=block_n, num_warps=warps,
                         num_stages=stages)
    ring_k = torch.zeros(3, kv_heads, 33, dim, dtype=torch.bfloat16)  # a DMS window ring
    dms_decode_attention(q.bfloat16(), k_pages.bfloat16(), k_pages.bfloat16(), tables, lengths,
                         64, ring_k, ring_k.clone(), lengths[:, 0], dim ** -0.5,
                         ring_rows=torch.tensor([2, 0]), use_triton=True)


def _dmc_write():
    """The windowed (window 12, a float32 ring and a bf16 one) and exact merges into a bf16
    cache, decided on the host, then deferred with the decisions read from the key and the
    importance from GQA queries, which it rotates (the decode step's launch); that launch again
    at 1 and 8 warps (``benchmarks/write_kernel.py``'s, MHA) and at the shipped tuning files'
    counts."""
    import torch

    from dmc.inference.cache import PagedKVCache
    from dmc.inference.kernels import DecisionChannel
    from dmc.inference.kernels.dmc_write import dmc_write
    from dmc.inference.kernels.tuning import shipped_tunings
    from dmc.ops.algorithm1 import KeyDecision

    heads, dim, batch = 2, 128, 2
    for window, ring in ((12, torch.float32), (12, torch.bfloat16), (None, torch.float32)):
        cache = PagedKVCache(1, heads, dim, 16, page_size=16, max_seqs=batch, window=window,
                             dtype=torch.bfloat16, ring_dtype=ring)
        seqs = [cache.add_sequence() for _ in range(batch)]
        k = torch.zeros(batch, heads, dim, dtype=torch.bfloat16)
        cache.write(0, seqs, torch.zeros(batch, dtype=torch.long), k, k.clone(),
                    torch.ones(batch, heads), torch.zeros(batch, heads), use_triton=True)
        cache.begin_decode(seqs)
        tables = torch.zeros(batch, 1, dim)
        query = (torch.zeros(batch, 2 * heads, dim, dtype=torch.bfloat16), tables, tables,
                 DecisionChannel(heads, 5.0, 2.0 ** -7))
        cache.write(0, seqs, torch.ones(batch, dtype=torch.long), k, k.clone(), None,
                    KeyDecision(5.0), use_triton=True, defer=True, query=query)
    write_kernel = _benchmark("write_kernel")  # the deferred write at the other warp counts
    call_args, _ = write_kernel.deferred_write(write_kernel.parse_args(
        ["--batch", "2", "--kv-heads", str(heads), "--length", "20"]), torch.device("cpu"))
    for warps in sorted({1, 8} | {t.write_warps for t in shipped_tunings().values()}):
        dmc_write(**call_args, num_warps=warps)


def _benchmark(name: str):
    """``benchmarks/<name>.py`` as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _decode_rope():
    """RoPE of float32 rows, of bf16 GQA and MHA queries with DMC's decision channel, and of
    bf16 GQA queries with DMS's."""
    import torch

    from dmc.inference.kernels import DecisionChannel, EvictionChannel, run_decode_rope

    batch, dim = 2, 128
    cos = sin = torch.zeros(batch, 1, dim)
    run_decode_rope(torch.zeros(batch, 4, dim), cos, sin)
    for kv_heads in (2, 8):
        run_decode_rope(torch.zeros(batch, 8, dim, dtype=torch.bfloat16), cos, sin,
                        DecisionChannel(kv_heads, 5.0, 2.0 ** -7))
    run_decode_rope(torch.zeros(batch, 8, dim, dtype=torch.bfloat16), cos, sin,
                    EvictionChannel(2, 5.0, 100.0))


def _rope_append():
    """The vanilla decode write of bf16 MHA and GQA rows into a bf16 cache."""
    import torch

    from dmc.inference.kernels import run_rope_append

    batch, dim = 2, 128
    cos = sin = torch.zeros(batch, 1, dim)
    pages = [torch.zeros(8, 16, dim, dtype=torch.bfloat16) for _ in range(2)]
    slots = torch.zeros(batch, 3, 8, dtype=torch.int32)
    for kv_heads in (8, 2):
        run_rope_append(torch.zeros(batch, 8, dim, dtype=torch.bfloat16),
                        *(torch.zeros(batch, kv_heads, dim, dtype=torch.bfloat16)
                          for _ in range(2)), cos, sin, *pages, slots[:, 1, :kv_heads],
                        slots[:, 1, :kv_heads], torch.arange(batch), 1, 3)


def _dms_write():
    """The DMS decode write into a bf16 cache (float32 rotated keys, bf16 values), and the
    decode step's launch: bf16 keys rotated with GQA queries whose eviction it reads."""
    import torch

    from dmc.inference.kernels import EvictionChannel
    from dmc.inference.kernels.dms_write import dms_write

    rows, layers, heads, ring, dim, batch = 3, 2, 2, 33, 128, 2
    pages = [torch.zeros(8, 16, dim, dtype=torch.bfloat16) for _ in range(2)]
    rings = [torch.zeros(rows, layers, heads, ring, dim, dtype=torch.bfloat16) for _ in range(2)]
    state = (*pages, torch.zeros(rows, layers, heads, 4, dtype=torch.int32),
             torch.zeros(rows, layers, heads, dtype=torch.int32), *rings,
             torch.zeros(rows, layers, heads, ring, dtype=torch.bool), 1, torch.tensor([2, 0]),
             torch.tensor([40, 41]))
    values = torch.zeros(batch, heads, dim, dtype=torch.bfloat16)
    dms_write(*state, torch.zeros(batch, heads, dim), values,
              torch.zeros(batch, heads, dtype=torch.bool))
    tables = torch.zeros(batch, 1, dim)
    dms_write(*state, values.clone(), values, None,
              query=(torch.zeros(batch, 4 * heads, dim, dtype=torch.bfloat16), tables, tables,
                     EvictionChannel(heads, 5.0, 100.0)))


def _delayed_write():
    """The write of DMC with delayed merging (ring of 17) into a bf16 cache, windowed (window
    12) and exact: the decode step's launch (the decision read from the key, the importance
    from GQA queries, which it rotates), and with both decisions given."""
    import torch

    from dmc.inference.delayed_cache import DelayedMergeCache
    from dmc.inference.kernels import DecisionChannel
    from dmc.ops.algorithm1 import KeyDecision

    heads, dim, batch = 2, 128, 2
    for window in (12, None):
        cache = DelayedMergeCache(1, heads, dim, 16, 16, page_size=16, max_seqs=batch,
                                  window=window, dtype=torch.bfloat16)
        seqs = [cache.add_sequence() for _ in range(batch)]
        cache.begin_decode(seqs)
        k = torch.zeros(batch, heads, dim, dtype=torch.bfloat16)
        positions = torch.zeros(batch, dtype=torch.long)
        tables = torch.zeros(batch, 1, dim)
        query = (torch.zeros(batch, 2 * heads, dim, dtype=torch.bfloat16), tables, tables,
                 DecisionChannel(heads, 5.0, 2.0 ** -7))
        cache.write(0, seqs, positions, k, k.clone(), None, KeyDecision(5.0), use_triton=True,
                    defer=True, query=query)
        cache.begin_decode(seqs)
        cache.write(0, seqs, positions + 1, k, k.clone(), torch.ones(batch, heads),
                    torch.zeros(batch, heads), use_triton=True, defer=True)


def _gumbel():
    """The Gumbel-max draw over bf16 logits."""
    import torch

    from dmc.inference.kernels.gumbel import gumbel_argmax

    rows = 4
    gumbel_argmax(torch.zeros(rows, 32000, dtype=torch.bfloat16), torch.ones(rows),
                  torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long))


def _window_sums():
    """Eq. 9's fused window sums of bf16 keys and values, forward and backward (window 12)."""
    import torch

    from dmc.megatron.window_sum_kernels import fused_windowed_accumulate

    shape = (1, 2, 64, 128)
    k, v = (torch.zeros(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    alpha, omega = (torch.full(shape[:3], 0.5, requires_grad=True) for _ in range(2))
    k_sum, v_sum = fused_windowed_accumulate(k, v, alpha, omega, 12)
    (k_sum.sum() + v_sum.sum()).backward()


def main(cases: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("triton_aot: run without TRITON_INTERPRET=1 (it makes interpreted kernels)",
              file=sys.stderr)
        return 2
    unknown = set(cases) - set(CASES)
    if not cases or unknown:
        print(f"triton_aot: cases: accepted {', '.join(CASES)}, got {cases}", file=sys.stderr)
        return 2
    import dmc.inference.cache as cache
    import dmc.inference.kernels as kernels

    for module in (kernels, cache):  # Triton on CPU tensors where asked, without interpreting
        module.resolve_use_triton = lambda device, use_triton=None: bool(use_triton)
    drivers = {"paged_decode": _paged_decode, "dmc_write": _dmc_write,
               "decode_rope": _decode_rope, "rope_append": _rope_append,
               "dms_write": _dms_write, "gumbel": _gumbel,
               "window_sums": _window_sums, "delayed_write": _delayed_write}
    failed = []
    for case in cases:
        launches = record_launches(drivers[case])
        if not launches:
            failed.append(f"{case}: no launch recorded")
        for kernel, args, kwargs in launches:
            name = f"{case}: {kernel.fn.__name__}"
            try:
                compile_for_hopper(kernel, args, kwargs)
                print(f"{name}: compiled for sm_90")
            except Exception as error:
                failed.append(f"{name}: {type(error).__name__}: {error}")
    for failure in failed:
        print(failure, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
