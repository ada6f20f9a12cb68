"""Paged, per-head, variable-length KV cache for DMC inference (Algorithm 1 of the paper).

The pages, free list, block tables and lengths are the :class:`BlockAllocator`'s (``allocator``);
this module holds the storage: ONE pool of pages per model, ``k_pages``, ``v_pages``
``[num_pages, page_size, head_dim]`` in the cache dtype (slot ``n`` of a head at
``k_pages[block_tables[seq, layer, head, n // page_size], n % page_size]``), and the DMC merge
state of each head's open (last) slot (Eq. 9), so that merging at inference equals the
training-time accumulation:

* ``open_k``, ``open_v``: ``[max_seqs, num_layers, num_kv_heads, rows, head_dim]`` pre-RoPE;
* ``open_omega``: ``[max_seqs, num_layers, num_kv_heads, rows]``;
* ``open_count``: ``[max_seqs, num_layers, num_kv_heads]`` int32 tokens merged into the open slot.

With ``window=w`` the rows (``rows = w``) are a ring of the open slot's last ``w`` tokens (token
``j`` of the slot in row ``j % w``), keys and values in ``ring_dtype`` (the model's holds its
own outputs exactly, the mean is taken in float32), omegas in float32. With ``window=None``
(exact Eq. 9) one float32 row holds the running pre-RoPE mean and its running weight ``z``.

Deferred DMC writes (``write(..., defer=True)``: decided on the device) run between
:meth:`begin_decode` (every layer's next pages reserved at once: the writes take no page, make
no host work) and :meth:`settle` (lengths, sampled tokens and the kernels' fault counter
(:mod:`.kernels.faults`) read back in one copy; heads that merged return their pages). The host
lengths lag until then on a GPU; all but :meth:`write` and :meth:`attention` settle first.
"""
from __future__ import annotations

import math

import torch

from dmc.ops.algorithm1 import KeyDecision, OpenSlot, ring_from_tail

from .block_allocator import BlockAllocator, SeqRows
from .eviction import SlotEviction
from .paging import at_page_boundary, pages_for, to_device
from .kernels import (
    resolve_use_triton,
    rope_inv_freq,
    run_dmc_write,
    run_paged_decode,
    run_rope_append,
)

RING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of the window ring's keys, values


def open_slot_bytes(rows: int, head_dim: int, ring_dtype: torch.dtype) -> int:
    """Bytes of one head's open-slot state: ``rows`` keys and values in ``ring_dtype``, their
    float32 omegas and the int32 count (``rows`` = the window, 1 for the exact running mean)."""
    return rows * (2 * head_dim * torch.empty((), dtype=ring_dtype).element_size() + 4) + 4


def merge_ring_dtype(window: int | None, merge_delay: int, model_dtype: torch.dtype) -> torch.dtype:
    """dtype of a DMC cache's merge ring: ``model_dtype`` (the keys and values the model writes,
    held exactly) with a ``window`` and no ``merge_delay``; float32 otherwise (the running mean
    accumulates, and delayed merging's ring takes keys rotated back from the cache dtype)."""
    exact = window and not merge_delay and model_dtype in RING_DTYPES
    return model_dtype if exact else torch.float32


