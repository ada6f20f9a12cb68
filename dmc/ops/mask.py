"""The additive attention mask of DMC training (Fig. 3 and App. H of the paper).

Key slot j is visible to query i > j only while the next token does not merge into it, so its
score is weighted by (1 - alpha_{j+1}): in log space ``score(i, j) += log(1 - alpha_{j+1})`` for
j < i, 0 on the diagonal (a token always sees its own partial accumulation) and -inf above it.
With hard alphas this is exactly the attention pattern of inference with a compressed cache.
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
    ``logsigmoid(-x)`` (exact even where alpha rounds to 1)."""
    log_keep = F.logsigmoid(-scaled_logits.float())
    return torch.cat([log_keep[..., 1:], log_keep.new_zeros(log_keep.shape[:-1] + (1,))], dim=-1)


def bias_from_log_keep(log_keep: torch.Tensor, q_len: int | None = None) -> torch.Tensor:
    """Expands per-key ``log(1 - alpha_{j+1})`` into the dense causal bias.

    Args:
        log_keep: ``[batch, heads, seq]`` from :func:`log_keep_next`.
        q_len: number of queries (the last ``q_len`` positions); defaults to ``seq``.

    Returns:
        ``[batch, heads, q_len, seq]``: ``log_keep[j]`` for j < i, 0 for j == i, -inf for j > i.
    """
    seq = log_keep.shape[-1]
    q_len = seq if q_len is None else q_len
    q_pos = torch.arange(seq - q_len, seq, device=log_keep.device)[:, None]
    k_pos = torch.arange(seq, device=log_keep.device)[None, :]
    bias = log_keep.unsqueeze(-2).expand(*log_keep.shape[:-1], q_len, seq)
    bias = torch.where(k_pos == q_pos, torch.zeros_like(bias), bias)
    return bias.masked_fill(k_pos > q_pos, float("-inf"))


def dmc_attention_bias(alpha: torch.Tensor) -> torch.Tensor:
    """Dense additive DMC mask (App. H).

    Args:
        alpha: ``[batch, heads, seq]`` merge probabilities in [0, 1] (hard or soft).

    Returns:
        ``[batch, heads, seq, seq]``: 0 on the diagonal, ``log(1 - alpha[j + 1])`` below it
        (-inf where alpha[j + 1] = 1), -inf above it.
    """
    return bias_from_log_keep(log_keep_next(alpha))
