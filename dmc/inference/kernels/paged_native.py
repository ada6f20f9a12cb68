"""The compiled CPU paged decode (``paged_cpu.c``): build on first use, load, call.

The C source is compiled once per machine with the system C compiler (``$CC``, else ``cc``) into
``$DMC_KERNEL_CACHE`` (default ``~/.cache/dmc/kernels``), named by a hash of the source, the
flags, the compiler's version and the CPU's feature flags (``-march=native`` code must not
reach another CPU). It is loaded with :mod:`ctypes` and called on the tensors' data pointers: no
torch headers, a build of about a second. Without a compiler, with ``DMC_NATIVE_KERNELS=0``, or
for inputs it does not take (a GPU tensor, a pool dtype other than float32 / bfloat16, larger
groups, pages or heads than its stack buffers) :func:`native_paged_decode` returns ``None`` and
the caller runs the PyTorch path; a compiler that is present but fails raises.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("paged_cpu.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_LOCK = threading.Lock()
_LIBRARY: list = []  # [] before the first try, [None] when unavailable, [CDLL] when loaded


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_flags().encode(), platform.machine().encode()]))
    cache = Path(os.environ.get("DMC_KERNEL_CACHE", Path.home() / ".cache" / "dmc" / "kernels"))
    target = cache / f"paged_cpu-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
                                capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"compiling {SOURCE} with {compiler} failed:\n{result.stderr}")
        os.replace(built, target)  # atomic: concurrent builders (spawned workers) agree
    return target


def load_library() -> ctypes.CDLL | None:
    """The loaded kernel library, built if needed; ``None`` without a C compiler or with
    ``DMC_NATIVE_KERNELS=0``."""
    with _LOCK:
        if not _LIBRARY:
            compiler = _compiler()
            if os.environ.get("DMC_NATIVE_KERNELS", "1") == "0" or compiler is None:
                _LIBRARY.append(None)
            else:
                library = ctypes.CDLL(str(_build(compiler)))
                library.dmc_paged_decode.restype = None
                pointer, integer = ctypes.c_void_p, ctypes.c_int64
                library.dmc_paged_decode.argtypes = [pointer] * 4 + [integer] + [pointer] * 3 + [
                    integer] * 6
                library.dmc_paged_limits.restype = ctypes.c_int64
                library.dmc_paged_limits.argtypes = [ctypes.c_int64]
                _LIBRARY.append(library)
        return _LIBRARY[0]


def _takes(q, k_pages, v_pages, group: int, library) -> bool:
    """Whether the compiled kernel handles these inputs (else the PyTorch path runs)."""
    if q.device.type != "cpu" or k_pages.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()) or v_pages.dtype != k_pages.dtype:
        return False  # the kernel reads the pools in place: never copy them
    most_group, most_page, most_head, head_multiple = (library.dmc_paged_limits(i)
                                                       for i in range(4))
    page_size, head_dim = k_pages.shape[1:]
    return (group <= most_group and page_size <= most_page and head_dim <= most_head
            and head_dim % head_multiple == 0)


def native_paged_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Paged decode attention by the compiled kernel, or ``None`` where it does not apply.

    Args and semantics: :func:`~dmc.inference.kernels.reference.paged_decode_reference`
    (``lengths`` exact, on the host: it is this CPU tensor).

    Returns:
        ``out [batch, q_heads, head_dim]`` float32 and ``lse [batch, q_heads]`` float32 (the
        log-sum-exp of each query's scaled scores, ``-inf`` for a head with no slot).
    """
    library = load_library()
    batch, q_heads, head_dim = q.shape
    kv_heads = block_tables.shape[1]
    group = q_heads // kv_heads
    if library is None or not _takes(q, k_pages, v_pages, group, library):
        return None
    queries = (q.float() * scale).contiguous()
    tables = block_tables.reshape(batch * kv_heads, -1).to(torch.int32).contiguous()
    rows = lengths.reshape(-1).to(torch.int32).contiguous()
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float32)
    lse = torch.empty(batch, q_heads, dtype=torch.float32)
    library.dmc_paged_decode(
        queries.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), tables.data_ptr(),
        tables.shape[1], rows.data_ptr(), out.data_ptr(), lse.data_ptr(), batch * kv_heads,
        group, head_dim, k_pages.shape[1], int(k_pages.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out, lse
