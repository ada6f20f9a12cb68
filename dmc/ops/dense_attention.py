"""Attention under a bias that is ``log_keep[j]``, 0 or -inf per (query, key): the dense path of
DMC's additive mask (App. H of the DMC paper), DMS's delayed eviction and delayed merging.

``softmax(q k^T * scale + bias) v`` with ``bias[i, j] = log_keep[j]`` where ``weighted[i, j]``,
0 where only ``visible[i, j]``, -inf elsewhere (:func:`dmc.ops.mask.bias_from_masks`), computed
one block of queries at a time over the keys that block can see, the probabilities recomputed in
the backward from each row's log-sum-exp (as FlashAttention does): what autograd keeps is the
inputs, the output (in the queries' dtype, as returned) and one float per query row, not the
``[batch, heads, seq, seq]`` scores. A block's keys are those its queries see, in one range,
or two where they are far apart (delayed merging: its accumulated keys and its band of raw
keys, a sequence apart: one range over both took about twice the keys). The
gradient of ``log_keep`` is the score gradient summed over the weighted entries of its column,
``d log_keep[j] = sum_{i: weighted[i, j]} dS[i, j]`` with ``dS = P * (dP - rowsum(dO * O))``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

# Query rows per block. CPU (2 cores, 2026-11-26): 64 / 128 / 256 within noise of each other,
# as fast as keeping the probabilities. CUDA: 512, fewer kernel launches per layer (not measured).
QUERY_BLOCK = {"cpu": 128, "cuda": 512}
# Keys no query of a block sees, in a run at least this long between keys it does see, are
# skipped (the block's keys taken in two ranges): delayed merging's raw keys sit a sequence
# away from the accumulated ones a block sees.
MIN_GAP = 64


class MaskLayout(NamedTuple):
    """The masks of :func:`masked_bias_attention` and their key spans per query block
    (:func:`mask_layout`); build once per shape and reuse."""

    weighted: torch.Tensor  # bool [queries, keys]: the score gets log_keep[j]
    visible: torch.Tensor  # bool [queries, keys]: the score is finite (weighted within it)
    spans: list[tuple[int, int, int, int, int, int, int]]


def mask_layout(weighted: torch.Tensor, visible: torch.Tensor,
                query_block: int | None = None, min_gap: int = MIN_GAP) -> MaskLayout:
    """The :class:`MaskLayout` of boolean ``weighted`` and ``visible`` ``[queries, keys]``
    masks (``weighted`` within ``visible``; every query sees at least one key), in blocks of
    ``query_block`` queries (default :data:`QUERY_BLOCK` of the masks' device type), a run of
    ``min_gap`` or more keys that no query of a block sees skipped."""
    if weighted.shape != visible.shape or weighted.dim() != 2:
        raise ValueError(f"mask_layout: weighted and visible must be the same [queries, keys], "
                         f"got {tuple(weighted.shape)} and {tuple(visible.shape)}")
    block = query_block or QUERY_BLOCK.get(visible.device.type, QUERY_BLOCK["cpu"])
    return MaskLayout(weighted, visible, _key_spans(weighted, visible, block, min_gap))


def masked_bias_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          log_keep: torch.Tensor, layout: MaskLayout,
                          scale: float) -> torch.Tensor:
    """Attention with the bias of :func:`dmc.ops.mask.bias_from_masks`, GQA-aware, in float32
    (float64 inputs stay float64).

    Args:
        query: ``[batch, q_heads, queries, dim]``.
        key, value: ``[batch, kv_heads, keys, dim]``.
        log_keep: ``[batch, kv_heads, keys]`` (may hold -inf).
        layout: :func:`mask_layout` of the ``[queries, keys]`` masks.
        scale: softmax scale.

    Returns:
        ``[batch, q_heads, queries, dim]`` in the dtype of ``query``, laid out in memory as
        ``[queries, batch, q_heads, dim]`` (megatron's order).
    """
    return _MaskedBiasAttention.apply(query, key, value, log_keep, layout.weighted,
                                      layout.visible, layout.spans, scale)


def _key_spans(weighted: torch.Tensor, visible: torch.Tensor, block: int,
               min_gap: int) -> list[tuple[int, ...]]:
    """``(first query, end query, first key, first masked key, end key, first key of the second
    range, its end)`` of each ``block`` queries: the block sees keys ``[first key, end key)``,
    of which ``[first key, first masked key)`` are weighted for every query of the block (there
    the bias is ``log_keep`` alone, no mask needed), and, where the keys it sees have a gap of
    ``min_gap`` or more, also those of the second range (empty otherwise: its first key is
    its end)."""
    queries, keys = visible.shape
    blocks = -(-queries // block)
    columns = torch.arange(keys, device=visible.device)
    pad = (0, blocks * block - queries)

    def per_block(values, fill, reduce):
        return reduce(torch.nn.functional.pad(values, pad, value=fill).view(blocks, -1), dim=1)

    first = per_block(torch.where(visible, columns, keys).amin(dim=1), keys, torch.amin)
    unweighted = per_block(torch.where(weighted, keys, columns).amin(dim=1), keys, torch.amin)
    seen = torch.nn.functional.pad(visible, (0, 0, 0, pad[1])).view(blocks, -1, keys).any(1)
    spans = []
    for b, (lo, mid, sees) in enumerate(zip(first.tolist(), unweighted.tolist(), seen.cpu())):
        cols = sees.nonzero()[:, 0]
        gaps = cols.diff() - 1
        split = int(gaps.argmax()) if gaps.numel() and int(gaps.max()) >= min_gap else None
        hi = int(cols[split]) + 1 if split is not None else int(cols[-1]) + 1
        second = (int(cols[split + 1]), int(cols[-1]) + 1) if split is not None else (hi, hi)
        spans.append((b * block, min(queries, (b + 1) * block), lo, min(max(lo, mid), hi), hi,
                      *second))
    return spans


def _block_scores(q, key, log_keep, weighted, visible, span):
    """Scaled scores plus bias of one query block, ``[batch, kv_heads, group * rows, cols]``
    (``q [batch, kv_heads, group, queries, dim]``, ``cols`` the span's keys, in
    :func:`_span_part`'s order): ``log_keep`` added over the block's weighted columns, the
    masks applied to the rest only."""
    a, e, lo, mid = span[:4]
    batch, kv_heads, group = q.shape[:3]
    scores = torch.matmul(_blocks(q, span), _span_part(key, span, 2).transpose(-1, -2))
    scores[..., :mid - lo].add_(log_keep[:, :, None, lo:mid])
    rest = scores[..., mid - lo:].view(batch, kv_heads, group, e - a, -1)
    rest.add_(torch.where(_span_part(weighted[a:e], span, 1, masked=True),
                          _span_part(log_keep, span, 2, masked=True)[:, :, None, None], 0.0))
    rest.masked_fill_(~_span_part(visible[a:e], span, 1, masked=True), float("-inf"))
    return scores


def _span_part(x, span, dim: int, masked: bool = False):
    """The span's keys of ``x`` along ``dim``: ``[first key, end)`` (``masked``: from its first
    masked key) then the second range's."""
    lo, mid, hi, lo2, hi2 = span[2:]
    first = x.narrow(dim, mid if masked else lo, hi - (mid if masked else lo))
    return first if lo2 == hi2 else torch.cat([first, x.narrow(dim, lo2, hi2 - lo2)], dim=dim)


def _add_to_span(total, part, span, masked: bool = False):
    """``total[:, :, key] += part`` over the span's keys (``part [batch, kv_heads, cols, ...]``
    in :func:`_span_part`'s order)."""
    lo, mid, hi, lo2, hi2 = span[2:]
    start = mid if masked else lo
    total[:, :, start:hi] += part[:, :, :hi - start]
    if lo2 != hi2:
        total[:, :, lo2:hi2] += part[:, :, hi - start:]


def _blocks(x, span):
    """Rows ``span`` of ``x [batch, kv_heads, group, queries, n]`` as ``[batch, kv_heads,
    group * rows, n]``."""
    a, e = span[:2]
    return x[:, :, :, a:e].reshape(x.shape[0], x.shape[1], -1, x.shape[-1])


class _MaskedBiasAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, log_keep, weighted, visible, spans, scale):
        batch, q_heads, queries, dim = query.shape
        kv_heads = key.shape[1]
        if q_heads % kv_heads:
            raise ValueError(f"masked_bias_attention: q_heads={q_heads} is not a multiple of "
                             f"kv_heads={kv_heads}")
        work = torch.float64 if query.dtype == torch.float64 else torch.float32
        q = (query.to(work) * scale).reshape(batch, kv_heads, q_heads // kv_heads, queries, dim)
        k, v, lk = key.to(work), value.to(work), log_keep.to(work)
        # [seq, batch, heads, dim] in memory, as megatron's output projection reads it: its
        # input is then a view of what the backward keeps here, not a second copy
        out = q.new_empty((queries, batch, kv_heads, q_heads // kv_heads, dim)).permute(
            1, 2, 3, 0, 4)
        lse = q.new_empty(q.shape[:-1] + (1,))
        for span in spans:
            a, e = span[:2]
            scores = _block_scores(q, k, lk, weighted, visible, span)
            top = scores.amax(dim=-1, keepdim=True)
            total = scores.sub_(top).exp_().sum(dim=-1, keepdim=True)
            out[:, :, :, a:e] = (torch.matmul(scores, _span_part(v, span, 2)) / total).view(
                out[:, :, :, a:e].shape)
            lse[:, :, :, a:e] = (top + total.log()).view(lse[:, :, :, a:e].shape)
        result = out.view(batch, q_heads, queries, dim).to(query.dtype)
        ctx.save_for_backward(query, key, value, log_keep, result, lse, weighted, visible)
        ctx.spans, ctx.scale = spans, scale
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        query, key, value, log_keep, result, lse, weighted, visible = ctx.saved_tensors
        work = lse.dtype
        batch, kv_heads, group = lse.shape[:3]
        out = result.to(work).view(batch, kv_heads, group, *result.shape[2:])
        q = (query.to(work) * ctx.scale).reshape(out.shape)
        k, v, lk = key.to(work), value.to(work), log_keep.to(work)
        d_out = grad_out.to(work).reshape(out.shape)
        delta = (d_out * out).sum(dim=-1, keepdim=True)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        d_log_keep = torch.zeros_like(lk)
        for span in ctx.spans:
            a, e, lo, mid = span[:4]
            keys = _span_part(k, span, 2)
            probs = _block_scores(q, k, lk, weighted, visible, span).sub_(
                _blocks(lse, span)).exp_()
            d_out_block = _blocks(d_out, span)
            d_scores = torch.matmul(d_out_block, _span_part(v, span, 2).transpose(-1, -2))
            d_scores.sub_(_blocks(delta, span)).mul_(probs)
            _add_to_span(dv, torch.matmul(probs.transpose(-1, -2), d_out_block), span)
            dq[:, :, :, a:e] = torch.matmul(d_scores, keys).view(dq[:, :, :, a:e].shape)
            _add_to_span(dk, torch.matmul(d_scores.transpose(-1, -2), _blocks(q, span)), span)
            d_log_keep[:, :, lo:mid] += d_scores[..., :mid - lo].sum(dim=2)
            rest = d_scores[..., mid - lo:].view(batch, kv_heads, group, e - a, -1)
            rest.masked_fill_(~_span_part(weighted[a:e], span, 1, masked=True), 0)
            _add_to_span(d_log_keep, rest.sum(dim=(2, 3)), span, masked=True)
        dq = dq.mul_(ctx.scale).view(query.shape)
        return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype),
                d_log_keep.to(log_keep.dtype), None, None, None, None)
