"""The additive attention masks of DMC and DMS training.

DMC (Fig. 3 and App. H of the DMC paper): key slot j is visible to query i > j only while the
next token does not merge into it, so its score is weighted by (1 - alpha_{j+1}): in log space
``score(i, j) += log(1 - alpha_{j+1})`` for j < i, 0 on the diagonal (a token always sees its own
partial accumulation) and -inf above it. With hard alphas this is exactly the attention pattern
of inference with a compressed cache.

DMS (Łańcucki et al. 2025, Sec. 3, "delayed eviction"): the decision alpha_{j+1} predicted at
token j + 1 marks key j for eviction, but the key stays visible to the next ``delay`` = w queries:
``score(i, j) += log(1 - alpha_{j+1})`` only for ``i - j > w``; 0 for ``0 <= i - j <= w``. DMC's
mask is the same expression with ``delay = 0`` (one implementation: :func:`bias_from_log_keep`).
NVIDIA's DMS code (Model-Optimizer ``dms_attn_train_mode``) uses the same shift by one and the
same ``q_idx - k_idx <= window`` condition.

DMC with delayed merging (``dmc.merge_delay`` = d, not in the DMC paper: DMS's delayed eviction
carried over to merging): query i sees the last d + 1 tokens (i - d .. i) as they are, and the
tokens before them through DMC's merged slots, as Algorithm 1 leaves them after token i - d - 1:
the open slot (the partial accumulation at i - d - 1) unweighted, each earlier slot weighted by
``log(1 - alpha_{j+1})``. Its bias spans two key sets, the accumulated and the raw keys
(:func:`delayed_merge_bias`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def log_keep_next(alpha: torch.Tensor) -> torch.Tensor:
    """``log(1 - alpha_{j+1})`` for every key position j, 0 for the last one.

    Args:
        alpha: ``[batch, heads, seq]`` merge probabilities.

    Returns:
        ``[batch, heads, seq]`` in float32 (float64 stays float64).
    """
    work = torch.float64 if alpha.dtype == torch.float64 else torch.float32
    log_keep = torch.log1p(-alpha.to(work))
    return torch.cat([log_keep[..., 1:], log_keep.new_zeros(log_keep.shape[:-1] + (1,))], dim=-1)


def log_keep_next_from_logits(scaled_logits: torch.Tensor) -> torch.Tensor:
    """As :func:`log_keep_next` with ``alpha = sigmoid(scaled_logits)``, computed stably as
    ``logsigmoid(-x)`` (exact even where alpha rounds to 1); float32, float64 stays float64."""
    work = torch.float64 if scaled_logits.dtype == torch.float64 else torch.float32
    log_keep = F.logsigmoid(-scaled_logits.to(work))
    return torch.cat([log_keep[..., 1:], log_keep.new_zeros(log_keep.shape[:-1] + (1,))], dim=-1)


def bias_masks(seq: int, q_len: int | None = None, delay: int = 0,
               device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The structure of :func:`bias_from_log_keep` as two boolean ``[q_len, seq]`` masks over
    (query i, key j), the queries being the last ``q_len`` positions: ``weighted`` where the
    score gets ``log_keep[j]`` (``i - j > delay``), ``visible`` where it is finite (j <= i)."""
    if delay < 0:
        raise ValueError(f"bias_from_log_keep: delay must be >= 0, got {delay}")
    q_len = seq if q_len is None else q_len
    lag = (torch.arange(seq - q_len, seq, device=device)[:, None]
           - torch.arange(seq, device=device)[None, :])  # i - j
    return lag > delay, lag >= 0


