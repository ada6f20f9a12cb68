"""The gradient of FlexAttention's per-key bias without atomics (``attention_backend:
"flex-transposed"`` and ``"flex-channel"``).

The DMC mask adds ``log_keep[b, kv_head, j]`` to the score of query ``i`` and key ``j`` on the
*weighted* pairs (``i - j > delay``; App. H). When ``log_keep`` requires grad, PyTorch's
FlexAttention backward scatters its gradient from every (query, key) score with an atomic add
(pytorch/pytorch#137452): about ``batch * heads * seq^2 / 2`` adds per layer, the queries of a
tile all adding into the same keys. Here the bias enters the score_mod detached, and
:class:`TransposedBiasGrad`, an identity on the attention's output, supplies the gradient:

    d loss / d log_keep[j] = sum over the group's query heads and the weighted queries i of
                             P_ij (dO_i . v_j - D_i),        D_i = dO_i . O_i

(the softmax backward ``dS_ij = P_ij (dP_ij - D_i)`` with ``dP_ij = dO_i . v_j``, summed over
the pairs that carry the bias). The sums over i are one more FlexAttention *forward* with
queries and keys swapped: key j asks, query i answers with the score ``s_ij + log_keep_j -
lse_i = log P_ij`` on weighted pairs (``-inf`` elsewhere) and the value ``[dO_i, D_i]``, so
that ``exp(lse'_j) * out'_j = sum_i P_ij [dO_i, D_i]``. That pass runs in the forward's dtype
(bf16 on a GPU: FlexAttention takes one dtype for its queries, keys and values; it accumulates
in float32), the dot products with ``v_j`` summed in float32 (:func:`row_dot`), the sums over
heads in float32. The gradient equals
FlexAttention's own up to rounding; only the order of the sums differs.

``"flex-channel"`` needs no second pass where the keys' last channel is 0 (DMC's decision
channel after RoPE: that channel of every score is ``q_i[-1] * 0``). The query's last channel is
then free: set to 1 (:func:`unit_last_channel`), the scores do not change and FlexAttention's
own key gradient in that channel is ``scale * sum_i dS_ij``, the sum over every query that sees
key j (:class:`KeyChannelBiasGrad`). The bias's gradient is the sum over the weighted pairs
only, so the visible pairs that carry no bias are taken off: DMC's diagonal (a token sees its
own open slot unweighted), with delayed merging the open slot at ``i - j = d + 1``; one
``[batch, heads, seq]`` term per such offset (:func:`unweighted_pairs_gradient`,
:class:`UnweightedPairsGrad`), not a pass over the ``seq x seq`` pairs. Its precision is that of
FlexAttention's key gradient (float32 sums stored in the keys' dtype).
"""
from __future__ import annotations

import torch


class TransposedBiasGrad(torch.autograd.Function):
    """``out`` unchanged forward; backward: ``grad_out`` passes to ``out`` and the gradient of
    ``log_keep [batch, kv_heads, keys]`` comes from :func:`bias_gradient`.

    Args (forward): ``out [batch, q_heads, seq, dim_v]`` (FlexAttention's output, the bias
    detached inside), ``lse [batch, q_heads, seq]`` its log-sum-exp, ``query``, ``key``,
    ``value`` its inputs (``key``, ``value [batch, kv_heads, keys, dim]``), ``log_keep``,
    ``scale``, ``transposed_pass(query_t, key_t, value_t, score_mod)``: the swapped forward
    (FlexAttention with the transposed block mask of the weighted pairs, returning ``out,
    lse``), ``weighted(q_idx, kv_idx)``: the pairs that carry the bias.
    """

    @staticmethod
    def forward(ctx, out, lse, query, key, value, log_keep, scale, transposed_pass, weighted):
        ctx.save_for_backward(out, lse, query, key, value, log_keep)
        ctx.scale, ctx.transposed_pass, ctx.weighted = scale, transposed_pass, weighted
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        out, lse, query, key, value, log_keep = ctx.saved_tensors
        grad_log_keep = None if not ctx.needs_input_grad[5] else bias_gradient(
            grad_out, out, lse, query, key, value, log_keep, ctx.scale, ctx.transposed_pass,
            ctx.weighted)  # (a log_keep without a gradient: nothing to compute)
        return grad_out, None, None, None, None, grad_log_keep, None, None, None


