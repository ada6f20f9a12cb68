"""The paged cache of DMS (Dynamic Memory Sparsification; Łańcucki et al. 2025, Sec. 3, delayed
eviction) with hard decisions: a window ring per head in front of pages that hold survivors only.

Semantics (:func:`dmc.ops.dms_attention_bias`): the decision ``alpha_t`` computed at token t
marks key ``t - 1``; key j is visible to query i iff ``j <= i`` and (``i - j <= w`` or
``alpha_{j+1} = 0``). So a query sees exactly the last ``w + 1`` tokens (itself included),
whatever their decisions, and every older token that was kept.

Design. Per (sequence, layer, KV head):

* a *window ring* of ``w + 1`` fixed rows, token p in row ``p % (w + 1)`` (``ring_k``, ``ring_v``
  rotated at p, in the cache dtype) with its eviction flag ``alpha_{p+1}`` (``ring_evict``, set
  when token p + 1 arrives);
* pages (the :class:`PagedKVCache` pool and block tables) holding the *survivors*: a token goes
  there when it leaves the window if it was kept, and is dropped otherwise.

Writing token p into row ``p % (w + 1)`` overwrites token ``p - w - 1``, which is exactly the key
that leaves the window when query p arrives (key j leaves at query ``j + w + 1``), so eviction
timing needs no bookkeeping beyond the position. An evicted token never takes a page: a head's
pages grow with its survivors only (taken on demand like a vanilla append; the scheduler's worst
case, one slot per token, still bounds them) and all return to the pool with the sequence.
Keeping every token in the pages and compacting when one leaves would move slots every step;
the ring costs a fixed ``w + 1`` slots per head, which DMS holds anyway (the window is always
visible). Order inside a head does not matter to attention: keys are rotated at their own
positions.

Decode (:meth:`decode_write`, batched over sequences and heads): the host counts the tokens
written per (sequence, layer) (``written``), so positions, ring rows, which rows have a token
leaving and the ring occupancy are known without reading the device. The decisions stay on the
device, as in DMC's deferred writes: the step opened by ``begin_decode`` gave each head of a
leaving row at a page boundary its next page (every layer at once), the leaving token is written
at slot ``length`` of its head whatever its flag, the device length grows by its keep flag, and
:meth:`settle` (once per engine step) reads the lengths back and returns the reserved pages of
the heads that dropped their token. A step opened with ``static=True`` (a captured decode step,
:class:`~dmc.inference.decode_graphs.DecodeGraphs`) has every row's ring full, so every row has a
token leaving: the host advances ``written`` for every layer when the step opens, and the writes
and the attention read only device tensors (the positions, a ring occupancy of ``w + 1``), the
same kernels at every step. Decode attention
(:meth:`attention`) runs over the paged survivors and the filled ring rows
(:mod:`~dmc.inference.kernels.dms_decode`: the batched CPU kernel merged with the ring on the
CPU, a padded gather without host reads elsewhere).

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

from .block_allocator import rows_or_zeros, to_device
from .cache import PagedKVCache
from .kernels.dms_decode import dms_decode_attention, dms_decode_attention_cpu
from .kernels.native import native_dms_write


def ring_bytes(dms_window: int, head_dim: int, element_size: int) -> int:
    """Bytes of one head's window ring: ``w + 1`` keys and values of ``element_size`` bytes per
    channel and ``w + 1`` bool flags."""
    return (dms_window + 1) * (2 * head_dim * element_size + 1)


class DMSPagedCache(PagedKVCache):
    """:class:`PagedKVCache` pages holding DMS survivors, plus the window rings (see the module
    docstring).

    Args:
        num_layers, num_kv_heads, head_dim, num_pages: as :class:`PagedKVCache`.
        dms_window: the eviction delay w (``dmc.dms_window``); the ring has ``w + 1`` rows.
        **kwargs: ``page_size``, ``max_seqs``, ``dtype``, ``device``, ``max_seq_len``,
            ``rope_base``, ``inv_freq`` of :class:`PagedKVCache` (its ``window`` is None).
    """

    native_kernels = True  # CPU decode writes by the compiled kernel where it applies

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 dms_window: int, **kwargs):
        if dms_window < 0:
            raise ValueError(f"dms_window must be >= 0, got {dms_window}")
        super().__init__(num_layers, num_kv_heads, head_dim, num_pages, window=None, **kwargs)
        self.dms_window, self.ring_size = dms_window, dms_window + 1
        rows = (self.max_seqs, num_layers, num_kv_heads, self.ring_size)
        self.ring_k = torch.zeros(rows + (head_dim,), dtype=self.dtype, device=self.device)
        self.ring_v = torch.zeros_like(self.ring_k)
        self.ring_evict = torch.zeros(rows, dtype=torch.bool, device=self.device)
        self.written = torch.zeros(self.max_seqs, num_layers, dtype=torch.long)  # host
        self.static_step = False  # the open decode step is a static one (begin_decode)

    # ----------------------------------------------------------------- stats
    def ring_occupancy(self, seq_slots, layer: int) -> torch.Tensor:
        """Filled ring rows ``min(tokens, w + 1)`` of ``layer`` for ``seq_slots``, ``[batch]``
        (host long)."""
        seqs = self.allocator.seq_index(seq_slots)
        return self.written[seqs, layer].clamp(max=self.ring_size)

    def held_slots(self, seq_slot: int) -> torch.Tensor:
        """Slots a query of the sequence attends per head, ``[num_layers, num_kv_heads]`` (host
        long): its paged survivors plus its filled ring rows."""
        ring = self.written[seq_slot].clamp(max=self.ring_size)
        return self.head_lengths(seq_slot).long() + ring[:, None]

    def paged_growth(self, seq_slots: list, tokens: int) -> torch.Tensor:
        """At most one paged slot per token that leaves the window ring during the next
        ``tokens`` tokens (kept or not: the decisions are not known yet); tokens still in the
        ring take no page. ``[n, layers, kv]`` long for ``seq_slots`` (``None``: no slot yet)."""
        written = rows_or_zeros(self.written, seq_slots)
        leaving = ((written + tokens - self.ring_size).clamp(min=0)
                   - (written - self.ring_size).clamp(min=0))
        return leaving[:, :, None].expand(-1, -1, self.num_kv_heads).clone()

    def sequence_bytes(self, seq_slot: int, dmc_state: bool = True) -> dict:
        """:meth:`PagedKVCache.sequence_bytes` with ``dmc_state`` = the window rings of every
        (layer, KV head): ``w + 1`` keys and values in the cache dtype and their bool flags."""
        out = super().sequence_bytes(seq_slot, dmc_state=False)
        if dmc_state:
            out["dmc_state"] = self.num_layers * self.num_kv_heads * ring_bytes(
                self.dms_window, self.head_dim, self.ring_k.element_size())
        return out

    def free_sequence(self, seq_slot: int) -> None:
        """Free the sequence's pages and slot; its ring is empty again."""
        super().free_sequence(seq_slot)
        self.written[seq_slot] = 0

    # ---------------------------------------------------------------- decode
    def begin_decode(self, seq_slots, static: bool = False) -> None:
        """:meth:`PagedKVCache.begin_decode`; ``static``: a step whose writes and attention read
        no host state (every sequence's ring must be full: ValueError otherwise), its tokens
        counted in ``written`` now, for every layer."""
        super().begin_decode(seq_slots)
        self.static_step = static
        if static:
            seqs = self.allocator.seq_index(seq_slots)
            if not self.rings_full(seqs):
                raise ValueError(f"a static DMS decode step needs every sequence's window ring "
                                 f"full ({self.ring_size} tokens written)")
            self.written[seqs] += 1

    def rings_full(self, seq_slots) -> bool:
        """Whether every sequence of ``seq_slots`` has written ``w + 1`` tokens (host)."""
        return bool((self.written[seq_slots] >= self.ring_size).all())

    def decode_write(self, layer: int, seq_slots, keys: torch.Tensor, values: torch.Tensor,
                     evict: torch.Tensor, positions: torch.Tensor | None = None) -> None:
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
        """
        seqs, rows = self.allocator.rows(seq_slots)
        self.allocator.claim(seqs, layer)
        if self.static_step:  # every ring full: every row has a token leaving
            self._write_rows(layer, rows, positions, keys, values, evict, rows, positions)
            return
        written = self.written[seqs, layer]
        compiled = self.native_kernels and self.device.type == "cpu" and native_dms_write(
            self.k_pages, self.v_pages, self.block_tables, self.lengths, self.ring_k,
            self.ring_v, self.ring_evict, layer, seqs, written, keys, values,
            torch.as_tensor(evict))
        if not compiled:
            leaving = (written >= self.ring_size).nonzero()[:, 0]
            p = to_device(written, self.device)
            self._write_rows(layer, rows, p, keys, values, evict,
                             to_device(seqs[leaving], self.device),
                             to_device(written[leaving], self.device))
        self.written[seqs, layer] += 1

    def _write_rows(self, layer: int, rows: torch.Tensor, p: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, evict: torch.Tensor, leaving_rows: torch.Tensor,
                    leaving_p: torch.Tensor) -> None:
        """The device work of :meth:`decode_write` for cache rows ``rows`` at positions ``p``
        (``[batch]`` device long), the rows ``leaving_rows`` (at ``leaving_p``) having a full
        ring."""
        heads = torch.arange(self.num_kv_heads, device=self.device)[None]
        rows, p = rows[:, None], p[:, None]
        evict = torch.as_tensor(evict, device=self.device).bool() & (p > 0)
        self.ring_evict[rows, layer, heads, (p - 1) % self.ring_size] = evict
        if leaving_rows.numel():
            self._move_leaving(layer, leaving_rows, leaving_p)
        row = p % self.ring_size
        self.ring_k[rows, layer, heads, row] = keys.to(self.dtype)
        self.ring_v[rows, layer, heads, row] = values.to(self.dtype)
        self.ring_evict[rows, layer, heads, row] = False

    def _step_heads(self, seqs: torch.Tensor) -> torch.Tensor:
        """Heads whose next paged slot needs a page: a token leaves their full ring this step
        and their survivors fill whole pages (``[batch, num_layers, kv_heads]`` host bool)."""
        leaving = (self.written[seqs] >= self.ring_size)[..., None]
        return leaving & (self.allocator.lengths[seqs] % self.page_size == 0)

    def _move_leaving(self, layer: int, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Token ``positions - w - 1`` of cache rows ``rows`` (device ``[n]``, all with a full
        ring) leaves its ring row ``positions % (w + 1)``: written at slot ``length`` of each
        head (its page reserved beforehand), length + 1 where kept."""
        heads = torch.arange(self.num_kv_heads, device=self.device)[None]
        ring_rows = (positions % self.ring_size)[:, None]
        state = (rows[:, None], layer, heads, ring_rows)
        keep = ~self.ring_evict[state]
        length = self.lengths[rows, layer].long()  # [n, kv] device
        pages = self.block_tables[rows[:, None], layer, heads, length // self.page_size].long()
        self.k_pages[pages, length % self.page_size] = self.ring_k[state]
        self.v_pages[pages, length % self.page_size] = self.ring_v[state]
        self.lengths[rows, layer] = (length + keep.long()).to(torch.int32)

    def attention(self, layer: int, seq_slots, q: torch.Tensor, scale: float | None = None, *,
                  use_triton: bool | None = None, num_splits: int | None = None,
                  max_length: int | None = None) -> torch.Tensor:
        """Decode attention of ``q [batch, q_heads, head_dim]`` over each head's paged survivors
        and filled ring rows (PyTorch on every device: ``use_triton`` and ``num_splits`` are
        not used; ``max_length`` bounds the paged lengths on a GPU). Returns ``[batch, q_heads,
        head_dim]``."""
        seqs, rows = self.allocator.rows(seq_slots)
        scale = self.head_dim**-0.5 if scale is None else scale
        if self.static_step:  # every ring full (begin_decode checked): nothing from the host
            ring = torch.full_like(rows, self.ring_size)
        else:
            ring = to_device(self.ring_occupancy(seq_slots, layer), self.device)
        if self.device.type == "cpu":  # the host lengths are the device's: exact
            pools = (self.ring_k.flatten(0, 1), self.ring_v.flatten(0, 1))  # views
            return dms_decode_attention_cpu(
                q, self.k_pages, self.v_pages, self.block_tables[rows, layer],
                self.allocator.lengths[seqs, layer], *pools, seqs * self.num_layers + layer,
                ring, scale)
        lag = self.allocator.step is not None  # the device lengths: + 1 at most
        bound = max_length or int(self.allocator.lengths[seqs, layer].max()) + lag
        return dms_decode_attention(
            q, self.k_pages, self.v_pages, self.block_tables[rows, layer],
            self.lengths[rows, layer], bound, self.ring_k[rows, layer], self.ring_v[rows, layer],
            ring, scale,
        )

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
        if start != int(self.written[seq_slot, layer]):
            raise ValueError(f"DMS prefill of layer {layer} at position {start}, but "
                             f"{int(self.written[seq_slot, layer])} tokens are cached")
        heads, n, dim = keys.shape
        paged_k, paged_v, lengths = self.read(layer, [seq_slot])
        held = min(start, self.ring_size)
        ring_rows = (torch.arange(start - held, start) % self.ring_size).to(self.device)
        window_k = torch.cat([self.ring_k[seq_slot, layer][:, ring_rows].float(), keys.float()], 1)
        window_v = torch.cat([self.ring_v[seq_slot, layer][:, ring_rows].float(),
                              values.float()], 1)
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
        stay = min(start + n, self.ring_size)
        leave = held + n - stay
        if leave:
            self._append_kept(layer, seqs, window_k[:, :leave], window_v[:, :leave],
                              ~marks[:, :leave])
        rows = (torch.arange(start + n - stay, start + n) % self.ring_size).to(self.device)
        self.ring_k[seq_slot, layer][:, rows] = window_k[:, leave:].to(self.dtype)
        self.ring_v[seq_slot, layer][:, rows] = window_v[:, leave:].to(self.dtype)
        self.ring_evict[seq_slot, layer][:, rows] = marks[:, leave:]
        self.written[seq_slot, layer] = start + n
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
