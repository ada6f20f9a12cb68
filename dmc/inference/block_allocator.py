"""Pages of the paged KV cache: the free list, sequence slots, and per-(sequence, layer, KV head)
block tables and lengths.

Under DMC every (sequence, layer, KV head) keeps its own number of slots, so each of them has its
own row of page ids and its own length, all drawing pages from ONE pool:

* ``tables``: ``[max_seqs, num_layers, num_kv_heads, max_pages_per_head]`` int32 page ids, ``-1``
  where a head has no page;
* ``lengths``: ``[max_seqs, num_layers, num_kv_heads]`` int32 slots per head.

A head of length ``n`` owns exactly ``ceil(n / page_size)`` pages; a page is taken from the free
list only when a head grows past a page boundary, and all of a sequence's pages return to it when
the sequence is freed. Allocation runs on the host against ``tables`` and ``lengths``; the device
copies (``device_tables``, ``device_lengths``, the same tensors on CPU) are updated after every
change. It is all-or-nothing: :class:`CacheFullError` is raised before anything changes.

A decode step whose appends are decided on the device (DMC) is *open* from :meth:`reserve_step`
to :meth:`settle`: its heads' next pages are reserved before it runs, and the device lengths run
ahead of the host ones until its lengths come back. Up to :data:`MAX_OPEN_STEPS` steps may be
open at once, each later one of the same sequences as the one before or of some of them (the
engine's overlap of a step's host work with the previous step's device work, which goes on
when some sequences end: :mod:`dmc.inference.overlap`): each head then keeps a page for every
slot the open steps that write it may still add, and a step settles from the lengths its
device work reached (read back by the caller while the next step runs).
The kernels count the block-table entries they meet outside the pool in ``faults``, which
:meth:`settle` reads with the lengths and checks (:mod:`~dmc.inference.kernels.faults`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from dmc.inference.kernels.faults import fault_counter, raise_faults, read_with_faults
from dmc.inference.paging import at_page_boundary, page_and_offset, pages_for, to_device


class CacheFullError(RuntimeError):
    """The cache cannot hold a request (pages, per-head table width or sequence slots)."""


class SeqRows(NamedTuple):
    """Sequence slots validated once (:meth:`BlockAllocator.rows`): ``host [batch]`` long and the
    same on the device. Every cache method taking ``seq_slots`` takes one, so the layers of a
    decode step share one validation and one copy."""

    host: torch.Tensor
    device: torch.Tensor


class TableEntries(NamedTuple):
    """Block-table entries ``tables[seq, layer, head, column] = pages``, each a host ``[n]``
    tensor (long; ``pages`` int32)."""

    seq: torch.Tensor
    layer: torch.Tensor
    head: torch.Tensor
    column: torch.Tensor
    pages: torch.Tensor

    @property
    def index(self) -> tuple[torch.Tensor, ...]:
        return self.seq, self.layer, self.head, self.column


MAX_OPEN_STEPS = 2  # a step in flight and the next one, launched before the first settles


@dataclass
class OpenStep:
    """A decode step between :meth:`BlockAllocator.reserve_step` and
    :meth:`BlockAllocator.settle`: its sequences (host ``[batch]`` long), the layers written
    (:meth:`BlockAllocator.claim`) and the reserved pages not yet known to be used."""

    seqs: torch.Tensor
    written: set
    reserved: TableEntries


class BlockAllocator:
    """Free list, sequence slots, block tables and lengths (see the module docstring).

    Args:
        num_layers, num_kv_heads: model shape; num_pages: pages in the pool; page_size: slots per
        page; max_seqs: sequence slots; max_pages_per_head: width of a block table row;
        device: where the device copies live.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
                 max_seqs: int, max_pages_per_head: int, device: torch.device):
        self.num_pages, self.page_size, self.max_seqs = num_pages, page_size, max_seqs
        self.max_pages_per_head, self.device = max_pages_per_head, device
        heads = (max_seqs, num_layers, num_kv_heads)
        self.tables = torch.full(heads + (max_pages_per_head,), -1, dtype=torch.int32)
        self.lengths = torch.zeros(heads, dtype=torch.int32)
        self.device_tables = self.tables.to(device)  # same tensor on CPU
        self.device_lengths = self.lengths.to(device)
        self.faults = fault_counter(device)
        # the free pages as a stack (a tensor: a decode step takes and gives back thousands of
        # pages, which a Python list converts one by one); page 0 on top, taken first
        self._free = torch.arange(num_pages - 1, -1, -1, dtype=torch.int32)
        self._free_count = num_pages
        self._free_seqs = list(range(max_seqs - 1, -1, -1))
        self._active = [False] * max_seqs
        self.steps: list[OpenStep] = []  # the open decode steps, oldest first

    @property
    def free_pages(self) -> int:
        return self._free_count

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - self._free_count

    @property
    def free_list(self) -> list[int]:
        """The free page ids, the next to be taken last."""
        return self._free[:self._free_count].tolist()

    def add_sequence(self) -> int:
        """Claim a free sequence slot (all heads empty) and return its id."""
        if not self._free_seqs:
            raise CacheFullError(f"all {self.max_seqs} sequence slots are in use")
        slot = self._free_seqs.pop()
        self._active[slot] = True
        return slot

    def free_sequence(self, seq_slot: int) -> None:
        """Return every page of ``seq_slot`` to the free list and release the slot."""
        self.seq_index([seq_slot])
        owned = self.tables[seq_slot]
        self._give_back(owned[owned >= 0])
        owned.fill_(-1)
        self.lengths[seq_slot] = 0
        self.publish(torch.tensor([seq_slot]), slice(None))
        self._active[seq_slot] = False
        self._free_seqs.append(seq_slot)

    def seq_index(self, seq_slots) -> torch.Tensor:
        """Validated host ``[batch]`` long tensor of distinct, active sequence slots (a
        :class:`SeqRows`' own, validated when it was made)."""
        if isinstance(seq_slots, SeqRows):
            return seq_slots.host
        seqs = torch.as_tensor(seq_slots, dtype=torch.long).reshape(-1).cpu()
        slots = seqs.tolist()
        known = all(0 <= s < self.max_seqs and self._active[s] for s in slots)
        if len(set(slots)) != len(slots) or not known:
            raise ValueError(f"sequence slots must be distinct and added: {slots}")
        return seqs

    def rows(self, seq_slots) -> SeqRows:
        """``seq_slots`` validated (:meth:`seq_index`) and copied to the device (a
        :class:`SeqRows` is returned as it is)."""
        if isinstance(seq_slots, SeqRows):
            return seq_slots
        seqs = self.seq_index(seq_slots)
        return SeqRows(seqs, to_device(seqs, self.device))

    def grow(self, seqs: torch.Tensor, layer: int, new_lengths: torch.Tensor) -> None:
        """Set the lengths of heads ``[seqs, layer, :]`` (``new_lengths [batch, kv_heads]``, never
        shorter), taking the pages they newly need; raises before any change when it cannot."""
        self._publish_entries(self._take(seqs, layer, new_lengths))
        self.lengths[seqs, layer] = new_lengths.to(torch.int32)
        self._publish_lengths(seqs, layer)

    def _take(self, seqs: torch.Tensor, layers, new_lengths: torch.Tensor) -> TableEntries:
        """Fill the table columns heads ``[seqs, layers, :]`` (``layers`` an index or a slice) of
        ``new_lengths`` need beyond their current lengths with free pages; raises
        :class:`CacheFullError` before any change. Returns the entries written (the same ops
        whether there are any or not: a step's op count does not depend on its data)."""
        layer_ids = torch.arange(self.lengths.shape[1])[layers].reshape(-1)
        old = self.lengths[seqs][:, layer_ids].long()  # [batch, layers, kv]
        old_pages = pages_for(old, self.page_size)
        new_pages = pages_for(new_lengths.reshape(old.shape), self.page_size)
        if (new_pages > self.max_pages_per_head).any():
            raise self._too_long(int(new_lengths.max()))
        count = new_pages - old_pages
        b, layer, h = count.nonzero(as_tuple=True)
        per_head = count[b, layer, h]
        first_new = old_pages[b, layer, h] - (torch.cumsum(per_head, 0) - per_head)
        columns = first_new.repeat_interleave(per_head) + torch.arange(int(per_head.sum()))
        index = [part.repeat_interleave(per_head) for part in (seqs[b], layer_ids[layer], h)]
        return self._fill(*index, columns)

    def _take_next(self, seqs: torch.Tensor, heads: torch.Tensor, ahead: int = 0) -> TableEntries:
        """:meth:`_take` for the slot ``ahead`` past the current length of each head marked in
        ``heads [batch, layers, kv]`` (host bool): the page that slot falls in, where the head
        holds none yet (a decode step's case, without the general case's passes over every
        head)."""
        b, layer, h = heads.nonzero(as_tuple=True)
        seq = seqs[b]
        columns, _ = page_and_offset(self.lengths[seq, layer, h].long() + ahead, self.page_size)
        if (columns >= self.max_pages_per_head).any():
            raise self._too_long(int(columns.max()) * self.page_size + 1)
        width = self.max_pages_per_head
        flat = ((seq * self.lengths.shape[1] + layer) * self.lengths.shape[2] + h) * width
        empty = (self.tables.view(-1)[flat + columns] < 0).nonzero()[:, 0]
        return self._fill(seq[empty], layer[empty], h[empty], columns[empty])

    def _fill(self, seq, layer, head, columns) -> TableEntries:
        """Free pages into ``tables[seq, layer, head, columns]`` (host long ``[n]`` each);
        raises :class:`CacheFullError` before any change when fewer than ``n`` are free."""
        needed, free = len(columns), self._free_count
        if needed > free:
            raise CacheFullError(f"need {needed} pages, only {free} free of {self.num_pages}")
        self._free_count = free - needed
        taken = self._free[free - needed:free].flip(0)  # a copy, top of the stack first
        entries = TableEntries(seq, layer, head, columns, taken)
        self.tables[entries.index] = entries.pages
        return entries

    def _give_back(self, pages: torch.Tensor) -> None:
        """Push the page ids ``pages`` (host int32 ``[n]``) onto the free stack."""
        count = self._free_count
        self._free[count:count + len(pages)] = pages
        self._free_count = count + len(pages)

    def _too_long(self, slots: int) -> CacheFullError:
        return CacheFullError(
            f"a head would hold {slots} slots, more than {self.max_pages_per_head} pages of "
            f"{self.page_size} (max_seq_len)"
        )

    def append_all(self, seqs: SeqRows) -> tuple[torch.Tensor, torch.Tensor]:
        """One more slot for every head of every layer of ``seqs`` (a vanilla decode step,
        whose every head appends): pages taken, lengths set and published in one go. Returns
        the host ``(page, offset)`` of each new slot, ``[batch, num_layers, kv_heads]`` long."""
        slots = self.lengths[seqs.host]
        self._publish_entries(self._take_next(seqs.host, at_page_boundary(slots, self.page_size)))
        self.lengths[seqs.host] = slots + 1
        self._publish_lengths(seqs.host, slice(None))
        layers, heads = (torch.arange(n) for n in slots.shape[1:])
        return self._pages_of(seqs.host[:, None, None], layers[:, None], heads, slots.long())

    def _pages_of(self, seqs, layers, heads, slots) -> tuple[torch.Tensor, torch.Tensor]:
        """Host long ``(page, offset)`` of slot ``slots`` of heads ``(seqs, layers, heads)``
        (long tensors broadcasting to one shape), read through one flat index."""
        column, offset = page_and_offset(slots, self.page_size)
        _, num_layers, num_heads, width = self.tables.shape
        flat = ((seqs * num_layers + layers) * num_heads + heads) * width + column
        return self.tables.view(-1)[flat].long(), offset

    # ---------------------------------------------- a decode step decided on the device
    @property
    def step(self) -> OpenStep | None:
        """The newest open decode step (None when none is open)."""
        return self.steps[-1] if self.steps else None

    @property
    def lookahead(self) -> int:
        """Slots the open steps may add past the host lengths of a head, at most: one per open
        step; where the host lengths are the device's (CPU), one per open step not written yet
        (the writes update them)."""
        return sum(map(self._ahead, self.steps))

    def _ahead(self, step: OpenStep) -> int:
        """Slots ``step`` may still add past the host length of a head it writes."""
        shared = self.device_lengths is self.lengths
        return int(not shared or len(step.written) < self.lengths.shape[1])

    def _ahead_of(self, seqs: torch.Tensor) -> torch.Tensor:
        """:attr:`lookahead` for each of ``seqs`` (host long ``[n]``): from the open steps that
        write it only (a sequence left out of the newer step adds nothing after its own)."""
        ahead = torch.zeros(len(seqs), dtype=torch.long)
        for step in self.steps:
            ahead += torch.isin(seqs, step.seqs).long() * self._ahead(step)
        return ahead

    def holds(self, seq_slots: torch.Tensor) -> bool:
        """Whether an open step writes any of ``seq_slots`` (host long)."""
        return any(torch.isin(seq_slots.reshape(-1), step.seqs).any() for step in self.steps)

    def reserve_step(self, seqs: torch.Tensor, heads: torch.Tensor) -> None:
        """Open a decode step whose writes are decided on the device: each head of ``[seqs]``
        marked in ``heads [batch, num_layers, kv_heads]`` (host bool) gets the page its next
        slot falls in when it holds none, for every layer in one allocation and one copy to
        the device. Its next slot is :attr:`lookahead` past the host length: with a step of
        these ``seqs`` (or of more sequences) still open, the one that step may add comes
        first. Until :meth:`settle` the device lengths of ``seqs`` may run ahead of the host
        ones, and each layer is written once (:meth:`claim`)."""
        if self.steps and (len(self.steps) >= MAX_OPEN_STEPS
                           or not torch.isin(seqs, self.steps[-1].seqs).all()):
            raise RuntimeError(f"{len(self.steps)} decode steps are open (at most "
                               f"{MAX_OPEN_STEPS - 1}, of these sequences or more, may be open "
                               f"when the next is reserved): settle first")
        reserved = self._take_next(seqs, heads, self.lookahead)
        self._publish_entries(reserved)
        self.steps.append(OpenStep(seqs, set(), reserved))

    def claim(self, seqs: torch.Tensor, layer: int) -> None:
        """Check that a write of ``layer`` for ``seqs`` (host ``[batch]``) uses the pages of the
        newest open step (:meth:`reserve_step`), once per layer; raises ``RuntimeError``
        otherwise (an append decided on the device could land on a page it does not own)."""
        step = self.step
        if step is None or not torch.equal(seqs, step.seqs) or layer in step.written:
            raise RuntimeError(f"a deferred write of layer {layer} for sequences "
                               f"{seqs.tolist()} needs its own reserve_step (begin_decode)")
        step.written.add(layer)

    def step_lengths(self) -> torch.Tensor | None:
        """The device lengths of the newest open step's sequences, ``[batch, num_layers,
        kv_heads]`` (a copy on the device, to read back while a later step runs), or None where
        no step is open or the host lengths are the device's."""
        if self.step is None or self.device_lengths is self.lengths:
            return None
        return self.device_lengths[to_device(self.step.seqs, self.device)]

    def settle(self, carry: torch.Tensor | None = None,
               reached: torch.Tensor | None = None) -> torch.Tensor | None:
        """Close the oldest open step. Its lengths: ``reached`` (host, what
        :meth:`step_lengths` gave when its device work ended; the caller checks the fault
        counter read with them), else its sequences' device lengths read now (no later step
        open), in one copy with ``carry`` (a float64 device tensor, returned on the host; None
        without it) and :attr:`faults`, checked. Then the pages reserved for heads no open step
        can fill any more go back to the free list; only those entries go to the device."""
        if not self.steps:
            return None if carry is None else self._fetch(carry)[0]
        step = self.steps.pop(0)
        if self.device_lengths is self.lengths:  # the CPU: the writes went to these lengths
            carry = self._fetch(carry)[0]
        elif reached is None:
            if self.steps:
                raise RuntimeError("settle: a later step is open; pass the lengths this step "
                                   "reached (step_lengths, read when its device work ended)")
            reached, carry = self._fetch(self.device_lengths[to_device(step.seqs, self.device)],
                                         carry)
            self.lengths[step.seqs] = reached.to(torch.int32)
        else:
            self.lengths[step.seqs] = reached.cpu().to(torch.int32)
            carry = None if carry is None else carry.cpu()
        self._release_unused(step.reserved)
        return carry

    def _fetch(self, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
        return read_with_faults(self.faults, self.lengths.shape[1:], *tensors)

    def check_faults(self, host_faults: torch.Tensor) -> None:
        """:func:`~dmc.inference.kernels.faults.raise_faults` of a counter read back."""
        raise_faults(host_faults, *self.lengths.shape[1:])

    def _release_unused(self, reserved: TableEntries) -> None:
        """Give back the ``reserved`` pages past what their heads' lengths and the slots the
        open steps writing them may still add need; hand those the open steps may still fill
        (past the lengths, within the look-ahead) on to the next open step, whose settle
        checks them again. A sequence no open step writes keeps only the pages of its length
        (none is handed on: the caller may free it)."""
        lengths = self.lengths[reserved.index[:3]].long()
        ahead = self._ahead_of(reserved.seq)
        unused = pages_for(lengths + ahead, self.page_size) <= reserved.column
        self._give_back(reserved.pages[unused])
        dropped = TableEntries(*(i[unused] for i in reserved.index),
                               torch.full((int(unused.sum()),), -1, dtype=torch.int32))
        self.tables[dropped.index] = dropped.pages
        self._publish_entries(dropped)
        if self.steps:
            undecided = ~unused & (pages_for(lengths, self.page_size) <= reserved.column)
            kept = TableEntries(*(i[undecided] for i in reserved))
            later = self.steps[0].reserved
            self.steps[0].reserved = TableEntries(*(torch.cat(pair) for pair in zip(kept, later)))

    def shrink(self, seqs: torch.Tensor, layer, new_lengths: torch.Tensor) -> None:
        """Set the lengths of heads ``[seqs, layer, :]`` (``layer`` an index or a slice; never
        longer) and return the pages past ``ceil(new_length / page_size)`` to the free list."""
        columns = torch.arange(self.max_pages_per_head)
        table = self.tables[seqs, layer]
        drop = (columns >= pages_for(new_lengths, self.page_size)[..., None]) & (table >= 0)
        self._give_back(table[drop])
        table[drop] = -1
        self.tables[seqs, layer] = table
        self.lengths[seqs, layer] = new_lengths.to(torch.int32)
        self.publish(seqs, layer)

    def locate(self, seqs, layer: int, heads, slots) -> tuple[torch.Tensor, torch.Tensor]:
        """Device ``(page, offset)`` of slot ``slots`` of heads ``(seqs, layer, heads)`` (host
        long tensors of one shape)."""
        pages, offsets = self._pages_of(seqs, layer, heads, slots)
        return to_device(pages, self.device), to_device(offsets, self.device)

    def publish(self, seqs: torch.Tensor, layer) -> None:
        """Copy the host block tables and lengths of ``[seqs, layer]`` to the device."""
        if self.device_tables is not self.tables:
            self.device_tables[to_device(seqs, self.device), layer] = to_device(
                self.tables[seqs, layer], self.device)
        self._publish_lengths(seqs, layer)

    def _publish_lengths(self, seqs: torch.Tensor, layer) -> None:
        """Copy the host lengths of ``[seqs, layer]`` to the device."""
        if self.device_lengths is not self.lengths:
            self.device_lengths[to_device(seqs, self.device), layer] = to_device(
                self.lengths[seqs, layer], self.device)

    def _publish_entries(self, entries: TableEntries) -> None:
        """Copy the table entries ``entries`` (host) to the device in one transfer: a decode
        step changes a few entries, while the rows of its heads are ``max_pages_per_head`` wide
        (the gpu preset's DMC 8x batch of 263: 43 MB of rows, copied twice per step before)."""
        if self.device_tables is self.tables or not len(entries.pages):
            return
        packed = to_device(torch.stack([*entries.index, entries.pages.long()]), self.device)
        self.device_tables[tuple(packed[:4])] = packed[4].to(torch.int32)
