"""Causal attention with the DMC additive mask (App. H), dense and fused.

``softmax(q k^T * scale + bias) v`` where ``bias[i, j] = log_keep[j]`` for j < i, 0 for j == i and
-inf for j > i (see :mod:`dmc.ops.mask`). The dense path (:mod:`dmc.ops.dense_attention`, any
device) computes the scores block by block of queries with the bias from the boolean masks of
:func:`dmc.ops.mask.bias_masks`; the fused path uses FlexAttention with a ``score_mod`` that reads
``log_keep[batch, kv_head, j]`` and a causal block mask. Neither keeps a seq x seq tensor for
the backward.
"""
from __future__ import annotations

import functools

import torch

from dmc.ops.dense_attention import mask_layout, masked_bias_attention
from dmc.ops.mask import bias_masks, delayed_log_keep, delayed_merge_masks

BACKENDS = ("auto", "dense", "flex")


def dmc_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_keep: torch.Tensor,
    scale: float | None = None,
    backend: str = "auto",
    delay: int = 0,
) -> torch.Tensor:
    """Attention with the DMC mask (``delay`` 0) or the DMS delayed-eviction mask (``delay`` =
    the eviction window w; :func:`dmc.ops.mask.bias_from_log_keep`), GQA-aware.

    Args:
        query: ``[batch, q_heads, seq, dim]``.
        key, value: ``[batch, kv_heads, seq, dim]`` (partially accumulated, key post-RoPE).
        log_keep: ``[batch, kv_heads, seq]``, ``log(1 - alpha_{j+1})`` per key position.
        scale: softmax scale, default ``dim ** -0.5``.
        backend: ``"dense"`` (:mod:`dmc.ops.dense_attention`, any device), ``"flex"``
            (FlexAttention; compiled on CUDA, eager forward elsewhere), or ``"auto"`` (flex on
            CUDA, dense otherwise).
        delay: key j is weighted by ``log_keep[j]`` only for queries ``i - j > delay``.

    Returns:
        ``[batch, q_heads, seq, dim]`` in the dtype of ``query``.
    """
    scale, flex = _settings("dmc_attention", query, key, scale, backend)
    seq = query.shape[2]
    if flex:
        return _flex(query, key, value, log_keep, scale, _causal_block_mask(seq, str(query.device)),
                     lambda q_idx, kv_idx: q_idx - kv_idx > delay)
    return masked_bias_attention(query, key, value, log_keep,
                                 _dense_layout(key.shape[2], seq, delay, str(query.device)), scale)


def _settings(name: str, query, key, scale, backend) -> tuple[float, bool]:
    """The softmax scale (default ``dim ** -0.5``) and whether FlexAttention runs; ValueError
    naming ``name`` for a bad backend or a query head count that is not a multiple of the KV
    heads'."""
    if backend not in BACKENDS:
        raise ValueError(f"{name}: backend must be one of {BACKENDS}, got {backend!r}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"{name}: q_heads={query.shape[1]} is not a multiple of kv_heads={key.shape[1]}"
        )
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return scale, backend == "flex" or (backend == "auto" and query.is_cuda)


def delayed_merge_attention(
    query: torch.Tensor,
    key_acc: torch.Tensor,
    value_acc: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_keep: torch.Tensor,
    delay: int,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """DMC attention with delayed merging (``dmc.merge_delay``; :func:`delayed_merge_bias`):
    one softmax over the accumulated keys (Eq. 9) and the raw keys of the last ``delay + 1``
    tokens, GQA-aware. ``backend`` as :func:`dmc_attention`: "dense" builds the ``[batch,
    q_heads, seq, 2 * seq]`` bias, "flex" reads ``log_keep`` in a ``score_mod`` over the
    ``2 * seq`` keys with a block mask of the two bands.

    Args:
        query: ``[batch, q_heads, seq, dim]``.
        key_acc, value_acc: ``[batch, kv_heads, seq, dim]`` partially accumulated (key post-RoPE).
        key, value: ``[batch, kv_heads, seq, dim]`` the tokens' own (key post-RoPE).
        log_keep: ``[batch, kv_heads, seq]``, ``log(1 - alpha_{j+1})`` per key position.
        delay: d >= 1. scale: softmax scale, default ``dim ** -0.5``.
        backend: "auto" (flex on CUDA, dense otherwise), "dense" or "flex".

    Returns:
        ``[batch, q_heads, seq, dim]`` in the dtype of ``query``.
    """
    scale, flex = _settings("delayed_merge_attention", query, key, scale, backend)
    keys, values = torch.cat([key_acc, key], dim=2), torch.cat([value_acc, value], dim=2)
    seq = query.shape[2]
    if flex:
        return _flex(query, keys, values, log_keep, scale,
                     _delayed_block_mask(seq, delay, str(query.device)),
                     lambda q_idx, kv_idx: (kv_idx < seq) & (q_idx - kv_idx > delay + 1))
    return masked_bias_attention(query, keys, values, delayed_log_keep(log_keep),
                                 _delayed_layout(seq, delay, str(query.device)), scale)


@functools.lru_cache(maxsize=32)
def _dense_layout(keys: int, queries: int, delay: int, device: str):
    """The layout of :func:`bias_masks`, one per shape shared by every layer (autograd keeps
    its masks)."""
    return mask_layout(*bias_masks(keys, queries, delay, torch.device(device)))


@functools.lru_cache(maxsize=32)
def _delayed_layout(seq: int, delay: int, device: str):
    """The layout of :func:`delayed_merge_masks`, one per shape shared by every layer."""
    return mask_layout(*delayed_merge_masks(seq, delay, torch.device(device)))


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=32)
def _causal_block_mask(seq: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return create_block_mask(causal, None, None, seq, seq, device=device)


def _flex(query, key, value, log_keep, scale, block_mask, weighted):
    """FlexAttention over ``key, value [batch, kv_heads, keys, dim]`` with ``block_mask``,
    adding ``log_keep[b, kv_head, kv_idx]`` to the scores where ``weighted(q_idx, kv_idx)``
    (which must be false past ``log_keep``'s end: the index is only clamped there)."""
    from torch.nn.attention.flex_attention import flex_attention

    group = query.shape[1] // key.shape[1]
    last = log_keep.shape[-1] - 1
    log_keep = log_keep.float()

    def score_mod(score, b, h, q_idx, kv_idx):
        weight = log_keep[b, h // group, torch.clamp(kv_idx, max=last)]
        return torch.where(weighted(q_idx, kv_idx), score + weight, score)

    attend = _compiled_flex() if query.is_cuda else flex_attention
    return attend(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                  enable_gqa=group > 1)


@functools.lru_cache(maxsize=32)
def _delayed_block_mask(seq: int, delay: int, device: str):
    """Queries ``[0, seq)`` over ``[accumulated | raw]`` keys ``[0, 2 * seq)``: accumulated key
    j for ``i - j > delay``, raw key ``seq + j`` for ``0 <= i - j <= delay``."""
    from torch.nn.attention.flex_attention import create_block_mask

    def bands(b, h, q_idx, kv_idx):
        raw = kv_idx >= seq
        lag = q_idx - torch.where(raw, kv_idx - seq, kv_idx)
        return torch.where(raw, (lag >= 0) & (lag <= delay), lag > delay)

    return create_block_mask(bands, None, None, seq, 2 * seq, device=device)

