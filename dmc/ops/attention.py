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
from dmc.ops.flex_bias_grad import TransposedBiasGrad, channel_bias_attention
from dmc.ops.mask import bias_masks, delayed_log_keep, delayed_merge_masks

BACKENDS = ("auto", "dense", "flex", "flex-transposed", "flex-channel")


def dmc_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_keep: torch.Tensor,
    scale: float | None = None,
    backend: str = "auto",
    delay: int = 0,
    zero_key_channel: bool = False,
) -> torch.Tensor:
    """Attention with the DMC mask (``delay`` 0) or the DMS delayed-eviction mask (``delay`` =
    the eviction window w; :func:`dmc.ops.mask.bias_from_log_keep`), GQA-aware.

    Args:
        query: ``[batch, q_heads, seq, dim]``.
        key, value: ``[batch, kv_heads, seq, dim]`` (partially accumulated, key post-RoPE).
        log_keep: ``[batch, kv_heads, seq]``, ``log(1 - alpha_{j+1})`` per key position.
        scale: softmax scale, default ``dim ** -0.5``.
        backend: ``"dense"`` (:mod:`dmc.ops.dense_attention`, any device), ``"flex"``
            (FlexAttention; compiled on CUDA, eager forward elsewhere; the gradient of
            ``log_keep`` by FlexAttention's own backward, an atomic add per score),
            ``"flex-transposed"`` (the same forward; that gradient by a swapped FlexAttention
            forward, :mod:`dmc.ops.flex_bias_grad`), ``"flex-channel"`` (the same forward;
            that gradient read from FlexAttention's key gradient in the keys' zero channel,
            needs ``zero_key_channel``), or ``"auto"`` (on CUDA flex-channel with
            ``zero_key_channel``, else flex-transposed, flex where torch lacks
            ``return_aux``; dense on other devices: on an H100 at the GPU kit's 1B shape a
            train step took 1.67x vanilla's time with flex-transposed, 2.50x with flex, 3.46x
            dense; flex-channel not yet timed on a GPU).
        delay: key j is weighted by ``log_keep[j]`` only for queries ``i - j > delay``.
        zero_key_channel: the caller's keys have 0 in their last channel (DMC's decision
            channel after RoPE), so every query's last channel meets zeros only: the result
            is the same whatever it holds, and it gets no gradient.

    Returns:
        ``[batch, q_heads, seq, dim]`` in the dtype of ``query``.
    """
    scale, flex, bias_grad = _settings("dmc_attention", query, key, scale, backend,
                                       zero_key_channel)
    seq, device = query.shape[2], str(query.device)
    if flex:
        return _flex(query, key, value, log_keep, scale, _causal_block_mask(seq, device),
                     _dmc_weighted(delay), bias_grad,
                     lambda: _transposed_block_mask("dmc", seq, delay, device),
                     tuple(range(delay + 1)))
    return masked_bias_attention(query, key, value, log_keep,
                                 _dense_layout(key.shape[2], seq, delay, str(query.device)), scale)


def _settings(name: str, query, key, scale, backend,
              zero_key_channel: bool) -> tuple[float, bool, str]:
    """The softmax scale (default ``dim ** -0.5``), whether FlexAttention runs (any flex
    backend) and how ``log_keep``'s gradient is computed there: ``"atomic"`` (FlexAttention's
    own), ``"transposed"`` or ``"channel"``; ValueError naming ``name`` for a bad backend, a
    query head count that is not a multiple of the KV heads' or flex-channel without
    ``zero_key_channel``."""
    if backend not in BACKENDS:
        raise ValueError(f"{name}: backend must be one of {BACKENDS}, got {backend!r}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"{name}: q_heads={query.shape[1]} is not a multiple of kv_heads={key.shape[1]}"
        )
    if backend == "flex-channel" and not zero_key_channel:
        raise ValueError(f"{name}: backend 'flex-channel' needs keys whose last channel is 0 "
                         f"(zero_key_channel=True: DMC's keys after RoPE); accepted here: "
                         f"{BACKENDS[:4]}")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if backend == "auto":
        if not query.is_cuda:
            return scale, False, "atomic"
        if not _has_return_aux():
            return scale, True, "atomic"
        return scale, True, "channel" if zero_key_channel else "transposed"
    return scale, backend.startswith("flex"), {"flex-transposed": "transposed",
                                               "flex-channel": "channel"}.get(backend, "atomic")


