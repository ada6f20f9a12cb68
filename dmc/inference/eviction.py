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
        self._settle_for(seq_slots)
        seqs = self.allocator.seq_index(seq_slots)
        lengths = self.allocator.lengths[seqs, layer].long()
        max_len = int(lengths.max()) if lengths.numel() else 0
        slots = torch.arange(max_len, device=self.device)
        valid = slots < lengths.to(self.device).unsqueeze(-1)
        table = self.block_tables[seqs.to(self.device), layer].long()
        pages = torch.where(valid, table[..., slots // self.page_size], 0)
        offsets = (slots % self.page_size).expand_as(pages)
        hidden = ~valid.unsqueeze(-1)
        return (self.k_pages[pages, offsets].float().masked_fill(hidden, 0.0),
                self.v_pages[pages, offsets].float().masked_fill(hidden, 0.0), lengths)

    def compact(self, layer: int, seq_slots, keep: torch.Tensor, keys: torch.Tensor | None = None,
                values: torch.Tensor | None = None) -> torch.Tensor:
        """Evict slots for real: each head of ``(seq_slots, layer)`` keeps the slots marked in
        ``keep``, moved to the front in their order, and returns the pages it no longer needs
        (beyond ``ceil(new_length / page_size)``) to the free list.

        Args:
            keep: ``[batch, kv_heads, n]`` bool, ``n >=`` the longest head; slots past a head's
                length are ignored.
            keys, values: optional ``[batch, kv_heads, n, head_dim]`` new contents of the slots
                (a merge or a re-rotation); default: the cached ones.

        Returns the new host lengths ``[batch, kv_heads]`` (long).
        """
        self._settle_for(seq_slots)
        seqs = self.allocator.seq_index(seq_slots)
        lengths = self.allocator.lengths[seqs, layer].long()
        n = keep.shape[-1]
        if keep.shape[:2] != lengths.shape or (lengths > n).any():
            raise ValueError(f"compact: keep must be [batch, kv_heads, >= {int(lengths.max())}]"
                             f" for lengths {tuple(lengths.shape)}, got {tuple(keep.shape)}")
        if keys is None or values is None:
            cached_k, cached_v, _ = self.read(layer, seqs)
            keys = cached_k if keys is None else keys
            values = cached_v if values is None else values
        slots = torch.arange(n, device=self.device)
        keep = keep.to(self.device, torch.bool) & (slots < lengths.to(self.device)[..., None])
        new_lengths = keep.sum(-1).cpu()
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)  # kept first, in order
        index = order[..., None].expand(-1, -1, -1, self.head_dim)
        moved_k, moved_v = keys[..., :n, :].gather(2, index), values[..., :n, :].gather(2, index)
        b, h, s = (torch.arange(n) < new_lengths[..., None]).nonzero(as_tuple=True)
        picked = (b.to(self.device), h.to(self.device), s.to(self.device))
        self._scatter(seqs[b], layer, h, s, moved_k[picked], moved_v[picked])
        self.allocator.shrink(seqs, layer, new_lengths)
        return new_lengths