def bias_gradient(grad_out, out, lse, query, key, value, log_keep, scale, transposed_pass,
                  weighted) -> torch.Tensor:
    """``d loss / d log_keep`` ``[batch, kv_heads, keys]`` (float32) from the attention's
    upstream gradient ``grad_out`` (see the module docstring; arguments as
    :class:`TransposedBiasGrad`)."""
    batch, q_heads, seq, dim_v = grad_out.shape
    kv_heads, keys = key.shape[1], log_keep.shape[-1]
    group = q_heads // kv_heads
    # [dO_i, D_i] in the pass's dtype, padded to twice dim_v (FlexAttention takes power-of-two
    # head sizes): written in place, not a float32 concatenation cast afterwards
    answers = grad_out.new_zeros(batch, q_heads, seq, 2 * dim_v, dtype=query.dtype)
    answers[..., :dim_v] = grad_out
    answers[..., dim_v] = row_dot(grad_out, out)  # D_i [batch, q_heads, seq]
    bias, lse = log_keep.detach().float(), lse.detach().float()

    def score_mod(score, b, h, q_idx, kv_idx):  # q_idx: a key j, kv_idx: a query i
        log_p = score + bias[b, h // group, q_idx] - lse[b, h, kv_idx]
        return torch.where(weighted(kv_idx, q_idx), log_p, float("-inf"))

    askers = key[:, :, :keys]  # [batch, q_heads, keys, dim]: each query head's keys
    if group > 1:
        askers = askers.repeat_interleave(group, dim=1)
    sums, sums_lse = transposed_pass(askers, query, answers, score_mod)
    sums = sums.reshape(batch, kv_heads, group, keys, 2 * dim_v)  # query head kv * group + g
    dots = row_dot(sums[..., :dim_v], value[:, :, None, :keys])
    scale_back = torch.exp(sums_lse.float()).reshape(dots.shape)  # rows with no pair: 0
    return (scale_back * (dots - sums[..., dim_v].float())).sum(2)  # [batch, kv_heads, keys]


def channel_bias_attention(attend, query, key, value, log_keep, scale,
                           unweighted_offsets) -> torch.Tensor:
    """Attention whose bias gradient comes from the keys' gradient in their zero last channel
    (``"flex-channel"``, see the module docstring).

    Args:
        attend: ``(query, key, value) -> (out, lse)``, the attention with ``log_keep`` entering
            its scores detached (FlexAttention with ``return_aux``).
        query: ``[batch, q_heads, seq, dim]``; its last channel is ignored (set to 1 here).
        key: ``[batch, kv_heads, keys, dim]`` with 0 in its last channel; value likewise.
        log_keep: ``[batch, kv_heads, biased keys]``, the first keys' bias.
        scale: the softmax scale. unweighted_offsets: the lags ``i - j`` of the visible pairs
            of those keys that carry no bias.

    Returns:
        ``attend``'s output, through which ``log_keep`` gets its gradient.
    """
    query = unit_last_channel(query)
    key = KeyChannelBiasGrad.apply(key, log_keep, scale)
    out, lse = attend(query, key, value)
    return UnweightedPairsGrad.apply(out, lse.detach(), query.detach(), key.detach(),
                                     value.detach(), log_keep, scale, tuple(unweighted_offsets))


def unit_last_channel(query: torch.Tensor) -> torch.Tensor:
    """``query [..., dim]`` with its last channel set to 1, out of place (one pass forward, one
    over the gradient, whose last channel is 0); no host value copied in (CUDA graphs)."""
    last = torch.arange(query.shape[-1], device=query.device) == query.shape[-1] - 1
    return torch.where(last, torch.ones((), dtype=query.dtype, device=query.device), query)


class KeyChannelBiasGrad(torch.autograd.Function):
    """``key`` unchanged forward; backward: ``grad_key[..., -1] / scale`` over the first
    ``log_keep.shape[-1]`` keys is ``sum_i dS_ij`` over the queries that see key j (the queries'
    last channel being 1 and the keys' 0, see the module docstring), passed to ``log_keep``;
    that channel of the keys' gradient is then zeroed (the attention ignores the queries' last
    channel, so the keys' gets none).

    Args (forward): ``key [batch, kv_heads, keys, dim]`` whose last channel is 0, ``log_keep
    [batch, kv_heads, biased keys]``, ``scale`` the softmax scale.
    """

    @staticmethod
    def forward(ctx, key, log_keep, scale):
        ctx.scale, ctx.keys, ctx.dtype = scale, log_keep.shape[-1], log_keep.dtype
        return key.view_as(key)

    @staticmethod
    def backward(ctx, grad_key):
        grad_log_keep = grad_key[..., :ctx.keys, -1].to(ctx.dtype) / ctx.scale
        grad_key[..., -1] = 0  # FlexAttention's fresh key gradient: written in place
        return grad_key, grad_log_keep, None


class UnweightedPairsGrad(torch.autograd.Function):
    """``out`` unchanged forward; backward: ``grad_out`` passes to ``out``, and ``log_keep``
    gets minus the score gradient of the visible pairs that carry no bias
    (:func:`unweighted_pairs_gradient`), which :class:`KeyChannelBiasGrad`'s sum holds.

    Args (forward): ``out [batch, q_heads, seq, dim_v]``, ``lse [batch, q_heads, seq]`` and the
    ``query``, ``key``, ``value`` of the attention, ``log_keep [batch, kv_heads, keys]``,
    ``scale``, ``offsets`` the ``i - j`` of those pairs.
    """

    @staticmethod
    def forward(ctx, out, lse, query, key, value, log_keep, scale, offsets):
        ctx.save_for_backward(out, lse, query, key, value)
        ctx.scale, ctx.offsets = scale, offsets
        ctx.keys, ctx.dtype = log_keep.shape[-1], log_keep.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        out, lse, query, key, value = ctx.saved_tensors
        pairs = unweighted_pairs_gradient(grad_out, out, lse, query, key[:, :, :ctx.keys],
                                          value[:, :, :ctx.keys], ctx.scale, ctx.offsets)
        return grad_out, None, None, None, None, -pairs.to(ctx.dtype), None, None


def unweighted_pairs_gradient(grad_out, out, lse, query, key, value, scale,
                              offsets) -> torch.Tensor:
    """``sum over the group's query heads and o in offsets of dS[j + o, j]`` ``[batch,
    kv_heads, keys]`` (float32; float64 inputs give float64): the softmax's score gradient
    ``dS_ij = P_ij (dO_i . v_j - D_i)``, ``D_i = dO_i . O_i``, ``P_ij = exp(scale q_i . k_j -
    lse_i)`` of the pairs at lag ``o``, which carry no bias (their score is the plain
    product). 0 for a key whose query ``j + o`` is past the sequence. The dot products are
    :func:`row_dot`'s.

    Args: ``grad_out``, ``out [batch, q_heads, seq, dim_v]``, ``lse [batch, q_heads, seq]``,
    ``query [batch, q_heads, seq, dim]``, ``key [batch, kv_heads, keys, dim]``, ``value
    [batch, kv_heads, keys, dim_v]``, ``scale``, ``offsets`` lags ``i - j >= 0``.
    """
    batch, q_heads, seq, _ = grad_out.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    total = torch.zeros(batch, kv_heads, keys, dtype=work, device=query.device)
    for offset in offsets:
        count = min(seq - offset, keys)  # keys j < count have a query j + offset
        if count <= 0:
            continue

        def rows(x):  # the queries j + offset of keys j < count, [batch, kv_heads, group, ...]
            x = x[:, :, offset:offset + count]
            return x.reshape(batch, kv_heads, group, count, *x.shape[3:])

        d_out = rows(grad_out)
        prob = torch.exp(row_dot(rows(query), key[:, :, None, :count], work) * scale
                         - rows(lse))
        d_prob = row_dot(d_out, value[:, :, None, :count], work)
        total[..., :count] += (prob * (d_prob - row_dot(d_out, rows(out), work))).sum(2)
    return total


def row_dot(x: torch.Tensor, y: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``sum(x * y, -1)`` (broadcast): the products in the inputs' dtype, the sum in ``dtype``
    (one rounding per product in bf16, 2^-9, where float32 copies of both inputs would move
    ~2.5x the bytes)."""
    return (x * y).sum(-1, dtype=dtype)
