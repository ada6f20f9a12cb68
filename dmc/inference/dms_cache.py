"""The paged cache of DMS (Dynamic Memory Sparsification; Łańcucki et al. 2025, Sec. 3, delayed
eviction) with hard decisions: a window ring per head in front of pages that hold survivors only.

Semantics (:func:`dmc.ops.dms_attention_bias`): the decision ``alpha_t`` computed at token t
marks key ``t - 1``; key j is visible to query i iff ``j <= i`` and (``i - j <= w`` or
``alpha_{j+1} = 0``). So a query sees exactly the last ``w + 1`` tokens (itself included),
whatever their decisions, and every older token that was kept.

Design (the window ring and its decode step: :mod:`~dmc.inference.ring_cache`). Per (sequence,
layer, KV head) a ring of ``w + 1`` rows holds the last tokens rotated at their positions, each
with its eviction flag ``alpha_{p+1}`` (``ring_evict``, set when token p + 1 arrives); the pages
hold the *survivors*: a token goes there when it leaves the window if it was kept, and is dropped
otherwise. An evicted token never takes a page: a head's pages grow with its survivors only
(taken on demand like a vanilla append; the scheduler's worst case, one slot per token leaving
the ring, still bounds them) and all return to the pool with the sequence. Keeping every token
in the pages and compacting when one leaves would move slots every step; the ring costs a fixed
``w + 1`` slots per head, which DMS holds anyway (the window is always visible). Order inside a
head does not matter to attention: keys are rotated at their own positions.

Decode (:meth:`decode_write`, batched over sequences and heads): the leaving token is written
at slot ``length`` of its head whatever its flag (its page reserved when the step opened), the
device length grows by its keep flag, and :meth:`settle` (once per engine step) reads the
lengths back and returns the reserved pages of the heads that dropped their token. On CUDA one
Triton launch per layer does the whole write (:mod:`~dmc.inference.kernels.dms_write`); the
CPU runs the compiled kernel, or PyTorch ops (the oracle of both; static steps).

Prefill (:meth:`prefill`): the chunk's queries attend, exactly, the paged survivors (all
visible), the ring's tokens and the chunk's own under the delayed mask of their positions; then
the tokens that leave the window move (kept ones appended to the pages, in order) and the last
``min(tokens, w + 1)`` tokens fill the ring.

Memory: the ring is allocated for every sequence slot: ``w + 1`` keys and values in the cache
dtype and ``w + 1`` bool flags per (layer, KV head); :meth:`sequence_bytes` reports it as
``dmc_state`` (the method's per-head state, as DMC's merge ring). Held slots
(:meth:`held_slots`): paged survivors plus the ring occupancy ``min(tokens, w + 1)``, i.e. what
the next query attends, so slots CR = tokens / held slots, the same definition as DMC's (slots a
query can see). The DMS model's measured CR (``DMSSelfAttention``, its CR loss) counts eventual
evictions instead: it holds the keys marked for eviction still inside the window (at most w) as
gone, so it is a little higher. The float32 DMC merge state the base class allocates
(``window=None``: one row per head) is unused and not reported, as for a vanilla engine.
"""
from __future__ import annotations

import torch

from dmc.ops.mask import bias_from_log_keep

from .paging import to_device
from .kernels import resolve_use_triton
from .kernels.faults import count_faults, outside_pool
from .kernels.native import native_dms_write
from .ring_cache import WindowRingCache


def ring_bytes(dms_window: int, head_dim: int, element_size: int) -> int:
    """Bytes of one head's window ring: ``w + 1`` keys and values of ``element_size`` bytes per
    channel and ``w + 1`` bool flags."""
    return (dms_window + 1) * (2 * head_dim * element_size + 1)


