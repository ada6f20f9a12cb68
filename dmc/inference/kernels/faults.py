"""Block-table entries that are not pages of the pool: skipped by the kernels, counted on the
device, raised on the host.

A decode step's writes land where the device decides (DMC appends or merges, DMS keeps or
drops), on pages the block allocator reserved before the step ran
(:meth:`~dmc.inference.block_allocator.BlockAllocator.reserve_step`). A reservation bug leaves
an entry of -1 (never reserved) where a write or a read goes; followed, it reads or writes
memory outside the pool: on a GPU an illegal address that ends the CUDA context, or another
sequence's page. So the kernels that follow entries decided on the device check them: the
compiled CPU kernels (:mod:`.native`) raise at once; the Triton paged decode, DMC write and
DMS write cannot stop the host, so they skip the read or write and count it in a *fault counter*, a
device tensor ``[2]`` int64 (:func:`fault_counter`): the entries met, and the flat index
``(sequence slot * layers + layer) * kv_heads + head`` of one of them (-1 when only reads
found them, which do not know the sequence slot); the PyTorch move of a DMS token out of its
window ring (:class:`~dmc.inference.dms_cache.DMSPagedCache`'s oracle, the CPU's static steps)
counts too, but writes anyway (skipping would take a synchronisation). The host reads
the counter with the step's lengths, in the same copy (:meth:`BlockAllocator.settle
<dmc.inference.block_allocator.BlockAllocator.settle>`, or the overlapped step's read-back),
and raises :class:`UnreservedPageError` (:func:`raise_faults`). The CPU's PyTorch paths (where
no C compiler built the compiled kernels) raise at once too (:func:`refuse_outside_pool`: on the
CPU a check costs no synchronisation).
"""
from __future__ import annotations

import functools

import torch


class UnreservedPageError(RuntimeError):
    """A kernel met a block-table entry that is not a page of the pool (-1: a page the caller
    did not reserve, or one past the pool) and left that read or write undone instead of going
    outside the pool's memory."""


def fault_counter(device: torch.device | str) -> torch.Tensor:
    """A new fault counter on ``device``: ``[entries met, flat head index of one]``, int64."""
    return torch.tensor([0, -1], dtype=torch.int64, device=device)


@functools.cache
def unread_counter(device: torch.device) -> torch.Tensor:
    """A fault counter nobody reads, one per device: for kernel calls outside a cache (tests,
    benchmarks), so that such a call makes no allocation or host copy."""
    return fault_counter(device)


def outside_pool(pages: torch.Tensor, num_pages: int) -> torch.Tensor:
    """Where the block-table entries ``pages`` are no page of a pool of ``num_pages``."""
    return (pages < 0) | (pages >= num_pages)


def refuse_outside_pool(pages: torch.Tensor, num_pages: int, needed: torch.Tensor, what: str,
                        where) -> None:
    """On the CPU, raise :class:`UnreservedPageError` before a PyTorch path reads or writes
    through ``pages`` where ``needed`` (bool, broadcast to ``pages``) and an entry is no page
    of the pool; ``where(index)`` names the entry at ``index`` (a tuple into ``pages``). A
    no-op on other devices (a check there would wait for the device: the counter's job)."""
    if pages.device.type != "cpu":
        return
    bad = outside_pool(pages, num_pages) & needed
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise UnreservedPageError(
            f"{what}: {int(bad.sum())} block-table entr{'y' if int(bad.sum()) == 1 else 'ies'} "
            f"not pages of the pool (-1: never reserved), e.g. {where(first)}; nothing was "
            f"read or written through them. The pages of a step are reserved before it runs: "
            f"this is a bug in the reservation.")


def count_faults(faults: torch.Tensor, bad: torch.Tensor, where: torch.Tensor) -> None:
    """Add the entries marked in ``bad`` (bool) to ``faults``, and one of their flat head
    indices ``where`` (long, broadcast to ``bad``) as its location: device work only, no
    synchronisation (capturable in a CUDA graph)."""
    faults[0] += bad.sum()
    located = torch.where(bad, where, torch.full_like(where, -1)).max()
    faults[1] = torch.maximum(faults[1], located)


def read_with_faults(faults: torch.Tensor, shape: tuple[int, int],
                     *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """``tensors`` (on the device; None passes through) on the host as float64 (exact for
    lengths and token ids), in one copy together with the counter ``faults``, which
    :func:`raise_faults` checks (``shape``: the model's ``(layers, kv_heads)``)."""
    given = [t.double().flatten() for t in tensors if t is not None]
    host = torch.cat(given + [faults.double()]).cpu()
    raise_faults(host[-2:], *shape)
    out, start = [], 0
    for tensor in tensors:
        if tensor is not None:
            size = tensor.numel()
            tensor, start = host[start:start + size].view(tensor.shape), start + size
        out.append(tensor)
    return out


def raise_faults(host_faults: torch.Tensor, num_layers: int, num_kv_heads: int) -> None:
    """Raise :class:`UnreservedPageError` when ``host_faults`` (a counter read back) counts any
    entry, naming the (sequence slot, layer, KV head) it located."""
    count, flat = (int(x) for x in host_faults)
    if not count:
        return
    where = "in a read (attention; no write located)"
    if flat >= 0:
        seq, rest = divmod(flat, num_layers * num_kv_heads)
        where = f"e.g. sequence slot {seq}, layer {rest // num_kv_heads}, KV head " \
                f"{rest % num_kv_heads}"
    raise UnreservedPageError(
        f"a decode step met {count} block-table entr{'y' if count == 1 else 'ies'} that are "
        f"not pages of the pool (-1: never reserved), {where}; the kernels left those reads "
        f"and writes undone. The pages of a step are reserved before it runs "
        f"(BlockAllocator.reserve_step): this is a bug in the reservation.")
