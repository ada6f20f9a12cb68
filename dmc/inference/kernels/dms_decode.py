"""DMS decode attention in PyTorch: one query per (sequence, query head) over its KV head's paged
survivors and its window ring (DMS paper Sec. 3, delayed eviction; the cache layout is
:class:`~dmc.inference.dms_cache.DMSPagedCache`'s).

Every key a DMS decode query may see is either a survivor in the pages (a token that left the
window and was kept: visible for good) or one of the last ``w + 1`` tokens in the ring (visible
whatever its decision), so the query attends both under one softmax, with no other mask.

Two paths, equal to fp32 tolerance (tested): :func:`dms_decode_attention` reads no length back
from the device (any device: the GPU path), either through the Triton paged kernel, which reads
the pages and the rings in place, the ring as one more part of its split-K (CUDA's default), or
by gathering every head's pages up to a host bound on the lengths (``max_length``) and masking by
the device lengths. On the CPU, where the
host lengths are exact, :func:`dms_decode_attention_cpu` runs the compiled CPU kernel over the
pages and then the ring, both read in place (:mod:`~dmc.inference.kernels.native`), or where it
does not apply the batched PyTorch path over the pages
(:func:`~dmc.inference.kernels.paged_cpu.paged_decode_batched`: no padded copy of the cache)
merged with the ring's softmax by their log-sum-exps.
"""
from __future__ import annotations

import math

import torch

from .native import native_paged_decode
from .paged_cpu import paged_decode_batched