@functools.cache
def _has_return_aux() -> bool:
    """Whether this torch's FlexAttention returns its log-sum-exp (``AuxRequest``), which the
    transposed pass needs."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest  # noqa: F401
    except ImportError:
        return False
    return True


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
    zero_key_channel: bool = False,
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
        backend, zero_key_channel: as :func:`dmc_attention`'s (the last channel of both key
            sets).

    Returns:
        ``[batch, q_heads, seq, dim]`` in the dtype of ``query``.
    """
    scale, flex, bias_grad = _settings("delayed_merge_attention", query, key, scale, backend,
                                       zero_key_channel)
    keys, values = torch.cat([key_acc, key], dim=2), torch.cat([value_acc, value], dim=2)
    seq = query.shape[2]
    device = str(query.device)
    if flex:
        return _flex(query, keys, values, log_keep, scale, _delayed_block_mask(seq, delay, device),
                     _delayed_weighted(seq, delay), bias_grad,
                     lambda: _transposed_block_mask("delayed", seq, delay, device),
                     (delay + 1,))
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


def _dmc_weighted(delay: int):
    """The pairs that carry the DMC (``delay`` 0) or DMS (``delay`` w) bias."""
    return lambda q_idx, kv_idx: q_idx - kv_idx > delay


def _delayed_weighted(seq: int, delay: int):
    """The pairs of delayed merging's ``[accumulated | raw]`` keys that carry the bias."""
    return lambda q_idx, kv_idx: (kv_idx < seq) & (q_idx - kv_idx > delay + 1)


@functools.lru_cache(maxsize=32)
def _transposed_block_mask(kind: str, seq: int, delay: int, device: str):
    """The weighted pairs of ``kind`` ("dmc" or "delayed") as a block mask of keys ``[0, seq)``
    over queries ``[0, seq)``: the swapped pass of :mod:`dmc.ops.flex_bias_grad`."""
    from torch.nn.attention.flex_attention import create_block_mask

    weighted = _dmc_weighted(delay) if kind == "dmc" else _delayed_weighted(seq, delay)
    return create_block_mask(lambda b, h, key_idx, query_idx: weighted(query_idx, key_idx),
                             None, None, seq, seq, device=device)


def _flex(query, key, value, log_keep, scale, block_mask, weighted, bias_grad, transposed_mask,
          unweighted_offsets):
    """FlexAttention over ``key, value [batch, kv_heads, keys, dim]`` with ``block_mask``,
    adding ``log_keep[b, kv_head, kv_idx]`` to the scores where ``weighted(q_idx, kv_idx)``
    (which must be false past ``log_keep``'s end: the index is only clamped there). When
    ``log_keep`` needs a gradient and ``bias_grad`` is not ``"atomic"``, the bias enters
    detached and :mod:`dmc.ops.flex_bias_grad` supplies its gradient: ``"transposed"`` by a
    swapped pass over ``transposed_mask()``, ``"channel"`` from the keys' gradient in their
    zero last channel less the visible pairs at lags ``unweighted_offsets``, which carry no
    bias."""
    from torch.nn.attention.flex_attention import flex_attention

    group = query.shape[1] // key.shape[1]
    last = log_keep.shape[-1] - 1
    swapped = bias_grad != "atomic" and log_keep.requires_grad and torch.is_grad_enabled()
    bias = log_keep.detach().float() if swapped else log_keep.float()

    def score_mod(score, b, h, q_idx, kv_idx):
        weight = bias[b, h // group, torch.clamp(kv_idx, max=last)]
        return torch.where(weighted(q_idx, kv_idx), score + weight, score)

    attend = _compiled_flex() if query.is_cuda else flex_attention
    options = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=group > 1)
    if not swapped:
        return attend(query, key, value, **options)
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError as error:
        raise ValueError(f"attention backend 'flex-{bias_grad}' needs FlexAttention's return_aux "
                         f"(AuxRequest), which torch {torch.__version__} lacks; accepted "
                         f"here: {BACKENDS[:3]}") from error
    if bias_grad == "channel":
        def attend_with_lse(query, key, value):
            out, aux = attend(query, key, value, **options, return_aux=AuxRequest(lse=True))
            return out, aux.lse

        return channel_bias_attention(attend_with_lse, query, key, value, log_keep, scale,
                                      unweighted_offsets)
    out, aux = attend(query, key, value, **options, return_aux=AuxRequest(lse=True))

    def transposed_pass(query_t, key_t, value_t, score_mod_t):
        with torch.no_grad():
            out_t, aux_t = attend(query_t, key_t, value_t, score_mod=score_mod_t,
                                  block_mask=transposed_mask(), scale=scale,
                                  return_aux=AuxRequest(lse=True))
        return out_t, aux_t.lse

    return TransposedBiasGrad.apply(out, aux.lse, query.detach(), key.detach(), value.detach(),
                                    log_keep, scale, transposed_pass, weighted)


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

