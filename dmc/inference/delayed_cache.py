"""The paged cache of DMC with delayed merging (``dmc.merge_delay`` = d >= 1; not in the paper:
DMS's delayed eviction carried over to DMC's merging, see :func:`dmc.ops.delayed_merge_bias`).

Semantics (eval mode, hard decisions): query i sees the raw tokens ``i - d .. i`` and the slots
Algorithm 1 leaves after tokens ``0 .. i - d - 1`` (the open one included). So each (sequence,
layer, KV head) holds a window ring of ``R = d + 1`` raw tokens
(:class:`~dmc.inference.ring_cache.WindowRingCache`: keys rotated at their positions, values,
in the cache dtype) with the decisions of each token (``ring_alpha``, ``ring_omega``, float32),
in front of the pages and open-slot merge state of :class:`~dmc.inference.cache.PagedKVCache`,
which hold Algorithm 1's slots of the tokens that left the ring.

Decode (:meth:`write`, batched over sequences and heads): token ``p - R`` leaves its ring row
(the one token p then takes) and goes through Algorithm 1's write with its own decisions
(appended or merged on the device, in the step ``begin_decode`` opened: the paged part of a
deferred DMC write), its pre-RoPE key recovered by rotating back (RoPE is orthogonal: rotating
by ``-t`` undoes rotating by ``t``, exact up to rounding in the cache dtype). On the CPU a
compiled kernel does the whole write, in static steps too (the positions are host memory there:
:func:`~dmc.inference.kernels.native.native_delayed_write`), on CUDA a Triton kernel in one
launch a layer (:mod:`~dmc.inference.kernels.delayed_write`, which also reads the importance
from the step's queries and rotates them); both tested against the PyTorch path.
Prefill is the KV write's (:class:`~dmc.inference.kv_write_delayed.DelayedDMCKV`) over
:meth:`raw_window` and :meth:`keep_window_tail`, with :meth:`window_decisions`.

Memory (:meth:`sequence_bytes`, ``dmc_state``): the DMC merge state of every head plus its ring
of R keys and values in the cache dtype and two float32 decisions per row
(:func:`delayed_ring_bytes`), allocated for every sequence slot. Held slots: paged slots plus the
ring occupancy ``min(tokens, R)``.
"""
from __future__ import annotations

import torch

from dmc.ops.algorithm1 import KeyDecision
from dmc.ops.rope import rope_tables, rotate

from .kernels import resolve_use_triton, run_delayed_write
from .kernels.native import native_delayed_write
from .ring_cache import WindowRingCache


def delayed_ring_bytes(merge_delay: int, head_dim: int, element_size: int) -> int:
    """Bytes of one head's ring: ``d + 1`` keys and values of ``element_size`` bytes per channel
    and their alpha and omega in float32."""
    return (merge_delay + 1) * (2 * head_dim * element_size + 2 * 4)


