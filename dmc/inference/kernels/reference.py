"""PyTorch kernels for the paged per-head KV cache: the CPU path and the oracle for the Triton ones.

Layout shared with :mod:`dmc.inference.kernels.paged_decode` and
:mod:`dmc.inference.kernels.dmc_write`:

* ``k_pages``, ``v_pages``: ``[num_pages, page_size, head_dim]``, one pool for the whole model;
* ``block_tables``: ``[batch, kv_heads, max_pages]`` int32 page ids (``-1`` = no page);
* ``lengths``: ``[batch, kv_heads]`` int32 number of cached slots per head (DMC heads differ).

Slot ``n`` of a head lives at ``k_pages[block_tables[b, h, n // page_size], n % page_size]``.
"""
from __future__ import annotations

import torch

from dmc.ops.algorithm1 import OpenSlot, merge_into_open_slot
from dmc.ops.rope import apply_rope


def paged_decode_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One-query attention over each head's paged slots, with GQA.

    Args:
        q: ``[batch, q_heads, head_dim]``; query head ``i`` reads KV head ``i // G`` with
            ``G = q_heads // kv_heads`` (GQA).
        k_pages, v_pages: ``[num_pages, page_size, head_dim]``.
        block_tables: ``[batch, kv_heads, max_pages]`` int page ids.
        lengths: ``[batch, kv_heads]`` slots per head; a head with no slot yields zeros.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[batch, q_heads, head_dim]`` in the dtype of ``q``; computed in float32.
    """
    batch, q_heads, head_dim = q.shape
    kv_heads = block_tables.shape[1]
    page_size = k_pages.shape[1]
    lengths = lengths.long()
    max_len = int(lengths.max()) if lengths.numel() else 0
    slot = torch.arange(max_len, device=q.device)
    valid = slot < lengths.unsqueeze(-1)  # [batch, kv_heads, max_len]
    pages = block_tables.long().gather(-1, (slot // page_size).expand(batch, kv_heads, -1))
    pages = torch.where(valid, pages, 0)
    offsets = (slot % page_size).expand_as(pages)
    hidden = ~valid.unsqueeze(-1)  # slots past a head's length may hold anything
    # [batch, kv_heads, max_len, head_dim]
    keys = k_pages[pages, offsets].float().masked_fill(hidden, 0.0)
    values = v_pages[pages, offsets].float().masked_fill(hidden, 0.0)
    qg = q.float().reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    scores = torch.einsum("bhgd,bhnd->bhgn", qg, keys) * scale
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty heads: all -inf -> 0
    out = torch.einsum("bhgn,bhnd->bhgd", probs, values)
    return out.reshape(batch, q_heads, head_dim).to(q.dtype)


def dmc_write_reference(k_pages, v_pages, block_tables, open_k, open_v, open_omega, open_count,
                        inv_freq, window, layer, seq_slots, slots, append, k, v, omega,
                        positions) -> None:
    """DMC append/merge of one token per (sequence, KV head) into the paged cache (Algorithm 1,
    Eq. 9, through :func:`dmc.ops.algorithm1.merge_into_open_slot`).

    Pages must already be allocated: the cache decides ``append`` and ``slots`` on the host.
    For each (b, h) with pre-RoPE key ``k_t``, value ``v_t``, importance ``omega_t``:

    * append: the open slot restarts with this token alone, stored key ``RoPE(k_t, p_t)``;
    * merge (window ``w``): push the token into the open slot's ring of its last ``w`` tokens,
      mean ``sum(omega_m k_m) / sum(omega_m)`` over the ring (same for v);
    * merge (exact, ``window=None``): ``z' = z + omega_t``, mean ``(z k + omega_t k_t) / z'``;

    then the slot is overwritten with ``RoPE(mean_k, p_t)`` and ``mean_v``, rotated at the newest
    token's position.

    Args:
        k_pages, v_pages: ``[num_pages, page_size, head_dim]`` pools (written).
        block_tables: ``[max_seqs, num_layers, kv_heads, max_pages]`` int page ids.
        open_k, open_v: ``[max_seqs, num_layers, kv_heads, rows, head_dim]`` open-slot rings
            (float32, or with a window the dtype of ``k``, ``v``); open_omega ``[max_seqs,
            num_layers, kv_heads, rows]``; open_count ``[max_seqs, num_layers, kv_heads]``
            int32 (all updated).
        inv_freq: ``[head_dim // 2]`` RoPE frequencies; window: ``w`` or None (exact).
        layer: layer index.
        seq_slots: ``[batch]`` cache sequence slots, distinct.
        slots: ``[batch, kv_heads]`` slot index written per head (the last one when merging).
        append: ``[batch, kv_heads]`` bool, True to open a new slot.
        k, v: ``[batch, kv_heads, head_dim]`` pre-RoPE key and value of the new token.
        omega: ``[batch, kv_heads]`` importance > 0.
        positions: ``[batch]`` absolute position of the new token.
    """
    batch, heads = append.shape
    seq = seq_slots.long().unsqueeze(1).expand(batch, heads)
    head = torch.arange(heads, device=seq.device).expand(batch, heads)
    state = (seq, layer, head)
    ring = OpenSlot(open_k[state], open_v[state], open_omega[state], open_count[state])
    ring, mean_k, mean_v = merge_into_open_slot(ring, append.bool(), k, v, omega, window)
    open_k[state], open_v[state] = ring.k.to(open_k.dtype), ring.v.to(open_v.dtype)
    open_omega[state] = ring.omega
    open_count[state] = ring.count.to(open_count.dtype)
    rotated = apply_rope(mean_k, positions.unsqueeze(1), inv_freq)
    slots = slots.long()
    page_size = k_pages.shape[1]
    pages = block_tables[seq, layer, head, slots // page_size].long()
    offsets = slots % page_size
    k_pages[pages, offsets] = rotated.to(k_pages.dtype)
    v_pages[pages, offsets] = mean_v.to(v_pages.dtype)
