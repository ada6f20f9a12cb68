"""OmniKV's Context Bank with host offload (Hao et al., ICLR 2025, ``papers/omnikv.txt``, Sec. 4.1
"Context Bank" and "Packed Load", Fig. 2): the sparse layers' whole KV lives in a host pool; their
device pages hold only the tokens the preceding filter layer selected at the current step.

* Prefill is dense (every layer whole on the device). After the prompt's last chunk
  (:meth:`ContextBank.offload`) each sparse layer's slots are copied to the pool and its device
  pages shrink to the prompt's last ``min(ceil(n / CR), n - 1) + 1`` tokens: a stand-in of the size
  the first decode step needs, which that step replaces.
* At a decode step, right after a filter layer selected (:meth:`OmniKV.observe`), the selected
  earlier tokens of every sparse layer up to the next filter layer are gathered from the pool in
  one copy per sequence (the packed load) and written over those layers' device pages
  (:meth:`PagedKVCache.compact` with new contents; the pages past them go back to the pool's free
  list). When a sparse layer's turn comes the engine appends its own token as usual and its decode
  attention is the engine's paged attention over exactly these pages (Fig. 2c: only the KV on the
  device is visible); the new token is then copied to the pool (:meth:`ContextBank.step`).

The dense layers (before ``L_0``, the filter layers, the layer after each) keep their KV on the
device. A sparse head holds ``min(ceil(t / CR), t - 1) + 1`` slots after ``t`` tokens, at most one
more than after the step before, so a decode step needs no page beyond the scheduler's reservation
(one new slot per head).

What it does not do: copies are synchronous (the paper overlaps them with the dense layers'
compute) from pageable host memory; a finished sequence's pool is released when the next sequence
starts in its slot (:meth:`reset`). On a CPU-only machine "host" and "device" are the same RAM, but
the pool is a separate tensor and the page pool really shrinks.

Shapes: a sequence's pool is ``[sparse layers, kv_heads, capacity, head_dim]`` keys and values in
the cache dtype, slot = token position, the capacity doubling as it grows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dmc.inference.cache import PagedKVCache

if TYPE_CHECKING:
    from .omnikv import OmniKV


class ContextBank:
    """Host pool of the sparse layers' KV and the loads of the selected tokens to the device.

    Args:
        policy: a bound :class:`~dmc.policies.omnikv.OmniKV` (its sparse and filter layers, its
            ``selected`` mask ``[max_seqs, max_slots]`` and budget).
        cache: the engine's paged cache.
        positions: the runner's ``[max_seqs, layers, kv_heads, max_slots]`` original position of
            every slot (rewritten for the loaded slots).
    """

    def __init__(self, policy: OmniKV, cache: PagedKVCache, positions: torch.Tensor):
        self.policy, self.cache, self.positions = policy, cache, positions
        self.layers = [layer for layer in range(cache.num_layers) if policy.sparse(layer)]
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.groups = {f: [layer for layer in self.layers
                           if max(x for x in policy.filter_layers if x < layer) == f]
                       for f in policy.filter_layers}  # the sparse layers each filter layer feeds
        self.keys: dict[int, torch.Tensor] = {}  # seq -> [sparse layers, kv, capacity, dim]
        self.values: dict[int, torch.Tensor] = {}

    def reset(self, seq: int) -> None:
        """Release sequence slot ``seq``'s pool (a new sequence starts there)."""
        self.keys.pop(seq, None)
        self.values.pop(seq, None)

    def bytes(self, seq: int) -> int:
        """Host bytes of ``seq``'s pool (keys and values, allocated capacity)."""
        pool = self.keys.get(seq)
        return 0 if pool is None else 2 * pool.numel() * pool.element_size()

    # ------------------------------------------------------------------ hooks
    def offload(self, seqs: torch.Tensor, tokens: torch.Tensor) -> None:
        """After the prompt (``tokens [batch]`` each): copy the sparse layers' slots to the pool
        and keep the last ``min(ceil(n / CR), n - 1) + 1`` on the device."""
        if not self.layers:
            return
        for layer in self.layers:
            keys, values, lengths = self.cache.read(layer, seqs)
            for b, seq in enumerate(seqs.tolist()):
                n = int(lengths[b, 0])
                self._store(seq, self.row[layer], slice(0, n), keys[b, :, :n], values[b, :, :n])
        count = torch.minimum(self.policy.budget(tokens), tokens - 1) + 1
        slots = torch.arange(int(tokens.max()))
        last = (slots >= (tokens - count)[:, None]) & (slots < tokens[:, None])
        self._load(self.layers, seqs, last)

    def step(self, layer: int, seqs: torch.Tensor, view) -> None:
        """After ``layer`` wrote and attended at a decode step (``view``: its
        :class:`~dmc.policies.base.LayerView`): a filter layer's selection is loaded into the
        sparse layers it feeds; a sparse layer's new token goes to the pool."""
        if layer in self.row:
            last = (view.lengths[:, 0] - 1).to(view.device)  # the new token's slot
            rows = torch.arange(len(seqs), device=view.device)
            keys, values = view.keys[rows, :, last], view.values[rows, :, last]  # [batch, kv, d]
            where = view.positions[rows, 0, last].tolist()
            for b, seq in enumerate(seqs.tolist()):
                self._store(seq, self.row[layer], where[b], keys[b], values[b])
        elif self.groups.get(layer):
            tokens = view.tokens.cpu()
            selected = self.policy.selected[seqs.to(self.policy.selected.device)].cpu()
            slots = torch.arange(int(tokens.max()))
            earlier = selected[:, :len(slots)] & (slots < (tokens - 1)[:, None])
            self._load(self.groups[layer], seqs, earlier)

    # ------------------------------------------------------------------ helpers
    def _store(self, seq: int, row: int, slots, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys``, ``values`` (``[kv, n, dim]`` or ``[kv, dim]``) at ``slots`` of sparse
        layer ``row`` of ``seq``'s pool, growing it."""
        end = slots.stop if isinstance(slots, slice) else slots + 1
        pool = self.keys.get(seq)
        if pool is None or pool.shape[2] < end:
            capacity = max(end, 2 * pool.shape[2] if pool is not None else end)
            shape = (len(self.layers), self.cache.num_kv_heads, capacity, self.cache.head_dim)
            grown_k = torch.zeros(shape, dtype=self.cache.dtype)
            grown_v = torch.zeros_like(grown_k)
            if pool is not None:
                grown_k[:, :, :pool.shape[2]] = pool
                grown_v[:, :, :pool.shape[2]] = self.values[seq]
            self.keys[seq], self.values[seq] = grown_k, grown_v
        dtype = self.cache.dtype
        self.keys[seq][row, :, slots] = keys.to("cpu", dtype)
        self.values[seq][row, :, slots] = values.to("cpu", dtype)

    def _load(self, layers: list[int], seqs: torch.Tensor, chosen: torch.Tensor) -> None:
        """Make the device pages of ``layers`` (sparse) hold, for each sequence, its pool's
        tokens marked in ``chosen [batch, T]`` (host), in position order; the pages past them are
        freed. One host-to-device copy per sequence for all ``layers`` (packed load)."""
        device, kv, dim = self.cache.device, self.cache.num_kv_heads, self.cache.head_dim
        rows = torch.tensor([self.row[layer] for layer in layers])
        counts = chosen.sum(-1)  # [batch]
        index = [c.nonzero().flatten() for c in chosen]
        packs = [(self.keys[seq][:, :, i][rows].to(device),
                  self.values[seq][:, :, i][rows].to(device))
                 for seq, i in zip(seqs.tolist(), index)]  # [layers, kv, c, dim]
        width = self.positions.shape[-1]
        where = torch.full((len(index), width), -1, dtype=torch.long)
        for b, i in enumerate(index):
            where[b, :len(i)] = i
        seq_rows = seqs.to(self.positions.device)
        for g, layer in enumerate(layers):
            lengths = self.cache.layer_lengths(layer, seqs)  # [batch, kv]
            if (counts[:, None] > lengths).any():
                raise RuntimeError(f"OmniKV offload: layer {layer} would grow from "
                                   f"{lengths[:, 0].tolist()} to {counts.tolist()} slots "
                                   f"outside the decode step's reserved slot")
            n = int(lengths.max())
            keys = torch.zeros(len(index), kv, n, dim, dtype=self.cache.dtype, device=device)
            values = torch.zeros_like(keys)
            for b, (k, v) in enumerate(packs):
                keys[b, :, :k.shape[2]], values[b, :, :v.shape[2]] = k[g], v[g]
            keep = (torch.arange(n) < counts[:, None])[:, None].expand(-1, kv, -1)
            self.cache.compact(layer, seqs, keep, keys, values)
            self.positions[seq_rows, layer] = where.to(self.positions.device)[:, None]
