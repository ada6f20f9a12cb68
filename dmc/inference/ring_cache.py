"""A paged cache with a *window ring* in front of the pages: the last ``R`` tokens of each head,
which every query sees raw, whatever their decisions. What DMS's delayed eviction
(:class:`~dmc.inference.dms_cache.DMSPagedCache`, ``R = dms_window + 1``) and DMC with delayed
merging (:class:`~dmc.inference.delayed_cache.DelayedMergeCache`, ``R = merge_delay + 1``) share.

Per (sequence, layer, KV head) token p sits in ring row ``p % R`` (``ring_k`` rotated at p,
``ring_v``, in the cache dtype); writing token p overwrites token ``p - R``, exactly the one that
leaves the window when query p arrives, so the timing needs no bookkeeping beyond the position.
A token leaving the ring goes to the pages by the method's rule (DMS: kept or dropped; delayed
DMC: appended or merged by Algorithm 1), decided on the device in the step
:meth:`begin_decode` opened (pages reserved for the heads at a page boundary whose ring has a
token leaving). The host counts the tokens written per (sequence, layer) (``written``), so
positions, ring rows, which rows have a token leaving and the ring occupancy are known without
reading the device. A step opened with ``static=True`` (a captured decode step,
:class:`~dmc.inference.decode_graphs.DecodeGraphs`) has every row's ring full: every row has a
token leaving, the host advances ``written`` for every layer when the step opens, and the
writes and the attention read only device tensors.

Decode attention (:meth:`attention`) runs over the paged slots and the filled ring rows under
one softmax (:mod:`~dmc.inference.kernels.dms_decode`). Held slots (:meth:`held_slots`): paged
slots plus the ring occupancy ``min(tokens, R)``, what the next query attends.
"""
from __future__ import annotations

import torch

from .paging import rows_or_zeros, to_device
from .cache import PagedKVCache
from .kernels import resolve_use_triton
from .kernels.dms_decode import dms_decode_attention, dms_decode_attention_cpu