class DMSPagedCache(WindowRingCache):
    """:class:`~dmc.inference.ring_cache.WindowRingCache` pages holding DMS survivors, the
    window ring's rows flagged for eviction (see the module docstring).

    Args:
        num_layers, num_kv_heads, head_dim, num_pages: as :class:`PagedKVCache`.
        dms_window: the eviction delay w (``dmc.dms_window``); the ring has ``w + 1`` rows.
        **kwargs: ``page_size``, ``max_seqs``, ``dtype``, ``device``, ``max_seq_len``,
            ``rope_base``, ``inv_freq`` of :class:`PagedKVCache` (its ``window`` is None).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 dms_window: int, **kwargs):
        if dms_window < 0:
            raise ValueError(f"dms_window must be >= 0, got {dms_window}")
        super().__init__(num_layers, num_kv_heads, head_dim, num_pages, dms_window + 1,
                         window=None, **kwargs)
        self.dms_window = dms_window
        self.ring_evict = torch.zeros(self.ring_k.shape[:-1], dtype=torch.bool,
                                      device=self.device)

    def sequence_bytes(self, seq_slot: int, dmc_state: bool = True) -> dict:
        """:meth:`PagedKVCache.sequence_bytes` with ``dmc_state`` = the window rings of every
        (layer, KV head): ``w + 1`` keys and values in the cache dtype and their bool flags."""
        out = super().sequence_bytes(seq_slot, dmc_state=False)
        if dmc_state:
            out["dmc_state"] = self.num_layers * self.num_kv_heads * ring_bytes(
                self.dms_window, self.head_dim, self.ring_k.element_size())
        return out

    # ---------------------------------------------------------------- decode
    def decode_write(self, layer: int, seq_slots, keys: torch.Tensor, values: torch.Tensor,
                     evict: torch.Tensor | None, positions: torch.Tensor | None = None, *,
                     use_triton: bool | None = None,
                     query: tuple | None = None) -> torch.Tensor | None:
        """One token per sequence of ``seq_slots`` at its next position p (tokens written so
        far): flag token p - 1 with ``evict``, move token p - w - 1 out of the ring (to its
        head's pages if kept; decided on the device in the step ``begin_decode`` opened, see the
        module docstring), put token p in its ring row.

        Args:
            layer: layer index; seq_slots: ``[batch]`` distinct sequence slots.
            keys: ``[batch, kv_heads, head_dim]`` rotated at p; values: same shape.
            evict: ``[batch, kv_heads]`` bool ``alpha_p`` (device): token p - 1 leaves the
                window evicted (ignored at p = 0).
            positions: ``[batch]`` the positions p on the device (required in a static step,
                which reads them there instead of ``written``).
            use_triton: None: one Triton launch on CUDA (:mod:`.kernels.dms_write`), the
                compiled kernel or PyTorch on the CPU; see
                :func:`~dmc.inference.kernels.resolve_use_triton`.
            query: on the Triton path, ``(queries [batch, heads, dim], cos, sin, channel)`` of
                the step: the eviction is read from the queries
                (:class:`~dmc.inference.kernels.EvictionChannel`; ``evict`` None), the queries
                rotated and ``keys``, pre-RoPE here, rotated by the tables in the same launch.

        Returns:
            with ``query``, the rotated queries (float32); None otherwise.
        """
        seqs, rows = self.allocator.rows(seq_slots)
        self.allocator.claim(seqs, layer)
        written = self.written[seqs, layer]
        p = positions if self.static_step else to_device(written, self.device)
        native = not self.static_step and self.native_kernels and self.device.type == "cpu"
        q_rot = None
        if resolve_use_triton(self.device, use_triton):
            from .kernels.dms_write import dms_write

            q_rot = dms_write(self.k_pages, self.v_pages, self.block_tables, self.lengths,
                              self.ring_k, self.ring_v, self.ring_evict, layer, rows, p, keys,
                              values, None if evict is None
                              else torch.as_tensor(evict, device=self.device),
                              self.allocator.faults, query=query)
        elif query is not None:
            raise ValueError("DMSPagedCache.decode_write: query= needs the Triton kernel")
        elif not (native and native_dms_write(self.k_pages, self.v_pages, self.block_tables,
                                              self.lengths, self.ring_k, self.ring_v,
                                              self.ring_evict, layer, seqs, written, keys,
                                              values, torch.as_tensor(evict))):
            self._write_torch(layer, seqs, rows, p, keys, values, evict, positions)
        if not self.static_step:
            self.written[seqs, layer] += 1
        return q_rot

    def _write_torch(self, layer: int, seqs, rows, p, keys, values, evict, positions) -> None:
        """:meth:`decode_write` in PyTorch ops (the oracle of the kernels); ``p`` the tokens'
        positions on the device."""
        leaving = self._leaving(layer, seqs, rows, positions)
        state = self._ring_state(rows, layer, p)
        evict = torch.as_tensor(evict, device=self.device).bool() & (p[:, None] > 0)
        self.ring_evict[state[:3] + ((p[:, None] - 1) % self.ring_size,)] = evict
        if leaving[0].numel():
            self._move_leaving(layer, *leaving)
        self.ring_k[state] = keys.to(self.dtype)
        self.ring_v[state] = values.to(self.dtype)
        # a device scalar: a Python False would be copied from the host (refused while a CUDA
        # graph captures)
        self.ring_evict[state] = torch.zeros((), dtype=torch.bool, device=self.device)

    def _move_leaving(self, layer: int, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Token ``positions - w - 1`` of cache rows ``rows`` (device ``[n]``, all with a full
        ring) leaves its ring row ``positions % (w + 1)``: written at slot ``length`` of each
        head (its page reserved beforehand), length + 1 where kept. An entry that is no page of
        the pool goes to the fault counter (:mod:`.kernels.faults`; the write itself is not
        skipped, which would take a synchronisation)."""
        state = self._ring_state(rows, layer, positions)
        heads = state[2]
        keep = ~self.ring_evict[state]
        length = self.lengths[rows, layer].long()  # [n, kv] device
        column = length // self.page_size
        width = self.max_pages_per_head
        pages = torch.where(column < width, self.block_tables[
            rows[:, None], layer, heads, column.clamp(max=width - 1)].long(), -1)
        count_faults(self.allocator.faults, outside_pool(pages, self.num_pages),
                     (rows[:, None] * self.num_layers + layer) * self.num_kv_heads + heads)
        self.k_pages[pages, length % self.page_size] = self.ring_k[state]
        self.v_pages[pages, length % self.page_size] = self.ring_v[state]
        self.lengths[rows, layer] = (length + keep.long()).to(torch.int32)

    # --------------------------------------------------------------- prefill
    def prefill(self, layer: int, seq_slot: int, start: int, q: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor, evict: torch.Tensor,
                scale: float) -> torch.Tensor:
        """Exact chunked prefill of ``n`` tokens at positions ``start ..`` of one sequence and
        layer: attention over the paged survivors, the ring and the chunk under the delayed
        mask, then the window moves (see the module docstring).

        Args:
            start: the chunk's first position, the tokens written so far.
            q: ``[q_heads, n, head_dim]`` rotated queries (float32).
            keys: ``[kv_heads, n, head_dim]`` rotated keys; values: same shape.
            evict: ``[kv_heads, n]`` bool: ``alpha`` of each token (token i marks token i - 1;
                ignored at position 0).
            scale: softmax scale.

        Returns ``[q_heads, n, head_dim]`` float32.
        """
        seqs = self.allocator.seq_index([seq_slot])
        window_k, window_v, ring_rows = self.raw_window(layer, seq_slot, start, keys, values)
        heads, n, dim = keys.shape
        held = ring_rows.numel()
        paged_k, paged_v, lengths = self.read(layer, [seq_slot])
        evict = evict.to(self.device, torch.bool)
        last = torch.zeros(heads, 1, dtype=torch.bool, device=self.device)
        # marks[j] = alpha_{j+1} of each windowed token j (ring first, then the chunk)
        marks = (torch.cat([self.ring_evict[seq_slot, layer][:, ring_rows[:-1]], evict, last], 1)
                 if held else torch.cat([evict[:, 1:], last], 1))
        log_keep = torch.zeros(marks.shape, device=self.device).masked_fill(marks, float("-inf"))
        bias = bias_from_log_keep(log_keep, q_len=n, delay=self.dms_window)  # [kv, n, held + n]
        paged = torch.zeros(heads, paged_k.shape[2], device=self.device).masked_fill(
            torch.arange(paged_k.shape[2], device=self.device) >= lengths[0, :, None].to(
                self.device), float("-inf"))
        bias = torch.cat([paged[:, None].expand(heads, n, -1), bias], -1)
        all_k, all_v = torch.cat([paged_k[0], window_k], 1), torch.cat([paged_v[0], window_v], 1)
        qg = q.float().reshape(heads, -1, n, dim)
        scores = torch.einsum("hgnd,hsd->hgns", qg, all_k) * scale + bias[:, None]
        context = torch.einsum("hgns,hsd->hgnd", torch.softmax(scores, -1), all_v)
        leave = held + n - min(start + n, self.ring_size)
        if leave:
            self._append_kept(layer, seqs, window_k[:, :leave], window_v[:, :leave],
                              ~marks[:, :leave])
        rows = self.keep_window_tail(layer, seq_slot, start + n, window_k, window_v)
        self.ring_evict[seq_slot, layer][:, rows] = marks[:, leave:]
        return context.reshape(-1, n, dim)

    def _append_kept(self, layer: int, seqs: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, keep: torch.Tensor) -> None:
        """Append the tokens marked in ``keep [kv_heads, m]`` (``keys``, ``values`` ``[kv_heads,
        m, head_dim]``) to the pages of heads ``(seqs [1], layer)``, in order."""
        lengths = self.allocator.lengths[seqs[0], layer].long()
        counts = keep.sum(1).cpu()
        self.allocator.grow(seqs, layer, (lengths + counts)[None])
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept first, in order
        heads, index = (torch.arange(keep.shape[1]) < counts[:, None]).nonzero(as_tuple=True)
        source = order[heads.to(self.device), index.to(self.device)]
        picked = (heads.to(self.device), source)
        self._scatter(seqs.expand_as(heads), layer, heads, lengths[heads] + index,
                      keys[picked], values[picked])