def delayed_merge_masks(seq: int, delay: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`delayed_merge_bias`'s structure as boolean ``(weighted, visible)`` masks
    ``[seq, 2 * seq]`` over ``[accumulated keys | raw keys]`` (see :func:`bias_masks`)."""
    if delay < 1:
        raise ValueError(f"delayed_merge_bias: delay must be >= 1, got {delay}")
    lag = (torch.arange(seq, device=device)[:, None]
           - torch.arange(seq, device=device)[None, :])  # i - j
    raw = (lag >= 0) & (lag <= delay)
    return (torch.cat([lag > delay + 1, torch.zeros_like(raw)], dim=-1),
            torch.cat([lag > delay, raw], dim=-1))


def delayed_log_keep(log_keep: torch.Tensor) -> torch.Tensor:
    """``log_keep [..., seq]`` over the ``[accumulated | raw]`` keys of
    :func:`delayed_merge_masks`: 0 for the raw keys, which no query weights; ``[..., 2 * seq]``."""
    return torch.cat([log_keep, torch.zeros_like(log_keep)], dim=-1)


def bias_from_masks(log_keep: torch.Tensor, weighted: torch.Tensor,
                    visible: torch.Tensor) -> torch.Tensor:
    """``log_keep [..., keys]`` expanded over the ``[queries, keys]`` masks of
    :func:`bias_masks`: ``log_keep[j]`` where weighted, 0 where only visible, -inf elsewhere;
    ``[..., queries, keys]``."""
    bias = torch.where(weighted, log_keep.unsqueeze(-2), log_keep.new_zeros(()))
    return bias.masked_fill(~visible, float("-inf"))


def bias_from_log_keep(log_keep: torch.Tensor, q_len: int | None = None,
                       delay: int = 0) -> torch.Tensor:
    """Expands per-key ``log(1 - alpha_{j+1})`` into the dense causal bias.

    Args:
        log_keep: ``[batch, heads, seq]`` from :func:`log_keep_next`.
        q_len: number of queries (the last ``q_len`` positions); defaults to ``seq``.
        delay: queries ``i`` with ``i - j <= delay`` see key j unweighted: 0 for DMC, the
            eviction window w for DMS.

    Returns:
        ``[batch, heads, q_len, seq]``: ``log_keep[j]`` for ``i - j > delay``, 0 for
        ``0 <= i - j <= delay``, -inf for j > i.
    """
    return bias_from_masks(log_keep, *bias_masks(log_keep.shape[-1], q_len, delay,
                                                 log_keep.device))


def delayed_merge_bias(log_keep: torch.Tensor, delay: int) -> torch.Tensor:
    """The dense bias of DMC with delayed merging over ``[accumulated keys | raw keys]``.

    Args:
        log_keep: ``[batch, heads, seq]`` from :func:`log_keep_next`.
        delay: d >= 1, the raw tokens a query sees besides itself.

    Returns:
        ``[batch, heads, seq, 2 * seq]``. Accumulated key j (columns ``0 .. seq - 1``):
        ``log_keep[j]`` for ``i - j > d + 1``, 0 for ``i - j == d + 1`` (the open slot), -inf
        for ``i - j <= d``. Raw key j (columns ``seq + j``): 0 for ``0 <= i - j <= d``, -inf
        otherwise.
    """
    masks = delayed_merge_masks(log_keep.shape[-1], delay, log_keep.device)
    return bias_from_masks(delayed_log_keep(log_keep), *masks)


def dmc_attention_bias(alpha: torch.Tensor) -> torch.Tensor:
    """Dense additive DMC mask (App. H).

    Args:
        alpha: ``[batch, heads, seq]`` merge probabilities in [0, 1] (hard or soft).

    Returns:
        ``[batch, heads, seq, seq]``: 0 on the diagonal, ``log(1 - alpha[j + 1])`` below it
        (-inf where alpha[j + 1] = 1), -inf above it.
    """
    return bias_from_log_keep(log_keep_next(alpha))


def dms_attention_bias(alpha: torch.Tensor, window: int) -> torch.Tensor:
    """Dense additive DMS mask (delayed eviction, DMS paper Sec. 3).

    Args:
        alpha: ``[batch, heads, seq]`` eviction probabilities in [0, 1]; ``alpha[t]`` is
            predicted at token t and decides key t - 1.
        window: w, the queries after a key that still see it whatever its decision.

    Returns:
        ``[batch, heads, seq, seq]``: 0 for ``0 <= i - j <= w``, ``log(1 - alpha[j + 1])`` for
        ``i - j > w``, -inf above the diagonal.
    """
    return bias_from_log_keep(log_keep_next(alpha), delay=window)