class DelayedMergeCache(WindowRingCache):
    """Pages and merge state of :class:`PagedKVCache` behind a ring of ``merge_delay + 1`` raw
    tokens (see the module docstring).

    Args:
        num_layers, num_kv_heads, head_dim, num_pages: as :class:`PagedKVCache`.
        merge_delay: d >= 1 (``dmc.merge_delay``).
        **kwargs: the keyword arguments of :class:`PagedKVCache` (``window``: DMC's merge window).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 merge_delay: int, **kwargs):
        if merge_delay < 1:
            raise ValueError(f"merge_delay must be >= 1, got {merge_delay}")
        super().__init__(num_layers, num_kv_heads, head_dim, num_pages, merge_delay + 1,
                         **kwargs)
        self.merge_delay = merge_delay
        self.ring_alpha = torch.zeros(self.ring_k.shape[:-1], device=self.device)
        self.ring_omega = torch.zeros_like(self.ring_alpha)

    def sequence_bytes(self, seq_slot: int, dmc_state: bool = True) -> dict:
        """:meth:`PagedKVCache.sequence_bytes` with the rings of every (layer, KV head) added to
        ``dmc_state``."""
        out = super().sequence_bytes(seq_slot, dmc_state=dmc_state)
        if dmc_state:
            out["dmc_state"] += self.num_layers * self.num_kv_heads * delayed_ring_bytes(
                self.merge_delay, self.head_dim, self.ring_k.element_size())
        return out

    def write(self, layer: int, seq_slots, positions, k: torch.Tensor, v: torch.Tensor, omega,
              alpha, *, use_triton: bool | None = None, defer: bool = False,
              query: tuple | None = None) -> torch.Tensor | None:
        """One token per sequence of ``seq_slots`` at positions p, in the decode step
        ``begin_decode`` opened (``defer`` must be True): token ``p - R`` leaves the ring
        through Algorithm 1 (:meth:`PagedKVCache.write`'s device path), token p takes its row.
        On the Triton path (``use_triton``, see
        :func:`~dmc.inference.kernels.resolve_use_triton`) one launch does it all
        (:func:`~dmc.inference.kernels.run_delayed_write`).

        Args:
            positions: ``[batch]`` the positions p (device).
            k, v: ``[batch, kv_heads, head_dim]`` pre-RoPE key (decision channel zeroed) and
                value; omega, alpha: ``[batch, kv_heads]`` the token's decisions (alpha a
                :class:`~dmc.ops.algorithm1.KeyDecision`: still in ``k``, split off here).
            query: Triton path only, as :meth:`PagedKVCache.write` takes it (``omega`` None):
                the importance read from the step's queries, which are rotated and returned.

        Returns:
            with ``query``, the rotated queries (float32); None otherwise.
        """
        if not defer:
            raise ValueError("DelayedMergeCache.write: decode writes are deferred (defer=True)")
        seqs, rows = self.allocator.rows(seq_slots)
        self.allocator.claim(seqs, layer)
        if resolve_use_triton(self.device, use_triton):
            rotated = run_delayed_write(
                self.k_pages, self.v_pages, self.block_tables, self.lengths, self.open_k,
                self.open_v, self.open_omega, self.open_count, self.ring_k, self.ring_v,
                self.ring_alpha, self.ring_omega, self.inv_freq, self.window, layer, rows,
                torch.as_tensor(positions, device=self.device), k, v,
                None if omega is None else torch.as_tensor(omega, device=self.device),
                alpha if isinstance(alpha, KeyDecision) else
                torch.as_tensor(alpha, device=self.device), faults=self.allocator.faults,
                query=query)
            if not self.static_step:
                self.written[seqs, layer] += 1
            return rotated
        if query is not None:
            raise ValueError("DelayedMergeCache.write: query= needs the Triton path")
        if isinstance(alpha, KeyDecision):
            alpha, k = alpha.split(k)
        if (self.native_kernels and self.device.type == "cpu"
                and native_delayed_write(self, layer, seqs,
                                         torch.as_tensor(positions) if self.static_step
                                         else self.written[seqs, layer], k, v,
                                         torch.as_tensor(alpha), torch.as_tensor(omega))):
            if not self.static_step:
                self.written[seqs, layer] += 1
            return None
        positions = torch.as_tensor(positions, device=self.device)
        leaving, at = self._leaving(layer, seqs, rows, positions)
        if leaving.numel():
            state = self._ring_state(leaving, layer, at)
            token = at - self.ring_size
            cos, sin = rope_tables(-token[:, None], self.inv_freq)
            self._write_decided(layer, leaving, token, rotate(self.ring_k[state].float(), cos, sin),
                                self.ring_v[state].float(), self.ring_omega[state],
                                self.ring_alpha[state], use_triton)
        cos, sin = rope_tables(positions[:, None], self.inv_freq)
        state = self._ring_state(rows, layer, positions)
        self.ring_k[state] = rotate(k.float(), cos, sin).to(self.dtype)
        self.ring_v[state] = v.to(self.dtype)
        self.ring_alpha[state] = torch.as_tensor(alpha, device=self.device).float()
        self.ring_omega[state] = torch.as_tensor(omega, device=self.device).float()
        if not self.static_step:
            self.written[seqs, layer] += 1
        return None

    def window_decisions(self, layer: int, seq_slot: int, ring_rows: torch.Tensor,
                         alpha: torch.Tensor, omega: torch.Tensor) -> tuple:
        """The decisions of the :meth:`raw_window`'s tokens: those of the ring's ``ring_rows``
        then the chunk's ``alpha``, ``omega`` ``[kv_heads, n]``; ``[kv_heads, held + n]``
        each."""
        ring = (self.ring_alpha[seq_slot, layer][:, ring_rows],
                self.ring_omega[seq_slot, layer][:, ring_rows])
        return tuple(torch.cat([r, x.float().to(self.device)], 1)
                     for r, x in zip(ring, (alpha, omega)))

    def keep_decisions(self, layer: int, seq_slot: int, rows: torch.Tensor,
                       alpha: torch.Tensor, omega: torch.Tensor) -> None:
        """Store the decisions ``[kv_heads, len(rows)]`` of the tokens :meth:`keep_window_tail`
        put in ring ``rows``."""
        self.ring_alpha[seq_slot, layer][:, rows] = alpha
        self.ring_omega[seq_slot, layer][:, rows] = omega
