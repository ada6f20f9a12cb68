"""Kernels of the paged per-head KV cache and the switch between Triton and PyTorch.

``run_paged_decode`` and ``run_dmc_write`` take ``use_triton``: ``None`` picks Triton for CUDA
tensors and the CPU path otherwise (the batched :func:`paged_decode_batched` and the in-place
:func:`dmc_write_inplace`, each running the compiled C kernel of :mod:`.native` where it applies
and PyTorch otherwise); the references stay the oracles of every path; ``True`` on CPU tensors
needs ``TRITON_INTERPRET=1`` (the tests). The Triton modules are imported on first use, so the
interpreter setting is read then, not when ``dmc.inference`` is imported.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from dmc.ops.rope import apply_rope, rope_inv_freq

from .paged_cpu import paged_decode_batched
from .reference import dmc_write_reference, paged_decode_reference
from .write_cpu import dmc_write_inplace

__all__ = [
    "DecisionChannel",
    "EvictionChannel",
    "apply_rope",
    "dmc_write_inplace",
    "dmc_write_reference",
    "paged_decode_batched",
    "paged_decode_reference",
    "resolve_use_triton",
    "rope_inv_freq",
    "run_decode_rope",
    "run_delayed_write",
    "run_dmc_write",
    "run_paged_decode",
    "run_rope_append",
]


def resolve_use_triton(device: torch.device, use_triton: bool | None = None) -> bool:
    """Triton on CUDA, PyTorch on CPU; Triton on CPU only under ``TRITON_INTERPRET=1``."""
    if use_triton is None:
        return device.type == "cuda"
    if use_triton and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before the kernel modules "
            "are imported; pass use_triton=False (or None) to use the PyTorch reference"
        )
    return use_triton


def run_paged_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    use_triton: bool | None = None,
    num_splits: int | None = None,
    max_length: int | None = None,
    host_lengths: torch.Tensor | None = None,
    faults: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention ``q [batch, q_heads, head_dim] -> [batch, q_heads, head_dim]``.

    See :func:`paged_decode_reference` for the arguments; ``num_splits`` and ``max_length`` only
    tune the Triton kernel, ``host_lengths`` (``lengths`` on the host, ``[batch, kv_heads]``)
    saves the PyTorch path a device read; ``faults``: the Triton kernel's fault counter
    (:mod:`.faults`; the compiled CPU kernel raises instead).
    """
    if q.shape[1] % block_tables.shape[1]:
        raise ValueError(
            f"{q.shape[1]} query heads do not split into {block_tables.shape[1]} KV heads"
        )
    if resolve_use_triton(q.device, use_triton):
        from .paged_decode import paged_decode

        return paged_decode(
            q, k_pages, v_pages, block_tables, lengths, scale,
            num_splits=num_splits, max_length=max_length, faults=faults,
        )
    return paged_decode_batched(q, k_pages, v_pages, block_tables, lengths, scale,
                                host_lengths=host_lengths)


def run_dmc_write(*tensors, use_triton=None, faults=None, decide=None,
                  query=None) -> torch.Tensor | None:
    """DMC append/merge write (Algorithm 1, Eq. 9); arguments (plain tensors and ints) as
    :func:`dmc_write_reference`; ``faults``: the Triton kernel's fault counter (:mod:`.faults`;
    the compiled CPU kernel raises instead); ``decide``: the Triton kernel takes the decisions
    itself; ``query``: it also reads the importance from the step's queries and returns them
    rotated (:func:`.dmc_write.dmc_write`; both Triton only)."""
    if resolve_use_triton(tensors[0].device, use_triton):
        from .dmc_write import dmc_write

        return dmc_write(*tensors, faults=faults, decide=decide, query=query)
    if decide is not None or query is not None:
        raise ValueError("run_dmc_write: decide= and query= need the Triton kernel")
    dmc_write_inplace(*tensors)
    return None


class DecisionChannel(NamedTuple):
    """DMC's importance read from the last query channel (Sec. 3.2,
    :func:`~dmc.ops.decisions.importance`): ``omega = max(sigmoid(mean over each KV group of
    q[..., -1] + c) + offset, OMEGA_MIN)``; the channel is zeroed before and after RoPE."""

    kv_heads: int
    c: float
    offset: float = 0.0


class EvictionChannel(NamedTuple):
    """DMS's eviction read from the last channel of each KV group's first query head (DMS paper
    Sec. 3.1, :func:`~dmc.ops.decisions.split_dms_channels`): ``evict = [q[..., -1] * scale -
    c > 0]``; that channel is zeroed before and after RoPE."""

    kv_heads: int
    c: float
    scale: float


def run_rope_append(*tensors, faults=None) -> torch.Tensor:
    """Triton vanilla decode write of one layer (:func:`.rope_append.rope_append`: the keys
    and queries rotated, the keys and values stored, one launch; same arguments); returns the
    rotated queries. Triton only."""
    from .rope_append import rope_append

    return rope_append(*tensors, faults=faults)


def run_delayed_write(*tensors, faults=None, query=None) -> torch.Tensor | None:
    """Triton decode write of DMC with delayed merging (:func:`.delayed_write.delayed_write`:
    the ring's leaving token through Algorithm 1, the step's token into the ring, one launch;
    same arguments); returns the rotated queries with ``query``. Triton only."""
    from .delayed_write import delayed_write

    return delayed_write(*tensors, faults=faults, query=query)


def run_decode_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    decision: DecisionChannel | EvictionChannel | None = None):
    """Triton RoPE of a decode step's rows (:func:`.decode_rope.decode_rope`: float32 rotated
    ``x``, and DMC's importance or DMS's eviction ``[batch, kv_heads]`` per ``decision``);
    Triton only."""
    from .decode_rope import decode_rope

    return decode_rope(x, cos, sin, decision)
