"""The compiled CPU kernels: paged decode (``paged_cpu.c``), the windowed DMC write and the DMS
decode write (``write_cpu.c``). Built on first use, loaded, called.

The C sources are compiled once per machine with the system C compiler (``$CC``, else ``cc``) into
``$DMC_KERNEL_CACHE`` (default ``~/.cache/dmc/kernels``), named by a hash of the source, the
flags, the compiler's version and the CPU's feature flags (``-march=native`` code must not
reach another CPU); builds unused for 30 days are deleted when a new one is made. It is loaded
with :mod:`ctypes` and called on the tensors' data pointers: no torch headers, a build of about
a second. Without a compiler, with ``DMC_NATIVE_KERNELS=0``, or
for inputs it does not take (a GPU tensor, a pool dtype other than float32 / bfloat16, larger
groups, pages or heads than its stack buffers) :func:`native_paged_decode` returns ``None`` and
the caller runs the PyTorch path. A build that fails (no OpenMP, an unsupported ``-march``) warns
once with the compiler's message and falls back likewise (``DMC_NATIVE_KERNELS=require`` makes it
an error instead); an unwritable cache folder falls back to one under the temporary directory.

Every kernel checks the block-table entries it goes through: a row whose slot lies on no page of
the pool (-1, a page never reserved) is left alone and the call raises
:class:`UnreservedPageError` naming it, where C would otherwise read or write outside the pool.
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
import time
import warnings
from pathlib import Path

import torch

from dmc.ops.rope import rope_angles

from .faults import UnreservedPageError

SOURCES = [Path(__file__).with_name(name) for name in ("paged_cpu.c", "write_cpu.c")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
PRUNE_AFTER_DAYS = 30
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


def _cache_folder() -> Path:
    """``$DMC_KERNEL_CACHE`` or ``~/.cache/dmc/kernels``, else a per-user temporary folder."""
    wanted = Path(os.environ.get("DMC_KERNEL_CACHE", Path.home() / ".cache" / "dmc" / "kernels"))
    try:
        wanted.mkdir(parents=True, exist_ok=True)
        if os.access(wanted, os.W_OK):
            return wanted
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"dmc-kernels-{os.getuid()}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def _build(compiler: str) -> Path:
    """The library built from :data:`SOURCES` (reused when built before); ``RuntimeError`` with
    the compiler's message when the build fails."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    parts = [*(path.read_bytes() for path in SOURCES), " ".join(FLAGS).encode(),
             version.encode(), _cpu_flags().encode(), platform.machine().encode()]
    cache = _cache_folder()
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = cache / f"dmc_kernels-{digest}.so"
    if target.exists():
        os.utime(target)  # in use: kept by _prune
        return target
    _prune(cache)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(built), "-lm"],
                                capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"compiling {[p.name for p in SOURCES]} with {compiler} failed:\n"
                               f"{result.stderr}")
        os.replace(built, target)  # atomic: concurrent builders (spawned workers) agree
    return target


def _prune(cache: Path) -> None:
    """Delete the builds in ``cache`` unused for :data:`PRUNE_AFTER_DAYS` (those of older sources,
    compilers or CPUs; a build in use is touched on every load, so machines of different CPUs
    sharing one home folder keep theirs)."""
    horizon = time.time() - PRUNE_AFTER_DAYS * 86400
    for old in cache.glob("dmc_kernels-*.so"):
        try:
            if old.stat().st_mtime < horizon:
                old.unlink()
        except OSError:
            pass  # another process pruned it first, or the folder is shared read-only


def _load(compiler: str) -> ctypes.CDLL:
    library = ctypes.CDLL(str(_build(compiler)))
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    library.dmc_paged_decode.restype = integer
    library.dmc_paged_decode.argtypes = ([pointer] * 4 + [integer] + [pointer] * 7
                                         + [integer] * 7 + [pointer])
    library.dmc_paged_limits.restype = integer
    library.dmc_paged_limits.argtypes = [integer]
    library.dmc_write_window.restype = integer
    library.dmc_write_window.argtypes = ([pointer] * 9 + [integer] * 2 + [pointer] * 6
                                         + [integer] * 10 + [pointer])
    library.dms_write_token.restype = integer
    library.dms_write_token.argtypes = [pointer] * 12 + [integer] * 11 + [pointer]
    library.delayed_write_token.restype = integer
    library.delayed_write_token.argtypes = [pointer] * 22 + [integer] * 12 + [pointer]
    return library


