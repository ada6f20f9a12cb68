"""FlexAttention's semantics in plain torch, differentiable on the CPU (where FlexAttention has
forwards only): tests put it in place of ``torch.nn.attention.flex_attention.flex_attention``
to run dmc's FlexAttention backends end to end, backward included."""
from types import SimpleNamespace

import torch


def reference_flex(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_aux=None):
    """``flex_attention``'s result in the inputs' dtype: the ``score_mod`` and the block mask's
    ``mask_mod`` applied to broadcast index grids; a row with no visible key gives 0 and
    ``lse`` -inf, as FlexAttention's does (the swapped pass of flex-transposed has such rows:
    keys no weighted query sees). Returns ``(out, aux)`` with ``aux.lse`` when ``return_aux``
    is given."""
    batch, q_heads, queries, dim = query.shape
    group = q_heads // key.shape[1]
    keys, values = (x.repeat_interleave(group, dim=1) for x in (key, value))
    grid = [torch.arange(n).view(*(n if i == j else 1 for j in range(4)))
            for i, n in enumerate((batch, q_heads, queries, key.shape[2]))]
    scores = query @ keys.transpose(-1, -2) * (dim ** -0.5 if scale is None else scale)
    if score_mod is not None:
        scores = score_mod(scores, *grid)
    if block_mask is not None:
        scores = scores.masked_fill(~block_mask.mask_mod(*grid), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)[..., None]
    out = torch.where(empty, 0.0, torch.exp(scores - lse[..., None])) @ values
    return (out, SimpleNamespace(lse=lse)) if return_aux is not None else out
