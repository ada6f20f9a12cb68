"""Launch settings of the Triton decode kernels, per GPU, as the benchmarks' sweeps measured them.

The paged decode kernel's tile (slots per loop step), warps and pipeline stages, and the DMC
write's warps per program, lay the work out and change no result (GPU tests compare every
setting a file ships with the reference). Which is fastest depends on the card: on an H100 the
sweep of ``benchmarks/paged_kernel.py`` put 64 slots, 4 warps, 4 stages at 0.920 of a device
copy's bandwidth against 0.827 for the kernel's default (128, 4, 3), on an H200 the default
was within 1% of the best. As vLLM ships a tuned configuration per device for its fused MoE
kernel, one JSON file per GPU name in ``dmc/inference/kernels/tunings/`` holds the measured
choice; ``DMC_KERNEL_TUNING=FILE`` names another, which must be for the GPU it runs on (what
``benchmarks/paged_kernel.py --sweep --write-tuning FILE`` and ``benchmarks/write_kernel.py
--write-tuning FILE`` write there). A GPU without a file gets the defaults. ::

    {"device": "NVIDIA H100 80GB HBM3",          # torch.cuda.get_device_name()
     "source": {"paged_decode": "how and when it was measured", "dmc_write": "..."},
     "paged_decode": [{"max_heads": 1152, "block_n": 64, "num_warps": 4, "num_stages": 4},
                      {"max_heads": null, "block_n": 32, "num_warps": 4, "num_stages": 2}],
     "dmc_write": {"num_warps": 4}}

A decode launch takes the first ``paged_decode`` row whose ``max_heads`` is at least the
number of (sequence, KV head) pairs it attends over (``null``: any), the last row beyond them
all: at equal memory DMC holds CR times vanilla's sequences in heads CR times shorter, and many
short heads may want other tiles than few long ones. Keyed by heads, not by head length: a
decode step replayed from a CUDA graph knows its batch but launches for the cache's longest
possible head, not for the lengths it will meet. Either section may be left out.
CPU tensors (the Triton interpreter) are the device ``"triton interpreter"``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import torch

ENV = "DMC_KERNEL_TUNING"
SHIPPED = Path(__file__).resolve().parent / "tunings"
INTERPRETER = "triton interpreter"  # the device name of CPU tensors
WARPS = (1, 2, 4, 8, 16)
SECTIONS = ("paged_decode", "dmc_write")
DEFAULT_WRITE_WARPS = 4  # Triton's default; a DMC write program moves one token of one head


def _check(condition: bool, field: str, accepted: str, got) -> None:
    if not condition:
        raise ValueError(f"kernel tuning: {field}: accepted {accepted}, got {got!r}")


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """One launch setting of the paged decode kernel for launches over at most ``max_heads``
    (sequence, KV head) pairs (None: any): ``block_n`` slots per loop step (a power of two
    >= 16), ``num_warps`` per program, ``num_stages`` of software pipelining of the loop's
    loads."""

    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    max_heads: int | None = None

    def __post_init__(self):
        _check(isinstance(self.block_n, int) and self.block_n >= 16
               and not self.block_n & (self.block_n - 1), "paged_decode.block_n",
               "a power of two >= 16", self.block_n)
        _check(self.num_warps in WARPS, "paged_decode.num_warps", str(WARPS), self.num_warps)
        _check(isinstance(self.num_stages, int) and 1 <= self.num_stages <= 8,
               "paged_decode.num_stages", "1 to 8", self.num_stages)
        _check(self.max_heads is None or (isinstance(self.max_heads, int)
                                          and self.max_heads >= 1),
               "paged_decode.max_heads", "null or an integer >= 1", self.max_heads)

    @property
    def launch(self) -> tuple[int, int, int]:
        """``(block_n, num_warps, num_stages)``."""
        return self.block_n, self.num_warps, self.num_stages


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """The launch settings of one GPU (``device``: its ``torch.cuda.get_device_name()``):
    ``decode`` rows in increasing ``max_heads`` (only the last may be None), the DMC write's
    ``write_warps`` per program, and per section (``paged_decode``, ``dmc_write``) the
    ``source`` of its figures (a section without one holds the defaults)."""

    device: str
    decode: tuple[DecodeTuning, ...] = (DecodeTuning(),)
    write_warps: int = DEFAULT_WRITE_WARPS
    source: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _check(isinstance(self.device, str) and bool(self.device), "device",
               "the GPU's name (torch.cuda.get_device_name())", self.device)
        _check(len(self.decode) >= 1, "paged_decode", "at least one row", list(self.decode))
        bounds = [row.max_heads for row in self.decode]
        _check(None not in bounds[:-1] and bounds[:-1] == sorted(set(bounds[:-1]))
               and (bounds[-1] is None or len(bounds) == 1 or bounds[-1] > bounds[-2]),
               "paged_decode[].max_heads", "increasing, null only in the last row", bounds)
        _check(self.write_warps in WARPS, "dmc_write.num_warps", str(WARPS), self.write_warps)
        _check(isinstance(self.source, dict) and set(self.source) <= set(SECTIONS)
               and all(isinstance(v, str) for v in self.source.values()), "source",
               f"an object of strings with keys among {list(SECTIONS)}", self.source)

    def decode_for(self, heads: int) -> DecodeTuning:
        """The row for a launch over ``heads`` (sequence, KV head) pairs."""
        for row in self.decode:
            if row.max_heads is None or heads <= row.max_heads:
                return row
        return self.decode[-1]

    def to_json(self) -> dict:
        return {"device": self.device, "source": self.source,
                "paged_decode": [{"max_heads": row.max_heads, "block_n": row.block_n,
                                  "num_warps": row.num_warps, "num_stages": row.num_stages}
                                 for row in self.decode],
                "dmc_write": {"num_warps": self.write_warps}}

    @classmethod
    def from_json(cls, data: dict) -> KernelTuning:
        """A file's contents; ValueError naming the field that is wrong and what it accepts."""
        _check(isinstance(data, dict), "the file", "a JSON object", type(data).__name__)
        known = {"device", "source", *SECTIONS}
        _check(not set(data) - known, "keys", str(sorted(known)), sorted(set(data) - known))
        rows = data.get("paged_decode", [dataclasses.asdict(DecodeTuning())])
        _check(isinstance(rows, list) and all(isinstance(r, dict) for r in rows),
               "paged_decode", "a list of objects", rows)
        row_keys = {f.name for f in dataclasses.fields(DecodeTuning)}
        for row in rows:
            _check(not set(row) - row_keys, "paged_decode[] keys", str(sorted(row_keys)),
                   sorted(set(row) - row_keys))
        write = data.get("dmc_write", {})
        _check(isinstance(write, dict) and not set(write) - {"num_warps"}, "dmc_write",
               'an object with "num_warps"', write)
        return cls(device=data.get("device"), decode=tuple(DecodeTuning(**r) for r in rows),
                   write_warps=write.get("num_warps", DEFAULT_WRITE_WARPS),
                   source=data.get("source", {}))


