"""DMC append/merge write in PyTorch that updates the window ring in place: the CPU path
(semantics of :func:`~dmc.inference.kernels.reference.dmc_write_reference`, which stays the
oracle).

The reference gathers each head's whole ring, rewrites it with ``where`` and scatters it back
(about six passes over ``[batch, kv_heads, window, head_dim]`` keys and values per layer);
here the new token goes straight into its ring row, and the ring is read once for the weighted
mean. The compiled kernel (``write_cpu.c`` through :mod:`~dmc.inference.kernels.native`) runs
the same steps head by head where it applies (``native=False``: never). The exact running mean
(``window=None``) keeps one row per head and runs the reference.
"""
from __future__ import annotations

import torch

from dmc.ops.rope import apply_rope

from .faults import refuse_outside_pool
from .native import native_dmc_write
from .reference import dmc_write_reference


def dmc_write_inplace(k_pages, v_pages, block_tables, open_k, open_v, open_omega, open_count,
                      inv_freq, window, layer, seq_slots, slots, append, k, v, omega,
                      positions, native: bool = True) -> None:
    """Arguments and effect of :func:`~dmc.inference.kernels.reference.dmc_write_reference`:
    ``k, v [batch, kv_heads, head_dim]``, ``omega``, ``append``, ``slots [batch, kv_heads]``,
    ``seq_slots``, ``positions [batch]``; rings ``open_k, open_v [max_seqs, num_layers, kv_heads,
    window, head_dim]`` (float32 or the keys' dtype), ``open_omega [..., window]``,
    ``open_count [max_seqs, num_layers, kv_heads]``."""
    if native and native_dmc_write(k_pages, v_pages, block_tables, open_k, open_v, open_omega,
                                   open_count, inv_freq, window, layer, seq_slots, slots, append,
                                   k, v, omega, positions):
        return
    if window is None:
        dmc_write_reference(k_pages, v_pages, block_tables, open_k, open_v, open_omega,
                            open_count, inv_freq, window, layer, seq_slots, slots, append, k, v,
                            omega, positions)
        return
    batch, heads = append.shape
    seq = seq_slots.long()
    rows = (seq[:, None].expand(batch, heads), layer,
            torch.arange(heads, device=seq.device).expand(batch, heads))
    slots = slots.long()
    page_size = k_pages.shape[1]
    pages = block_tables[rows + (slots // page_size,)].long()
    refuse_outside_pool(pages, k_pages.shape[0], torch.tensor(True), "DMC write (PyTorch path)",
                        lambda i: f"sequence slot {int(seq[i[0]])}, layer {layer}, KV head "
                                  f"{i[1]}")
    count = torch.where(append.bool(), 0, open_count[rows].long())  # tokens before this one
    ring_row = rows + (count % window,)
    open_k[ring_row] = k.to(open_k.dtype)
    open_v[ring_row] = v.to(open_v.dtype)
    open_omega[ring_row] = omega.float()
    open_count[rows] = (count + 1).to(open_count.dtype)
    filled = torch.arange(window, device=seq.device) < torch.clamp(count + 1, max=window)[..., None]
    weights = torch.where(filled, open_omega[seq, layer], 0.0)  # [batch, kv_heads, window]
    total = weights.sum(-1, keepdim=True)
    mean_k = torch.einsum("...w,...wd->...d", weights, open_k[seq, layer].float()) / total
    mean_v = torch.einsum("...w,...wd->...d", weights, open_v[seq, layer].float()) / total
    rotated = apply_rope(mean_k, positions.unsqueeze(1), inv_freq)
    k_pages[pages, slots % page_size] = rotated.to(k_pages.dtype)
    v_pages[pages, slots % page_size] = mean_v.to(v_pages.dtype)