def dms_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    max_length: int,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    ring_count: torch.Tensor,
    scale: float,
    *,
    ring_rows: torch.Tensor | None = None,
    use_triton: bool = False,
    num_splits: int | None = None,
    faults: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of each query over its head's paged slots and filled ring rows, GQA.
    ``use_triton``: the Triton paged kernel reads the pages and the rings in place (the ring
    one more part of its split-K, ``paged_decode(ring=...)``); else PyTorch, over a gathered
    copy of every head's pages up to ``max_length``.

    Args:
        q: ``[batch, q_heads, head_dim]``; query head ``i`` reads KV head ``i // G``.
        k_pages, v_pages: ``[num_pages, page_size, head_dim]`` (rotated keys, values).
        block_tables: ``[batch, kv_heads, max_pages]`` int page ids (``-1`` = no page).
        lengths: ``[batch, kv_heads]`` paged slots per head (device).
        max_length: a host bound, ``>=`` every entry of ``lengths``.
        ring_k, ring_v: ``[batch, kv_heads, ring, head_dim]`` the window rings, or with
            ``ring_rows`` pools ``[n, kv_heads, ring, head_dim]`` holding them.
        ring_count: ``[batch]`` filled ring rows (rows ``0 .. count - 1``; all once full), >= 1.
        ring_rows: ``[batch]`` device ints, sequence ``b``'s ring in the pools (None: ``b``).
        scale: softmax scale.
        faults: the Triton kernel's fault counter (:mod:`.faults`; the PyTorch path reads page
            0 for an entry of -1).

    Returns:
        ``[batch, q_heads, head_dim]`` in the dtype of ``q``; computed in float32.
    """
    if use_triton:
        from .paged_decode import paged_decode

        if ring_rows is None:
            ring_rows = torch.arange(q.shape[0], device=q.device)
        return paged_decode(q, k_pages, v_pages, block_tables, lengths, scale,
                            num_splits=num_splits, max_length=max_length, faults=faults,
                            ring=(ring_k, ring_v, ring_rows, ring_count))
    if ring_rows is not None:
        ring_k, ring_v = ring_k[ring_rows], ring_v[ring_rows]
    batch, q_heads, head_dim = q.shape
    kv_heads, page_size, ring = block_tables.shape[1], k_pages.shape[1], ring_k.shape[2]
    pages = min(-(-max_length // page_size), block_tables.shape[-1])  # a loose bound: the table
    ids = block_tables[..., :pages].long().clamp(min=0)  # [batch, kv, pages]
    slots = torch.arange(pages * page_size, device=q.device)
    paged = slots < lengths.long()[..., None]  # [batch, kv, slots]
    filled = torch.arange(ring, device=q.device) < ring_count.to(q.device).long()[:, None]
    valid = torch.cat([paged, filled[:, None].expand(batch, kv_heads, ring)], dim=-1)
    keys = torch.cat([k_pages[ids].reshape(batch, kv_heads, -1, head_dim).float(),
                      ring_k.float()], dim=2)
    values = torch.cat([v_pages[ids].reshape(batch, kv_heads, -1, head_dim).float(),
                        ring_v.float()], dim=2).masked_fill(~valid[..., None], 0.0)
    qg = q.float().reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    scores = torch.einsum("bhgd,bhnd->bhgn", qg, keys) * scale
    probs = torch.softmax(scores.masked_fill(~valid[:, :, None], float("-inf")), dim=-1)
    out = torch.einsum("bhgn,bhnd->bhgd", probs, values)
    return out.reshape(batch, q_heads, head_dim).to(q.dtype)


def _ring_partial(q, ring_k, ring_v, ring_count, scale):
    """The ring's softmax state in the Triton kernel's base-2 units: ``(max [batch, q_heads]``
    of the filled rows' scores ``q.k * scale * log2(e)``, ``sum`` of ``exp2(score - max)``,
    ``out [batch, q_heads, head_dim]`` the values weighted so``)``, float32."""
    batch, q_heads, head_dim = q.shape
    kv_heads, rows = ring_k.shape[1], ring_k.shape[2]
    qg = q.float().reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    scores = torch.einsum("bhgd,bhnd->bhgn", qg, ring_k.float()) * (scale * math.log2(math.e))
    filled = torch.arange(rows, device=q.device) < ring_count.to(q.device).long()[:, None]
    scores = scores.masked_fill(~filled[:, None, None], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)  # finite: the ring always holds a key
    weights = torch.exp2(scores - top)
    values = ring_v.float().masked_fill(~filled[:, None, :, None], 0.0)  # unfilled: any bits
    out = torch.einsum("bhgn,bhnd->bhgd", weights, values)
    return (top.reshape(batch, q_heads), weights.sum(dim=-1).reshape(batch, q_heads),
            out.reshape(batch, q_heads, head_dim))


def dms_decode_attention_cpu(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    host_lengths: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    ring_index: torch.Tensor,
    ring_count: torch.Tensor,
    scale: float,
    *,
    native: bool = True,
) -> torch.Tensor:
    """:func:`dms_decode_attention` with exact host lengths ``host_lengths [batch, kv_heads]``
    and the rings as pools: ``ring_k, ring_v [n, kv_heads, ring, head_dim]``, sequence ``b``'s
    ring at ``ring_index[b]`` (host long ``[batch]``). The compiled kernel reads pages and rings
    in place under one online softmax; otherwise (or ``native=False``) the paged survivors go
    through the batched PyTorch path (its output ``o_p`` and log-sum-exp ``l_p``), the ring
    densely (``o_r``, ``l_r``), merged as ``(o_p e^{l_p} + o_r e^{l_r}) / (e^{l_p} + e^{l_r})``
    (the ring always holds a key, so ``l_r`` is finite)."""
    ring = (ring_k, ring_v, ring_index, ring_count)
    compiled = native and native_paged_decode(q, k_pages, v_pages, block_tables, host_lengths,
                                              scale, ring=ring)
    if compiled:
        return compiled[0].to(q.dtype)
    paged, paged_lse = paged_decode_batched(q, k_pages, v_pages, block_tables, host_lengths,
                                            scale, host_lengths=host_lengths, return_lse=True,
                                            native=native)
    ring_top, ring_sum, ring_out = _ring_partial(q, ring_k[ring_index], ring_v[ring_index],
                                                 ring_count, scale)
    ring_lse = (ring_top + torch.log2(ring_sum)) * math.log(2)  # base 2 -> natural log
    top = torch.maximum(paged_lse, ring_lse)
    w_paged = torch.exp(paged_lse - top)[..., None]  # 0 for a head with no survivor
    w_ring = torch.exp(ring_lse - top)[..., None]
    out = paged.float() * w_paged + ring_out / ring_sum[..., None] * w_ring
    return (out / (w_paged + w_ring)).to(q.dtype)
