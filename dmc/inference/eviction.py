"""Eviction on the paged cache: the slots of a layer read back through the block tables, and
compacted in place to the slots a policy keeps (:mod:`dmc.policies`), pages past the new
lengths freed. A base of :class:`~dmc.inference.cache.PagedKVCache`, whose storage
(``k_pages``, ``v_pages``, ``block_tables``, ``allocator``) and helpers (``_settle_for``,
``_scatter``) it works on."""
from __future__ import annotations

import torch


class SlotEviction:
    """:meth:`read` and :meth:`compact` of a :class:`~dmc.inference.cache.PagedKVCache`."""

    def read(self, layer: int, seq_slots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cached slots of ``layer`` for ``seq_slots``, gathered through the block tables:
        keys, values ``[batch, kv_heads, max_len, head_dim]`` float32 (zeros past a head's
        length) and the host lengths ``[batch, kv_heads]`` (long)."""
        where, lengths = self._slot_places(layer, seq_slots)
        return self._gather(self.k_pages, where), self._gather(self.v_pages, where), lengths

    def read_part(self, layer: int, seq_slots, part: str) -> torch.Tensor:
        """The keys or the values (``part``) alone of :meth:`read`: a policy that scores with
        the keys reads no value."""
        pools = {"keys": self.k_pages, "values": self.v_pages}
        if part not in pools:
            raise ValueError(f"read_part: part must be one of {sorted(pools)}, got {part!r}")
        return self._gather(pools[part], self._slot_places(layer, seq_slots)[0])

    def _slot_places(self, layer: int, seq_slots):
        """Page, offset and emptiness ``[batch, kv_heads, max_len]`` of every slot of
        ``layer`` for ``seq_slots``, and the host lengths ``[batch, kv_heads]``."""
        self._settle_for(seq_slots)
        seqs = self.allocator.seq_index(seq_slots)
        lengths = self.allocator.lengths[seqs, layer].long()
        max_len = int(lengths.max()) if lengths.numel() else 0
        slots = torch.arange(max_len, device=self.device)
        valid = slots < lengths.to(self.device).unsqueeze(-1)
        table = self.block_tables[seqs.to(self.device), layer].long()
        pages = torch.where(valid, table[..., slots // self.page_size], 0)
        offsets = (slots % self.page_size).expand_as(pages)
        return (pages, offsets, ~valid.unsqueeze(-1)), lengths

    @staticmethod
    def _gather(pool: torch.Tensor, where) -> torch.Tensor:
        pages, offsets, hidden = where
        return pool[pages, offsets].float().masked_fill(hidden, 0.0)

    def compact(self, layer, seq_slots, keep: torch.Tensor, keys: torch.Tensor | None = None,
                values: torch.Tensor | None = None) -> torch.Tensor:
        """Evict slots for real: each head of ``(seq_slots, layer)`` keeps the slots marked in
        ``keep``, moved to the front in their order, and returns the pages it no longer needs
        (beyond ``ceil(new_length / page_size)``) to the free list. Unchanged contents move
        page to page in the cache's dtype, only the slots whose place changes (a decode step's
        single eviction moves the slots after it, nothing else is read or written).

        Args:
            layer: a layer index, or a slice of layers (then every tensor below has a
                ``layers`` dimension after ``batch``: all layers compact in one go).
            keep: ``[batch, kv_heads, n]`` bool, ``n >=`` the longest head; slots past a head's
                length are ignored.
            keys, values: optional ``[batch, kv_heads, m, head_dim]`` new contents of the first
                ``m <= n`` slots of each head (a merge, a re-rotation): a kept slot among them is
                written with them wherever it lands, the others keep the cached ones.

        Returns the new host lengths ``[batch, (layers,) kv_heads]`` (long).
        """
        self._settle_for(seq_slots)
        seqs = self.allocator.seq_index(seq_slots)
        lengths = self.allocator.lengths[seqs, layer].long()
        n = keep.shape[-1]
        if keep.shape[:-1] != lengths.shape or (lengths > n).any():
            raise ValueError(f"compact: keep must be [{', '.join(map(str, lengths.shape))}, >= "
                             f"{int(lengths.max())}], got {tuple(keep.shape)}")
        slots = torch.arange(n, device=self.device)
        keep = keep.to(self.device, torch.bool) & (slots < lengths.to(self.device)[..., None])
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)  # kept first, in order
        new_lengths = keep.sum(-1)
        table = self.block_tables[seqs.to(self.device), layer].long()
        for pool, contents in ((self.k_pages, keys), (self.v_pages, values)):
            self._place(pool, table, order, new_lengths, contents)
        new_lengths = new_lengths.cpu()
        self.allocator.shrink(seqs, layer, new_lengths)
        return new_lengths

    def _place(self, pool: torch.Tensor, table: torch.Tensor, order: torch.Tensor,
               new_lengths: torch.Tensor, contents: torch.Tensor | None) -> None:
        """Slot ``d < new_length`` of every head takes slot ``order[d]``'s contents: from
        ``contents [..., m, head_dim]`` for a slot below ``m`` (written wherever it lands), else
        from ``pool`` itself, where its place changes (all read before any is written).
        ``table``: the heads' page ids ``[..., max_pages_per_head]``, ``order`` ``[..., n]``."""
        slots = torch.arange(order.shape[-1], device=self.device)
        written = slots < new_lengths[..., None]
        given = 0 if contents is None else contents.shape[-2]
        moves = [(written & (order >= given) & (order != slots), None)]
        if given:
            moves.append((written & (order < given), contents))
        picked = []
        for chosen, new in moves:  # read every source first
            *head, slot = chosen.nonzero(as_tuple=True)
            source = order[(*head, slot)]
            pages = table[tuple(head)]  # [slots, max_pages_per_head]
            if new is None:
                origin = pages.gather(1, (source // self.page_size)[:, None])[:, 0]
                values = pool[origin, source % self.page_size]
            else:
                values = new[(*head, source)].to(pool.dtype)
            picked.append((pages.gather(1, (slot // self.page_size)[:, None])[:, 0],
                           slot % self.page_size, values))
        for page, offset, values in picked:
            pool[page, offset] = values