class PagedKVCache(SlotEviction):
    """Page pools and DMC open-slot state over a :class:`BlockAllocator`.

    Args:
        num_layers, num_kv_heads, head_dim: model shape (``head_dim`` even, for RoPE).
        num_pages: pages in the pool, each ``page_size`` slots of one head.
        page_size: slots per page.
        max_seqs: sequence slots (concurrent sequences).
        window: DMC merge window ``w`` (12 in the paper), ``None`` for the exact running mean.
        dtype, device: of the page pools.
        max_seq_len: most slots one head may hold; sets ``max_pages_per_head``.
        rope_base: RoPE base (``rope_theta``) of the keys the cache rotates.
        inv_freq: ``[head_dim // 2]`` RoPE frequencies (e.g. the model's, Llama 3.x scaling
            included); default: plain RoPE of ``rope_base``.
        ring_dtype: dtype of the window ring's keys and values (:data:`RING_DTYPES`; float32
            with ``window=None``): the dtype of the keys and values given to :meth:`write`
            and :meth:`pack_prefill` holds them exactly.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int = 16, max_seqs: int = 64, window: int | None = 12,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", *,
                 max_seq_len: int = 4096, rope_base: float = 10000.0,
                 inv_freq: torch.Tensor | None = None, ring_dtype: torch.dtype = torch.float32):
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        if window is not None and window < 1:
            raise ValueError(f"window must be None or >= 1, got {window}")
        accepted = RING_DTYPES if window else RING_DTYPES[:1]  # a running mean accumulates
        if ring_dtype not in accepted:
            raise ValueError(f"ring_dtype: accepted {', '.join(map(str, accepted))} with window="
                             f"{window}, got {ring_dtype}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_pages, self.page_size, self.max_seqs = num_pages, page_size, max_seqs
        self.window, self.dtype, self.device = window, dtype, torch.device(device)
        self.max_pages_per_head = math.ceil(max_seq_len / page_size)
        self.allocator = BlockAllocator(num_layers, num_kv_heads, num_pages, page_size, max_seqs,
                                        self.max_pages_per_head, self.device)
        pool = (num_pages, page_size, head_dim)
        self.k_pages = torch.zeros(pool, dtype=dtype, device=self.device)
        self.v_pages = torch.zeros(pool, dtype=dtype, device=self.device)
        heads, rows = (max_seqs, num_layers, num_kv_heads), window or 1
        self.open_k = torch.zeros(heads + (rows, head_dim), dtype=ring_dtype, device=self.device)
        self.open_v = torch.zeros_like(self.open_k)
        self.open_omega = torch.zeros(heads + (rows,), dtype=torch.float32, device=self.device)
        self.open_count = torch.zeros(heads, dtype=torch.int32, device=self.device)
        if inv_freq is None:
            inv_freq = rope_inv_freq(head_dim, rope_base)
        self.inv_freq = inv_freq.float().to(self.device)

    # ----------------------------------------------------------------- stats
    @property
    def free_pages(self) -> int:
        return self.allocator.free_pages

    @property
    def pages_in_use(self) -> int:
        return self.allocator.pages_in_use

    @property
    def block_tables(self) -> torch.Tensor:
        """``[max_seqs, num_layers, num_kv_heads, max_pages_per_head]`` int32 page ids (device)."""
        return self.allocator.device_tables

    @property
    def lengths(self) -> torch.Tensor:
        """``[max_seqs, num_layers, num_kv_heads]`` int32 slots per head (device)."""
        return self.allocator.device_lengths

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of keys plus its page of values."""
        return 2 * self.page_size * self.head_dim * self.k_pages.element_size()

    def sequence_bytes(self, seq_slot: int, dmc_state: bool = True) -> dict:
        """Bytes held for one sequence: ``kv`` (its pages of keys and values), ``metadata`` (a
        4-byte block-table entry per page it uses, not the table's preallocated width, and a
        4-byte length per head) and, with ``dmc_state``, ``dmc_state``: the open slot's merge
        state of every (layer, KV head) (ring of ``window`` pre-RoPE keys and values in the
        ring dtype and their float32 omegas, or the float32 running mean and ``z``, plus the
        int32 token count), allocated whether or not a head merges."""
        self._settle_for([seq_slot])
        lengths = self.allocator.lengths[seq_slot].long()
        pages = int(pages_for(lengths, self.page_size).sum())
        heads = lengths.numel()
        out = {"kv": pages * self.page_bytes,
               "metadata": pages * self.allocator.tables.element_size() + heads * 4,
               "dmc_state": 0}
        if dmc_state:
            rows = self.open_omega.shape[-1]
            out["dmc_state"] = heads * open_slot_bytes(rows, self.head_dim, self.open_k.dtype)
        return out

    def head_lengths(self, seq_slot: int) -> torch.Tensor:
        """Slots per head of one sequence, ``[num_layers, num_kv_heads]`` (host copy)."""
        self._settle_for([seq_slot])
        return self.allocator.lengths[seq_slot].clone()

    def held_slots(self, seq_slot: int, paged: torch.Tensor | None = None) -> torch.Tensor:
        """Slots a query of the sequence attends, ``[num_layers, num_kv_heads]`` (host long);
        ``paged``: its lengths as an overlapped step left them, instead of the current ones."""
        return (self.head_lengths(seq_slot) if paged is None else paged).long()

    def paged_growth(self, seq_slots: list, tokens: int) -> torch.Tensor:
        """Paged slots each head gains at most from ``tokens`` more: all, ``[n, layers, kv]``
        long for ``seq_slots`` (``None``: a sequence without a slot yet)."""
        return torch.full((len(seq_slots), self.num_layers, self.num_kv_heads), tokens,
                          dtype=torch.long)

    def layer_lengths(self, layer: int, seq_slots) -> torch.Tensor:
        """Slots per head of ``layer`` for ``seq_slots``, ``[batch, num_kv_heads]`` (host, long)."""
        self._settle_for(seq_slots)
        return self.allocator.lengths[self.allocator.seq_index(seq_slots), layer].long()

    def open_state(self, layer: int, seq_slots) -> OpenSlot:
        """The open slot's merge state of ``layer`` for ``seq_slots`` (float32 copies): the ring
        ``[batch, kv_heads, rows, head_dim]`` of pre-RoPE keys and values, its omegas (or ``z``)
        ``[batch, kv_heads, rows]`` and the token counts ``[batch, kv_heads]``."""
        rows = self.allocator.seq_index(seq_slots).to(self.device)
        return OpenSlot(self.open_k[rows, layer].float(), self.open_v[rows, layer].float(),
                        self.open_omega[rows, layer], self.open_count[rows, layer].long())

    # ------------------------------------------------------------- sequences
    def add_sequence(self) -> int:
        """Claim a free sequence slot (all heads empty) and return its id."""
        return self.allocator.add_sequence()

    def free_sequence(self, seq_slot: int) -> None:
        """Return every page of ``seq_slot`` to the free list and release the slot."""
        self._settle_for([seq_slot])
        self.allocator.free_sequence(seq_slot)
        self.open_count[seq_slot] = 0

    # ---------------------------------------------------------------- writes
    def write(self, layer: int, seq_slots, positions, k: torch.Tensor, v: torch.Tensor, omega,
              alpha, *, use_triton: bool | None = None, defer: bool = False,
              query: tuple | None = None) -> torch.Tensor | None:
        """DMC step of one layer: each (sequence, KV head) appends or merges a token (Algorithm 1).

        ``alpha <= 0.5`` (or an empty head) appends a slot holding ``RoPE(k_t, p_t)``, ``v_t``;
        otherwise the token merges into the head's last slot (Eq. 9, windowed or exact, see
        :func:`~dmc.inference.kernels.dmc_write_reference`). Pages are allocated first, only
        for appends that cross a page boundary; on :class:`CacheFullError` nothing changed.

        Args:
            layer: layer index; seq_slots: ``[batch]`` distinct sequence slots (host list, tensor).
            positions: ``[batch]`` absolute position of the token.
            k, v: ``[batch, kv_heads, head_dim]`` pre-RoPE; omega: ``[batch, kv_heads]`` > 0.
            alpha: ``[batch, kv_heads]`` hard decisions, 1 = merge (read on the host unless
                ``defer``), or a :class:`~dmc.ops.algorithm1.KeyDecision` (still in ``k``).
            use_triton: kernel choice, see :func:`~dmc.inference.kernels.resolve_use_triton`.
            defer: decide on the device and leave the host lengths to :meth:`settle`, in the
                step :meth:`begin_decode` opened for ``seq_slots`` (see the module docstring).
            query: with ``defer`` on the Triton path, ``(queries [batch, heads, dim], cos,
                sin, channel)`` of the step: the importance is read from the queries' decision
                channel (:class:`~dmc.inference.kernels.DecisionChannel`; ``omega`` None) and
                the queries rotated by the step's RoPE tables in the same launch.

        Returns:
            with ``query``, the rotated queries (float32); None otherwise.
        """
        seqs, rows = self.allocator.rows(seq_slots)
        kernel_decides = defer and resolve_use_triton(self.device, use_triton)
        if isinstance(alpha, KeyDecision) and not kernel_decides:  # the kernel reads it in k
            alpha, k = alpha.split(k)
        if defer:
            self.allocator.claim(seqs, layer)
            return self._write_decided(layer, rows, positions, k, v, omega, alpha, use_triton,
                                       query=query)
        if query is not None:
            raise ValueError("PagedKVCache.write: query= needs defer=True")
        self._settle_for(seqs)
        lengths = self.allocator.lengths[seqs, layer].long()
        append = (torch.as_tensor(alpha).detach().cpu() <= 0.5) | (lengths == 0)
        self.allocator.grow(seqs, layer, lengths + append.long())
        self._write_decided(layer, rows, positions, k, v, omega, alpha, use_triton,
                            (lengths + append.long(), append))

    def _write_decided(self, layer: int, rows: torch.Tensor, positions, k: torch.Tensor,
                       v: torch.Tensor, omega, alpha, use_triton: bool | None,
                       host: tuple | None = None, query: tuple | None = None):
        """Algorithm 1's write of a token per cache row ``rows`` (device ``[batch]``): ``host``
        (new lengths, appends) decided there, else on the device (by the Triton kernel itself);
        ``query``: see :meth:`write` (returns the rotated queries)."""
        device, decide = self.device, None
        if host is not None:
            slots, append = to_device(host[0], device) - 1, to_device(host[1], device)
        elif resolve_use_triton(device, use_triton):  # the kernel decides, advances the lengths
            slots = append = None
            decide = (self.lengths, alpha if isinstance(alpha, KeyDecision)
                      else torch.as_tensor(alpha, device=device))
        else:
            current = self.lengths[rows, layer].long()
            append = (torch.as_tensor(alpha, device=device) <= 0.5) | (current == 0)
            slots = current + append.long() - 1
            self.lengths[rows, layer] = (slots + 1).to(torch.int32)
        return run_dmc_write(self.k_pages, self.v_pages, self.block_tables, self.open_k,
                             self.open_v, self.open_omega, self.open_count, self.inv_freq,
                             self.window, layer, rows, slots, append, k, v,
                             None if omega is None else torch.as_tensor(omega, device=device),
                             torch.as_tensor(positions, device=device), use_triton=use_triton,
                             faults=self.allocator.faults, decide=decide, query=query)

    def begin_decode(self, seq_slots, static: bool = False, overlap: bool = False) -> None:
        """Open a decode step of ``seq_slots`` whose writes are deferred: settle the previous
        one (unless ``overlap``: it stays open, its lengths not back yet), then give every head
        whose next slot starts a page, in every layer, that page (``static``, a captured step,
        changes nothing here: DMC's writes read no host state)."""
        if not overlap:
            self.settle()
        seqs = self.allocator.seq_index(seq_slots)
        self.allocator.reserve_step(seqs, self._step_heads(seqs))

    def _step_heads(self, seqs: torch.Tensor) -> torch.Tensor:
        """``[batch, layers, kv]`` host bool: the next slot past the open steps' starts a page."""
        ahead = self.allocator.lookahead
        return at_page_boundary(self.allocator.lengths[seqs] + ahead, self.page_size)

    def _settle_for(self, seq_slots) -> None:
        """Settle the open decode steps holding any of ``seq_slots`` (their host lengths lag)."""
        if isinstance(seq_slots, SeqRows):
            seq_slots = seq_slots.host
        while self.allocator.holds(torch.as_tensor(seq_slots)):
            self.settle()

    def settle(self, carry: torch.Tensor | None = None,
               reached: torch.Tensor | None = None) -> torch.Tensor | None:
        """Close the oldest open decode step: :meth:`BlockAllocator.settle` (``carry``, the
        engine's sampled tokens, comes back with its lengths; ``reached``: lengths read before)."""
        return self.allocator.settle(carry, reached)

    def begin_append(self, seq_slots) -> tuple[torch.Tensor, torch.Tensor]:
        """A vanilla decode step: every head of every layer of ``seq_slots`` gets its next slot
        now (:meth:`BlockAllocator.append_all`); returns their host ``pages, offsets
        [batch, num_layers, kv_heads]`` (moved to the device, for :meth:`append`). Until a layer
        has appended, the slot it reserved is not written: nothing may read that layer then."""
        self._settle_for(seq_slots)
        return self.allocator.append_all(self.allocator.rows(seq_slots))

    def append(self, layer: int, seq_slots, k: torch.Tensor, v: torch.Tensor,
               reserved: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Vanilla append of post-RoPE keys and values ``k, v [batch, kv_heads, head_dim]`` of
        distinct ``seq_slots [batch]``: one new slot per head, no merge state kept; with
        ``reserved`` (what :meth:`begin_append` returned, on the device) into the slots
        reserved for it."""
        if reserved is not None:
            self._store(reserved[0][:, layer], reserved[1][:, layer], k, v)
            return
        self._settle_for(seq_slots)
        seqs = self.allocator.seq_index(seq_slots)
        slots = self.allocator.lengths[seqs, layer].long()
        self.allocator.grow(seqs, layer, slots + 1)
        heads = torch.arange(self.num_kv_heads).expand_as(slots)
        self._scatter(seqs.unsqueeze(1).expand_as(slots), layer, heads, slots, k, v)

    def append_rotating(self, layer: int, rows: torch.Tensor, reserved, query: torch.Tensor,
                        key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
        """:meth:`append` into the ``reserved`` slots (device, of :meth:`begin_append`) of
        pre-RoPE keys, rotated with the queries by the step's RoPE tables ``cos, sin`` in the
        same Triton launch (:func:`~dmc.inference.kernels.run_rope_append`): ``query [batch,
        heads, dim]``, ``key, value [batch, kv_heads, dim]``, ``rows`` the sequences' cache
        rows (device). Returns the rotated queries, float32."""
        return run_rope_append(query, key, value, cos, sin, self.k_pages, self.v_pages,
                               reserved[0][:, layer], reserved[1][:, layer], rows, layer,
                               self.num_layers, faults=self.allocator.faults)

    def pack_prefill(self, layer: int, seq_slot: int, keys: torch.Tensor, values: torch.Tensor,
                     counts, open_k: torch.Tensor, open_v: torch.Tensor,
                     open_omega: torch.Tensor, open_count, *, overwrite_last=None) -> None:
        """Write a prefilled (already compressed) chunk of one sequence and layer into pages.

        Args:
            keys, values: ``[kv_heads, n, head_dim]`` post-RoPE slots; head ``h`` uses its first
                ``counts[h]`` rows, in order.
            counts: ``[kv_heads]`` slots per head.
            open_k, open_v: ``[kv_heads, rows, head_dim]`` pre-RoPE state of each head's last
                (open) slot: with a window, its last ``min(open_count, window)`` tokens, oldest
                first (later rows ignored); with ``window=None``, one row, the running mean.
            open_omega: ``[kv_heads, rows]`` their omegas (``window=None``: the weight ``z``).
            open_count: ``[kv_heads]`` tokens merged into the open slot.
            overwrite_last: ``[kv_heads]`` bool (chunked prefill): the first given slot replaces
                the head's current last slot, which the chunk's first token merged into.
        """
        self._settle_for([seq_slot])
        seqs = self.allocator.seq_index([seq_slot])
        length = self.allocator.lengths[seq_slot, layer].long()
        counts = torch.as_tensor(counts).long().cpu()
        replaced = 0 if overwrite_last is None else torch.as_tensor(overwrite_last).long().cpu()
        start = length - replaced
        if (start < 0).any() or (start + counts < length).any():
            raise ValueError("pack_prefill: overwrite_last needs a last slot and counts >= 1")
        self.allocator.grow(seqs, layer, (start + counts).unsqueeze(0))
        heads, rows = (torch.arange(keys.shape[1]) < counts.unsqueeze(1)).nonzero(as_tuple=True)
        picked = (heads.to(self.device), rows.to(self.device))
        slots = start[heads] + rows
        self._scatter(seqs.expand_as(heads), layer, heads, slots, keys[picked], values[picked])
        self._set_open_state(seq_slot, layer, open_k, open_v, open_omega, open_count)

    def attention(self, layer: int, seq_slots, q: torch.Tensor, scale: float | None = None, *,
                  use_triton: bool | None = None, num_splits: int | None = None,
                  max_length: int | None = None) -> torch.Tensor:
        """Decode attention of ``q [batch, q_heads, head_dim]`` over the cached slots of ``layer``
        -> ``[batch, q_heads, head_dim]`` (``scale`` default ``head_dim ** -0.5``). While decode
        steps are open the host lengths of a GPU cache lag by a slot per open step at most: the
        Triton kernel gets that bound (or ``max_length``, a captured step's launch size), the
        PyTorch path reads the device lengths."""
        seqs, rows = self.allocator.rows(seq_slots)
        host_lengths = self.allocator.lengths[seqs, layer]  # exact where no step is ahead
        lag = self.allocator.lookahead
        return run_paged_decode(
            q, self.k_pages, self.v_pages, self.block_tables[rows, layer],
            self.lengths[rows, layer],
            self.head_dim**-0.5 if scale is None else scale, use_triton=use_triton,
            num_splits=num_splits, max_length=max_length or int(host_lengths.max()) + lag,
            host_lengths=None if lag else host_lengths, faults=self.allocator.faults)

    # --------------------------------------------------------------- helpers
    def _scatter(self, seqs, layer, heads, slots, k, v) -> None:
        """Store ``k``, ``v`` ``[..., head_dim]`` at ``slots`` of heads ``(seqs, layer, heads)``."""
        self._store(*self.allocator.locate(seqs, layer, heads, slots), k, v)

    def _store(self, pages, offsets, k, v) -> None:
        """Store ``k``, ``v`` ``[..., head_dim]`` at device ``(pages, offsets)``."""
        self.k_pages[pages, offsets] = k.to(self.dtype)
        self.v_pages[pages, offsets] = v.to(self.dtype)

    def _set_open_state(self, seq_slot, layer, open_k, open_v, open_omega, open_count) -> None:
        """Place the open slot's last tokens (oldest first) at their ring rows ``j % rows``."""
        rows = self.open_omega.shape[-1]
        count = torch.as_tensor(open_count, device=self.device).long()
        given = torch.clamp(count, max=rows)
        if given.numel() and int(given.max()) > open_k.shape[1]:
            raise ValueError(f"open state has {open_k.shape[1]} rows, needs {int(given.max())}")
        tail = OpenSlot(open_k.to(self.device), open_v.to(self.device),
                        open_omega.to(self.device), count)
        ring = ring_from_tail(tail, rows)
        self.open_k[seq_slot, layer], self.open_v[seq_slot, layer] = ring.k, ring.v
        self.open_omega[seq_slot, layer] = ring.omega
        self.open_count[seq_slot, layer] = count.to(torch.int32)
