"""The gradient of FlexAttention's per-key bias without atomics (``attention_backend:
"flex-transposed"``).

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
in float32), the products with ``v_j`` and the sums over heads in float32. The gradient equals
FlexAttention's own up to rounding; only the order of the sums differs.
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
    answers[..., dim_v] = (grad_out.float() * out.float()).sum(-1)  # D_i [batch, q_heads, seq]
    bias, lse = log_keep.detach().float(), lse.detach().float()

    def score_mod(score, b, h, q_idx, kv_idx):  # q_idx: a key j, kv_idx: a query i
        log_p = score + bias[b, h // group, q_idx] - lse[b, h, kv_idx]
        return torch.where(weighted(kv_idx, q_idx), log_p, float("-inf"))

    askers = key[:, :, :keys]  # [batch, q_heads, keys, dim]: each query head's keys
    if group > 1:
        askers = askers.repeat_interleave(group, dim=1)
    sums, sums_lse = transposed_pass(askers, query, answers, score_mod)
    sums = sums.reshape(batch, kv_heads, group, keys, 2 * dim_v)  # query head kv * group + g
    dots = (sums[..., :dim_v].float() * value[:, :, None, :keys].float()).sum(-1)
    scale_back = torch.exp(sums_lse.float()).reshape(dots.shape)  # rows with no pair: 0
    return (scale_back * (dots - sums[..., dim_v].float())).sum(2)  # [batch, kv_heads, keys]