def _check_rows(count: int, bad_row: ctypes.c_int64, what: str, where) -> None:
    """Raise :class:`UnreservedPageError` when a kernel reported ``count`` rows left alone;
    ``where(row)`` names one of them (``bad_row``)."""
    if count:
        raise UnreservedPageError(
            f"{what}: {count} (sequence, KV head) row(s) use a block-table entry that is not a "
            f"page of the pool (-1: never reserved), e.g. {where(bad_row.value)}; they were "
            f"left unread / unwritten. The pages of a step are reserved before it runs "
            f"(BlockAllocator.reserve_step): this is a bug in the caller's reservation.")


def _row_of(seq_slots: torch.Tensor, kv_heads: int, layer: int):
    """Names row ``batch index * kv_heads + head`` of a write by its sequence slot."""
    return lambda row: (f"sequence slot {int(seq_slots[row // kv_heads])}, layer {layer}, "
                        f"KV head {row % kv_heads}")


def load_library() -> ctypes.CDLL | None:
    """The loaded kernel library, built if needed; ``None`` without a C compiler, with
    ``DMC_NATIVE_KERNELS=0``, or (with a warning) when the build fails."""
    with _LOCK:
        if not _LIBRARY:
            setting = os.environ.get("DMC_NATIVE_KERNELS", "1")
            compiler = _compiler()
            library = None
            if setting != "0" and compiler is not None:
                try:
                    library = _load(compiler)
                except (OSError, RuntimeError) as error:
                    if setting == "require":
                        raise
                    warnings.warn(f"dmc: the compiled CPU kernels are unavailable, the PyTorch "
                                  f"paths run instead: {error}", RuntimeWarning, stacklevel=2)
            elif setting == "require":
                raise RuntimeError("DMC_NATIVE_KERNELS=require but no C compiler was found "
                                   "($CC or cc)")
            _LIBRARY.append(library)
        return _LIBRARY[0]


def _in_place(*pools: torch.Tensor) -> bool:
    """Whether the kernels can read and write ``pools`` in place: CPU, contiguous, one dtype of
    float32 / bfloat16 (a pool is never copied for them)."""
    first = pools[0]
    return (first.device.type == "cpu" and first.dtype in (torch.float32, torch.bfloat16)
            and all(p.dtype == first.dtype and p.is_contiguous() for p in pools))


def _takes(q, k_pages, v_pages, group: int, library) -> bool:
    """Whether the compiled kernel handles these inputs (else the PyTorch path runs)."""
    if q.device.type != "cpu" or not _in_place(k_pages, v_pages):
        return False
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
    ring: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Paged decode attention by the compiled kernel, or ``None`` where it does not apply.

    Args and semantics: :func:`~dmc.inference.kernels.reference.paged_decode_reference`
    (``lengths`` exact, on the host: it is this CPU tensor). ``ring``: DMS's window rings,
    attended after the pages: ``(ring_k, ring_v, ring_index, ring_count)`` with pools
    ``ring_k, ring_v [n, kv_heads, ring, head_dim]`` of the pages' dtype, read in place,
    ``ring_index [batch]`` (each sequence's ring in the pools) and ``ring_count [batch]`` (its
    filled rows, attended by every KV head).

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
    rows = batch * kv_heads
    ring_pointers = [None, None, None, None]
    if ring is not None:
        ring_k, ring_v, ring_index, ring_count = ring
        if not _in_place(k_pages, ring_k, ring_v) or ring_k.shape[-2] > library.dmc_paged_limits(1):
            return None
        heads = torch.arange(kv_heads)
        offsets = ((ring_index.long()[:, None] * kv_heads + heads) * ring_k.shape[-2] * head_dim)
        counts = ring_count.to(torch.int32)[:, None].expand(batch, kv_heads).contiguous()
        ring_tensors = (ring_k, ring_v, offsets.contiguous(), counts)
        ring_pointers = [t.data_ptr() for t in ring_tensors]
    queries = (q.float() * scale).contiguous()
    tables = block_tables.reshape(rows, -1).to(torch.int32).contiguous()
    row_lengths = lengths.reshape(-1).to(torch.int32).contiguous()
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float32)
    lse = torch.empty(batch, q_heads, dtype=torch.float32)
    bad_row = ctypes.c_int64(-1)
    bad = library.dmc_paged_decode(
        queries.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), tables.data_ptr(),
        tables.shape[1], row_lengths.data_ptr(), *ring_pointers, out.data_ptr(), lse.data_ptr(),
        rows, group, head_dim, k_pages.shape[1], k_pages.shape[0],
        int(k_pages.dtype == torch.bfloat16), torch.get_num_threads(), ctypes.byref(bad_row),
    )
    _check_rows(bad, bad_row, "paged decode attention",
                lambda row: f"batch row {row // kv_heads}, KV head {row % kv_heads}")
    return out, lse