class WindowRingCache(PagedKVCache):
    """:class:`PagedKVCache` pages plus a window ring of ``ring_size`` rows per head (see the
    module docstring); subclasses decide where a leaving token goes.

    Args:
        num_layers, num_kv_heads, head_dim, num_pages: as :class:`PagedKVCache`.
        ring_size: ``R >= 1`` rows per head.
        **kwargs: the keyword arguments of :class:`PagedKVCache`.
    """

    native_kernels = True  # CPU decode writes by the compiled kernel where it applies

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 ring_size: int, **kwargs):
        super().__init__(num_layers, num_kv_heads, head_dim, num_pages, **kwargs)
        self.ring_size = ring_size
        rows = (self.max_seqs, num_layers, num_kv_heads, ring_size)
        self.ring_k = torch.zeros(rows + (head_dim,), dtype=self.dtype, device=self.device)
        self.ring_v = torch.zeros_like(self.ring_k)
        self.written = torch.zeros(self.max_seqs, num_layers, dtype=torch.long)  # host
        self.static_step = False  # the open decode step is a static one (begin_decode)

    # ----------------------------------------------------------------- stats
    def ring_occupancy(self, seq_slots, layer: int) -> torch.Tensor:
        """Filled ring rows ``min(tokens, R)`` of ``layer`` for ``seq_slots``, ``[batch]`` (host
        long)."""
        seqs = self.allocator.seq_index(seq_slots)
        return self.written[seqs, layer].clamp(max=self.ring_size)

    def held_slots(self, seq_slot: int, paged: torch.Tensor | None = None) -> torch.Tensor:
        """Slots a query of the sequence attends per head, ``[num_layers, num_kv_heads]`` (host
        long): its paged slots (``paged``: as a step left them) plus its filled ring rows
        (full in an overlapped step, which is static, as in the step read back)."""
        ring = self.written[seq_slot].clamp(max=self.ring_size)
        return super().held_slots(seq_slot, paged) + ring[:, None]

    def paged_growth(self, seq_slots: list, tokens: int) -> torch.Tensor:
        """At most one paged slot per token that leaves the ring during the next ``tokens``
        tokens (the decisions are not known yet); tokens still in the ring take no page.
        ``[n, layers, kv]`` long for ``seq_slots`` (``None``: no slot yet)."""
        written = rows_or_zeros(self.written, seq_slots)
        leaving = ((written + tokens - self.ring_size).clamp(min=0)
                   - (written - self.ring_size).clamp(min=0))
        return leaving[:, :, None].expand(-1, -1, self.num_kv_heads).clone()

    def free_sequence(self, seq_slot: int) -> None:
        """Free the sequence's pages and slot; its ring is empty again."""
        super().free_sequence(seq_slot)
        self.written[seq_slot] = 0

    # ---------------------------------------------------------------- decode
    def begin_decode(self, seq_slots, static: bool = False, overlap: bool = False) -> None:
        """:meth:`PagedKVCache.begin_decode`; ``static``: a step whose writes and attention read
        no host state (every sequence's ring must be full: ValueError otherwise), its tokens
        counted in ``written`` now, for every layer. ``overlap`` (the previous step still
        open) needs a static step: ValueError otherwise."""
        if overlap and not static:
            raise ValueError("a window-ring cache (DMS, delayed merging) opens a decode step "
                             "before the previous one settles only when it is static (every "
                             "ring full)")
        super().begin_decode(seq_slots, overlap=overlap)
        self.static_step = static
        if static:
            seqs = self.allocator.seq_index(seq_slots)
            if not self.rings_full(seqs):
                raise ValueError(f"a static decode step needs every sequence's window ring full "
                                 f"({self.ring_size} tokens written)")
            self.written[seqs] += 1

    def rings_full(self, seq_slots) -> bool:
        """Whether every sequence of ``seq_slots`` has written ``R`` tokens (host)."""
        return bool((self.written[seq_slots] >= self.ring_size).all())

    def _step_heads(self, seqs: torch.Tensor) -> torch.Tensor:
        """Heads whose next paged slot needs a page: a token leaves their full ring this step
        and their slots fill whole pages (``[batch, num_layers, kv_heads]`` host bool)."""
        leaving = (self.written[seqs] >= self.ring_size)[..., None]
        return leaving & super()._step_heads(seqs)

    def _leaving(self, layer: int, seqs: torch.Tensor, rows: torch.Tensor,
                 positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache rows of a decode write whose ring has a token leaving, and their positions
        p (token ``p - R`` leaves), both on the device: every row in a static step (positions
        given there), else those with ``R`` tokens written (read on the host)."""
        if self.static_step:
            return rows, positions
        written = self.written[seqs, layer]
        index = (written >= self.ring_size).nonzero()[:, 0]
        return to_device(seqs[index], self.device), to_device(written[index], self.device)

    def _ring_state(self, rows: torch.Tensor, layer: int, positions: torch.Tensor) -> tuple:
        """Index of token ``positions [n]``'s ring row in every head of cache rows ``rows [n]``
        (``[n, kv_heads]`` per axis)."""
        heads = torch.arange(self.num_kv_heads, device=self.device)[None]
        return rows[:, None], layer, heads, (positions % self.ring_size)[:, None]

    def attention(self, layer: int, seq_slots, q: torch.Tensor, scale: float | None = None, *,
                  use_triton: bool | None = None, num_splits: int | None = None,
                  max_length: int | None = None) -> torch.Tensor:
        """Decode attention of ``q [batch, q_heads, head_dim]`` over each head's paged slots
        and filled ring rows: on the CPU the compiled kernel (or PyTorch), elsewhere
        :func:`dms_decode_attention` (``use_triton``: None = Triton on CUDA; ``num_splits`` tunes
        it; ``max_length`` bounds the paged lengths). Returns ``[batch, q_heads, head_dim]``."""
        seqs, rows = self.allocator.rows(seq_slots)
        scale = self.head_dim**-0.5 if scale is None else scale
        if self.static_step:  # every ring full (begin_decode checked): nothing from the host
            ring = torch.full_like(rows, self.ring_size)
        else:
            ring = to_device(self.ring_occupancy(seq_slots, layer), self.device)
        triton = resolve_use_triton(self.device, use_triton)
        if self.device.type == "cpu" and not triton:  # the device lengths are on the host
            pools = (self.ring_k.flatten(0, 1), self.ring_v.flatten(0, 1))  # views
            return dms_decode_attention_cpu(
                q, self.k_pages, self.v_pages, self.block_tables[rows, layer],
                self.lengths[rows, layer], *pools, seqs * self.num_layers + layer, ring, scale)
        lag = self.allocator.lookahead  # the device lengths: + 1 per open step at most
        bound = max_length or int(self.allocator.lengths[seqs, layer].max()) + lag
        return dms_decode_attention(
            q, self.k_pages, self.v_pages, self.block_tables[rows, layer],
            self.lengths[rows, layer], bound, self.ring_k[:, layer], self.ring_v[:, layer],
            ring, scale, ring_rows=rows, use_triton=triton, num_splits=num_splits,
            faults=self.allocator.faults)

    # --------------------------------------------------------------- prefill
    def raw_window(self, layer: int, seq_slot: int, start: int, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens a prefill chunk at positions ``start ..`` sees raw: the ring's last
        ``held = min(start, R)`` tokens, then the chunk's ``keys`` (rotated), ``values``
        (``[kv_heads, n, head_dim]``). Returns keys and values ``[kv_heads, held + n,
        head_dim]`` float32, oldest first, and the ring rows of the held tokens ``[held]``
        (device long). ValueError unless ``start`` is the number of tokens written."""
        if start != int(self.written[seq_slot, layer]):
            raise ValueError(f"prefill of layer {layer} at position {start}, but "
                             f"{int(self.written[seq_slot, layer])} tokens are cached")
        held = min(start, self.ring_size)
        ring_rows = (torch.arange(start - held, start) % self.ring_size).to(self.device)
        window_k = torch.cat([self.ring_k[seq_slot, layer][:, ring_rows].float(), keys.float()], 1)
        window_v = torch.cat([self.ring_v[seq_slot, layer][:, ring_rows].float(),
                              values.float()], 1)
        return window_k, window_v, ring_rows

    def keep_window_tail(self, layer: int, seq_slot: int, end: int, window_k: torch.Tensor,
                         window_v: torch.Tensor) -> torch.Tensor:
        """After a chunk ending at position ``end`` (exclusive): the last ``min(end, R)`` tokens
        of the :meth:`raw_window` (``[kv_heads, m, head_dim]``, ending at ``end``) fill the ring.
        Returns their ring rows (device long); ``written`` becomes ``end``."""
        stay = min(end, self.ring_size)
        rows = (torch.arange(end - stay, end) % self.ring_size).to(self.device)
        self.ring_k[seq_slot, layer][:, rows] = window_k[:, -stay:].to(self.dtype)
        self.ring_v[seq_slot, layer][:, rows] = window_v[:, -stay:].to(self.dtype)
        self.written[seq_slot, layer] = end
        return rows
