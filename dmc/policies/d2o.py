"""D2O, Dynamic Discriminative Operations (Wan et al., ICLR 2025).

Layer level (Sec. 3.2): layers whose prompt attention is dense (low variance) should evict less.
The variance ``sigma_l^2`` of layer ``l``'s prompt attention weights (every visible
(query, key) entry of every query head) sets the layer's share of the total budget,
``softmax(-sigma^2)_l``; the total is ``m ceil(n / CR)`` slots per head over ``m`` layers
(integers summing to the total, see :func:`~dmc.policies.base.layer_budgets`). The variance
is accumulated over the prompt's chunks and frozen during generation.

Token level (Sec. 3.3): H2O-style eviction (accumulated attention) that always keeps the first
``sinks`` tokens and the most recent ``ceil((b - sinks) / 2)``. Each evicted key ``k_e`` finds its
most cosine-similar kept key ``k_r`` (``u_e = max_r cos(k_e, k_r)``); it is merged only when
``u_e >= tau_t``, an exponential moving average of the mean similarity of the evicted tokens of
each eviction (``tau_t = momentum tau_{t-1} + (1 - momentum) mean_e u_e``, ``tau_0`` the first
mean), per (sequence, layer, KV head). The merge is similarity-weighted:
``k_r <- (e k_r + sum_e exp(u_e) k_e) / (e + sum_e exp(u_e))`` (the kept key's own weight is
``exp(cos(k_r, k_r)) = e``), and the same weights merge the values.

GQA: accumulated attention sums the group's query heads (as :mod:`.h2o`); keys are per KV head.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .base import LayerView, first_mask, layer_budgets, recent_mask
from .h2o import H2O


class D2O(H2O):
    """Variance-based layer budgets, H2O eviction with sinks, EMA-threshold similarity merges.

    Args:
        sinks: first tokens always kept.
        momentum: weight of the previous threshold in the EMA, in [0, 1).
    """

    name = "d2o"
    seq_state_names = ("attention_moments", "threshold", "has_threshold")

    def __init__(self, compression_ratio: float = 2.0, *, sinks: int = 4, momentum: float = 0.9):
        super().__init__(compression_ratio)
        if int(sinks) != sinks or sinks < 0:
            raise ValueError(f"sinks must be an integer >= 0, got {sinks!r}")
        if not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        self.sinks, self.momentum = int(sinks), float(momentum)

    def bind(self, shape) -> None:
        super().bind(shape)
        s = shape
        # per (sequence, layer): count, sum and sum of squares of the prompt attention weights
        self.attention_moments = torch.zeros(s.max_seqs, s.num_layers, 3, dtype=torch.float64,
                                             device=s.device)
        self.threshold = torch.zeros(s.max_seqs, s.num_layers, s.num_kv_heads, device=s.device)
        self.has_threshold = torch.zeros(s.max_seqs, s.num_layers, s.num_kv_heads,
                                         dtype=torch.bool, device=s.device)

    def observe(self, view, queries, q_positions, probs, prefill) -> None:
        super().observe(view, queries, q_positions, probs, prefill)
        if not prefill:
            return
        visible = (view.valid[:, :, None, :]
                   & (view.positions[:, :, None, :] <= q_positions[:, None, :, None])
                   & (q_positions >= 0)[:, None, :, None])  # [batch, kv, n, L]
        count = visible.sum(dim=(1, 2, 3)).double() * self.shape.group
        p = probs.double()
        moments = torch.stack([count, p.sum(dim=(1, 2, 3, 4)), (p * p).sum(dim=(1, 2, 3, 4))], 1)
        self.attention_moments[view.seqs.to(probs.device), view.layer] += moments

    def layer_variance(self, seqs: torch.Tensor) -> torch.Tensor:
        """``sigma_l^2`` of the prompt attention, ``[batch, layers]`` (0 before any prompt)."""
        count, total, squares = self.attention_moments[seqs.to(self.shape.device)].unbind(-1)
        mean = total / count.clamp(min=1)
        return (squares / count.clamp(min=1) - mean * mean).clamp(min=0)

    def budgets(self, view_seqs, tokens):
        shares = torch.softmax(-self.layer_variance(view_seqs), dim=-1)
        return layer_budgets(self.budget(tokens), tokens, shares.tolist())

    def protected(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        sinks = budget.clamp(max=self.sinks)
        recent = torch.div(budget - sinks + 1, 2, rounding_mode="floor")
        return first_mask(view, sinks) | recent_mask(view, recent)

    def merge(self, view: LayerView, keep: torch.Tensor):
        evicted = view.valid & ~keep
        unit = F.normalize(view.keys, dim=-1)
        cosine = torch.einsum("bhid,bhjd->bhij", unit, unit)
        cosine = cosine.masked_fill(~keep[:, :, None, :], float("-inf"))
        similarity, target = cosine.max(dim=-1)  # [batch, kv, L]
        similarity = torch.where(evicted, similarity, 0.0)
        count = evicted.sum(-1)
        mean = similarity.sum(-1) / count.clamp(min=1)
        rows = view.seqs.to(view.keys.device)
        previous = self.threshold[rows, view.layer]
        known = self.has_threshold[rows, view.layer]
        tau = torch.where(known, self.momentum * previous + (1 - self.momentum) * mean, mean)
        tau = torch.where(count > 0, tau, previous)
        self.threshold[rows, view.layer] = tau
        self.has_threshold[rows, view.layer] = known | (count > 0)
        merged = evicted & (similarity >= tau[..., None])
        weight = torch.where(merged, similarity.exp(), 0.0)
        index = target[..., None].expand_as(view.keys)
        own = torch.where(keep, math.e, 0.0)
        total = own.scatter_add(2, target, weight)
        out = []
        for x in (view.keys, view.values):
            summed = (own[..., None] * x).scatter_add(2, index, weight[..., None] * x)
            out.append(torch.where(keep[..., None], summed / total.clamp(min=1e-30)[..., None], x))
        return out[0], out[1]