WRITE_INPUTS = dict(open_omega=torch.float32, open_count=torch.int32, block_tables=torch.int32)


def _merge_state_fits(state: dict, ring_dtypes: tuple) -> bool:
    """Whether the merge state ``state`` (``open_k``, ``open_v`` and :data:`WRITE_INPUTS`'
    tensors) is contiguous and of the kernel's dtypes: rings of keys and values of one dtype of
    ``ring_dtypes``, the others as :data:`WRITE_INPUTS` lists."""
    return (all(t.is_contiguous() for t in state.values())
            and state["open_k"].dtype in ring_dtypes
            and state["open_v"].dtype == state["open_k"].dtype
            and all(state[name].dtype == dtype for name, dtype in WRITE_INPUTS.items()))


def native_dmc_write(k_pages, v_pages, block_tables, open_k, open_v, open_omega, open_count,
                     inv_freq, window, layer, seq_slots, slots, append, k, v, omega,
                     positions) -> bool:
    """The windowed DMC write by the compiled kernel; ``False`` (nothing written) where it does
    not apply: no library, the exact running mean (``window=None``), a GPU tensor, a pool dtype
    other than float32 / bfloat16, state tensors not contiguous or not of the cache's dtypes
    (rings of keys and values: float32 or bfloat16, both alike).

    Arguments and effect: :func:`~dmc.inference.kernels.reference.dmc_write_reference`.
    """
    library = load_library()
    state = dict(open_k=open_k, open_v=open_v, open_omega=open_omega, open_count=open_count,
                 block_tables=block_tables)
    if (library is None or window is None or not _in_place(k_pages, v_pages)
            or k_pages.shape[-1] > 1024 or k_pages.shape[-1] % 2
            or not _merge_state_fits(state, (torch.float32, torch.bfloat16))):
        return False
    batch, heads = append.shape
    token = [t.to(torch.float32).contiguous() for t in (k, v, omega)]
    index = [t.to(torch.int64).contiguous() for t in (seq_slots, slots)]
    flags = append.to(torch.int8).contiguous()
    cos, sin = rope_angles(positions, inv_freq.float())
    bad_row = ctypes.c_int64(-1)
    bad = library.dmc_write_window(
        k_pages.data_ptr(), v_pages.data_ptr(), block_tables.data_ptr(), open_k.data_ptr(),
        open_v.data_ptr(), open_omega.data_ptr(), open_count.data_ptr(), cos.data_ptr(),
        sin.data_ptr(), window, layer, index[0].data_ptr(), index[1].data_ptr(),
        flags.data_ptr(), token[0].data_ptr(), token[1].data_ptr(), token[2].data_ptr(),
        batch, heads, block_tables.shape[1], block_tables.shape[-1], k_pages.shape[-1],
        k_pages.shape[1], k_pages.shape[0], int(k_pages.dtype == torch.bfloat16),
        int(open_k.dtype == torch.bfloat16), torch.get_num_threads(), ctypes.byref(bad_row))
    _check_rows(bad, bad_row, "DMC write", _row_of(index[0], heads, layer))
    return True