def read_tuning(path: str | Path) -> KernelTuning:
    """The tuning file at ``path``; ValueError naming the file and the field at fault."""
    try:
        return KernelTuning.from_json(json.loads(Path(path).read_text()))
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path}: {error}") from error


def write_tuning(path: str | Path, tuning: KernelTuning) -> None:
    Path(path).write_text(json.dumps(tuning.to_json(), indent=2) + "\n")


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` of a CUDA device, :data:`INTERPRETER` otherwise."""
    if device.type != "cuda":
        return INTERPRETER
    return _cuda_name(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _cuda_name(index: int) -> str:  # once per device: a decode step asks per layer
    return torch.cuda.get_device_name(index)


@functools.cache
def shipped_tunings() -> dict[str, KernelTuning]:
    """The files of :data:`SHIPPED` by device name."""
    tunings = [read_tuning(path) for path in sorted(SHIPPED.glob("*.json"))]
    return {tuning.device: tuning for tuning in tunings}


def tuning_for(device: torch.device) -> KernelTuning:
    """The launch settings for ``device``: the file ``$DMC_KERNEL_TUNING`` names (ValueError
    when it is for another GPU), else the shipped file of the device's name, else the
    defaults."""
    return _tuning_for(device_name(device), os.environ.get(ENV) or None)


@functools.cache
def _tuning_for(name: str, override: str | None) -> KernelTuning:
    if override is not None:
        tuning = read_tuning(override)
        if tuning.device != name:
            raise ValueError(f"{ENV}={override} is for {tuning.device!r}, this device is "
                             f"{name!r}: unset it or write one here (benchmarks/paged_kernel.py "
                             f"--sweep --write-tuning FILE)")
        return tuning
    return shipped_tunings().get(name) or KernelTuning(device=name)


def update_tuning(path: str | Path, device: str, section: str, source: str,
                  **settings) -> KernelTuning:
    """Writes ``settings`` (``decode=`` or ``write_warps=``) of ``section`` with their
    ``source`` into the tuning file at ``path`` for ``device``, keeping its other section
    (a new file: the defaults there); ValueError when the file is for another device."""
    _check(section in SECTIONS, "section", str(SECTIONS), section)
    tuning = read_tuning(path) if Path(path).is_file() else KernelTuning(device=device)
    if tuning.device != device:
        raise ValueError(f"{path} is for {tuning.device!r}, this device is {device!r}: name "
                         f"another file")
    tuning = dataclasses.replace(tuning, source={**tuning.source, section: source}, **settings)
    write_tuning(path, tuning)
    return tuning


def pick_fastest(seconds: dict, default, margin: float = 0.02):
    """The key of ``seconds`` with the least time, unless ``default``'s time is within
    ``margin`` of it (timings differ by a percent or two between runs: a setting changes only
    on a clear gain)."""
    best = min(seconds, key=seconds.get)
    if default in seconds and seconds[default] <= (1 + margin) * seconds[best]:
        return default
    return best