def native_dms_write(k_pages, v_pages, block_tables, lengths, ring_k, ring_v, ring_evict, layer,
                     seqs, positions, keys, values, evict) -> bool:
    """DMS's decode write by the compiled kernel (``DMSPagedCache.decode_write``'s data
    movement: the decision flag of token ``p - 1``, token ``p - w - 1`` out of its ring row into
    its head's reserved page slot, token ``p`` into the ring); ``False`` (nothing written) where
    it does not apply. Pools ``[num_pages, page_size, head_dim]`` and rings ``[max_seqs, layers,
    kv_heads, w + 1, head_dim]`` of one dtype (float32 / bfloat16), ``block_tables [max_seqs,
    layers, kv_heads, max_pages]`` and ``lengths [max_seqs, layers, kv_heads]`` int32,
    ``ring_evict [..., w + 1]`` bool, all contiguous CPU tensors; ``seqs``, ``positions``
    ``[batch]`` (host); ``keys``, ``values [batch, kv_heads, head_dim]``; ``evict [batch,
    kv_heads]``."""
    library = load_library()
    if (library is None or not _in_place(k_pages, v_pages, ring_k, ring_v)
            or block_tables.dtype != torch.int32 or lengths.dtype != torch.int32
            or ring_evict.dtype != torch.bool
            or not all(t.is_contiguous() for t in (block_tables, lengths, ring_evict))):
        return False
    batch, heads = evict.shape
    token = [t.to(torch.float32).contiguous() for t in (keys, values)]
    index = [t.to(torch.int64).contiguous() for t in (seqs, positions)]
    flags = evict.to(torch.int8).contiguous()
    bad_row = ctypes.c_int64(-1)
    bad = library.dms_write_token(
        k_pages.data_ptr(), v_pages.data_ptr(), block_tables.data_ptr(), lengths.data_ptr(),
        ring_k.data_ptr(), ring_v.data_ptr(), ring_evict.data_ptr(), token[0].data_ptr(),
        token[1].data_ptr(), flags.data_ptr(), index[0].data_ptr(), index[1].data_ptr(), layer,
        batch, heads, block_tables.shape[1], block_tables.shape[-1], ring_k.shape[-2],
        k_pages.shape[-1], k_pages.shape[1], k_pages.shape[0],
        int(k_pages.dtype == torch.bfloat16), torch.get_num_threads(), ctypes.byref(bad_row))
    _check_rows(bad, bad_row, "DMS write", _row_of(index[0], heads, layer))
    return True


def native_delayed_write(cache, layer: int, seqs: torch.Tensor, positions: torch.Tensor,
                         keys: torch.Tensor, values: torch.Tensor, alpha: torch.Tensor,
                         omega: torch.Tensor) -> bool:
    """The decode write of DMC with delayed merging by the compiled kernel
    (``DelayedMergeCache.write``'s PyTorch path: token ``p - R`` out of its ring row through
    Algorithm 1's windowed write into its head's reserved page slot, token ``p`` into the ring);
    ``False`` (nothing written) where it does not apply: no library, the exact running mean
    (``window=None``), GPU tensors, pools and rings not of one dtype (float32 / bfloat16), state
    tensors not contiguous or not of the cache's dtypes. ``cache``: a ``DelayedMergeCache``;
    ``seqs``, ``positions`` ``[batch]`` (host, p = the tokens written); ``keys`` (pre-RoPE,
    decision channel zeroed), ``values [batch, kv_heads, head_dim]``; ``alpha``, ``omega
    [batch, kv_heads]``."""
    library = load_library()
    state = dict(open_k=cache.open_k, open_v=cache.open_v, open_omega=cache.open_omega,
                 open_count=cache.open_count, block_tables=cache.block_tables)
    rings = (cache.ring_alpha, cache.ring_omega, cache.lengths)
    if (library is None or cache.window is None
            or not _in_place(cache.k_pages, cache.v_pages, cache.ring_k, cache.ring_v)
            or cache.head_dim > 1024 or cache.head_dim % 2
            or not all(t.is_contiguous() for t in rings)
            or not _merge_state_fits(state, (torch.float32,))
            or cache.lengths.dtype != torch.int32):
        return False
    batch, heads = keys.shape[:2]
    token = [t.to(torch.float32).contiguous() for t in (keys, values, alpha, omega)]
    index = [t.to(torch.int64).contiguous() for t in (seqs, positions)]
    now = rope_angles(index[1], cache.inv_freq.float())
    out = rope_angles(index[1] - cache.ring_size, cache.inv_freq.float())  # the leaving tokens
    bad_row = ctypes.c_int64(-1)
    bad = library.delayed_write_token(
        cache.k_pages.data_ptr(), cache.v_pages.data_ptr(), cache.block_tables.data_ptr(),
        cache.lengths.data_ptr(), cache.open_k.data_ptr(), cache.open_v.data_ptr(),
        cache.open_omega.data_ptr(), cache.open_count.data_ptr(),
        *(t.data_ptr() for t in (*now, *out)), cache.ring_k.data_ptr(),
        cache.ring_v.data_ptr(), cache.ring_alpha.data_ptr(), cache.ring_omega.data_ptr(),
        *(t.data_ptr() for t in token), index[0].data_ptr(), index[1].data_ptr(),
        cache.window, layer, batch, heads, cache.block_tables.shape[1],
        cache.block_tables.shape[-1], cache.ring_size, cache.head_dim, cache.k_pages.shape[1],
        cache.k_pages.shape[0], int(cache.k_pages.dtype == torch.bfloat16),
        torch.get_num_threads(), ctypes.byref(bad_row))
    _check_rows(bad, bad_row, "delayed-merging write", _row_of(index[0], heads, layer))
    return True
