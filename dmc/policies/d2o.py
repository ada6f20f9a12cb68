"""D2O, Dynamic Discriminative Operations (Wan et al., ICLR 2025), ``papers/d2o.txt``.

Layer level (Sec. 4.1, Eq. 4-5): the density of layer ``l`` is the variance of its accumulated
prompt attention, ``F_v^l = Var(sum_i A_p^l[i, :])``: the column sums ``s_j`` of the causal
prompt attention (what each prompt token received from every prompt query), their population
variance over the prompt tokens ``j``, taken per query head (App. A.9, Eq. 20) and averaged over
the layer's query heads. Denser (lower-variance) layers get more: ``alpha_l = L rho
softmax(-F_v)_l``, i.e. layer ``l`` holds ``L b softmax(-F_v)_l`` of the ``L b`` slots per head
over ``L`` layers, ``b = ceil(n / CR)`` (integers summing to the total, see
:func:`~dmc.policies.base.layer_budgets`).

Normalisation (the paper gives none): the column sums have mean 1 whatever the prompt (every
query's row sums to 1), but their variance grows with the prompt length (about 1 for uniform
causal attention, about ``n`` for a layer that puts everything on one sink), so the raw
``softmax(-F_v)`` would hand one layer everything on long prompts and depend on ``n``. We use
``F_v^l / mean_l' F_v^l'``: the paper's order of layers, shares invariant to a common scale of the
variances, uniform shares when every layer is alike (or before any prompt).

The variance is frozen after the prompt (Eq. 4 uses the prompt encoding only). Under
``"streaming"`` with the prompt in several chunks, a token evicted after an early chunk keeps the
column sum it had then; under ``"prefill"`` every prompt token is held at the prompt's end and
the variance is the paper's whatever the chunk size.

Schedule: ``"prefill"`` with ``recompress_every=1`` by default, the paper's: the prompt's cache is
compressed once after prompt encoding (Sec. 4.1, Eq. 5: ``S = L_prompt``; Eq. 10 at ``t = 0``),
then one token is evicted or merged at every generation step (Eq. 6 and Eq. 10 at ``t > 0``).

Token level (Sec. 4.2.1, Eq. 6-8): H2O-style eviction (accumulated attention) that keeps the
first ``T = sinks`` tokens, the most recent ``M`` and the ``N`` best-scored others,
``b = T + N + M`` with ``N:M = heavy_ratio:1`` (paper 3:1, App. A.3 Table 10), so
``M = ceil((b - T) / (1 + heavy_ratio))``. The paper does not fix ``T``; 4 as StreamingLLM,
whose rule for a budget ``b <= T`` this follows (the first ``b`` tokens, no recent one).

Merging (Sec. 4.2.2, Eq. 9-12): each evicted key ``k_e`` finds its most cosine-similar kept key
``k_r`` (``u_e = max_r cos(k_e, k_r)``); it is merged only when ``u_e >= tau_t``, the EMA threshold
of Eq. 10 per (sequence, layer, KV head): ``tau_0`` the mean of the ``u_e`` of the first eviction,
then ``tau_t = beta mean_e u_e + (1 - beta) tau_{t-1}`` (paper: one evicted token per decode step;
a prompt chunk evicting several uses their mean), beta = 0.7 (App. A.3). The merge is
similarity-weighted: ``k_r <- (e k_r + sum_e exp(u_e) k_e) / (e + sum_e exp(u_e))`` (the kept
key's own weight is ``exp(cos(k_r, k_r)) = e``), and the same weights merge the values.

GQA: accumulated attention sums the group's query heads (as :mod:`.h2o`); keys are per KV head.
"""
from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass

import torch
import torch.nn.functional as F

from .base import LayerView, first_mask, layer_budgets, recent_mask
from .h2o import H2O
from .schedule import Schedule


@dataclass(eq=False)
class D2O(H2O):
    """Variance-based layer budgets, H2O eviction with sinks, EMA-threshold similarity merges.

    Args:
        sinks: first tokens always kept (``T``).
        heavy_ratio: ``N:M``, heavy hitters per recent token (paper 3).
        beta: EMA weight of the newest similarity, in (0, 1] (paper 0.7).
    """

    name = "d2o"
    paper_schedule = Schedule("prefill", every=1)
    needs_prompt_end = True
    slot_state_names = ("accumulated", "prompt_columns", "prompt_slot")
    seq_state_names = ("folded", "threshold", "has_threshold")
    _: KW_ONLY
    sinks: int = 4
    heavy_ratio: float = 3.0
    beta: float = 0.7

    def __post_init__(self):
        super().__post_init__()
        sinks, heavy_ratio, beta = self.sinks, self.heavy_ratio, self.beta
        if int(sinks) != sinks or sinks < 0:
            raise ValueError(f"sinks must be an integer >= 0, got {sinks!r}")
        if not float(heavy_ratio) >= 0.0:
            raise ValueError(f"heavy_ratio must be >= 0, got {heavy_ratio!r}")
        if not 0.0 < float(beta) <= 1.0:
            raise ValueError(f"beta must be in (0, 1], got {beta!r}")
        self.sinks, self.heavy_ratio, self.beta = int(sinks), float(heavy_ratio), float(beta)

    def bind(self, shape) -> None:
        super().bind(shape)
        s = shape
        # column sums of the prompt attention per query head: [seqs, layers, kv, slots, group]
        self.prompt_columns = self._slot_tensor()[..., None].repeat(1, 1, 1, 1, s.group)
        self.prompt_slot = self._slot_tensor(torch.bool)  # the slot holds a prompt token
        # count, sum, sum of squares of the column sums of evicted prompt tokens
        self.folded = torch.zeros(s.max_seqs, s.num_layers, s.num_kv_heads, s.group, 3,
                                  dtype=torch.float64, device=s.device)
        self.threshold = torch.zeros(s.max_seqs, s.num_layers, s.num_kv_heads, device=s.device)
        self.has_threshold = torch.zeros(s.max_seqs, s.num_layers, s.num_kv_heads,
                                         dtype=torch.bool, device=s.device)

    def observe(self, view, queries, q_positions, probs, prefill) -> None:
        super().observe(view, queries, q_positions, probs, prefill)
        if not prefill:
            return
        rows = view.seqs.to(probs.device)
        width = probs.shape[-1]
        self.prompt_columns[rows, view.layer, :, :width] += probs.sum(dim=3).transpose(2, 3)
        self.prompt_slot[rows, view.layer, :, :width] = view.valid

    def layer_variance(self, seqs: torch.Tensor) -> torch.Tensor:
        """``F_v^l`` of Eq. 4, ``[batch, layers]``: the variance of each query head's prompt
        column sums (the held prompt tokens' and the evicted ones'), averaged over the heads
        (0 before any prompt)."""
        rows = seqs.to(self.shape.device)
        columns = self.prompt_columns[rows].double()  # [batch, layers, kv, slots, group]
        live = moments(self.prompt_slot[rows], columns, dim=3)
        count, total, squares = (live + self.folded[rows]).unbind(-1)
        mean = total / count.clamp(min=1)
        variance = (squares / count.clamp(min=1) - mean * mean).clamp(min=0)
        return variance.mean(dim=(2, 3))

    def layer_shares(self, seqs: torch.Tensor) -> torch.Tensor:
        """``softmax(-F_v / mean_l F_v)`` over the layers, ``[batch, layers]`` (they sum to 1)."""
        variance = self.layer_variance(seqs)
        scale = variance.mean(dim=-1, keepdim=True)
        return torch.softmax(-variance / torch.where(scale > 0, scale, 1.0), dim=-1)

    def budgets(self, view_seqs, tokens):
        return layer_budgets(self.budget(tokens), tokens, self.layer_shares(view_seqs).tolist())

    def protected(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        sinks = budget.clamp(max=self.sinks)
        recent = torch.ceil((budget - sinks).double() / (1 + self.heavy_ratio)).long()
        return first_mask(view, sinks) | recent_mask(view, recent)

    def merge(self, view: LayerView, keep: torch.Tensor):
        evicted = view.valid & ~keep
        self._fold(view, evicted)
        count = evicted.sum(-1)  # [batch, kv]
        width = int(count.max())
        # the evicted slots of each head first (in slot order), E = the most of any head
        gone = torch.argsort((~evicted).to(torch.int8), dim=-1, stable=True)[..., :width]
        present = torch.arange(width, device=view.device) < count[..., None]  # [batch, kv, E]
        unit = F.normalize(view.keys, dim=-1)
        rows_of = gone[..., None].expand(-1, -1, -1, unit.shape[-1])  # [batch, kv, E, dim]
        cosine = torch.einsum("bhed,bhjd->bhej", unit.gather(2, rows_of), unit)
        cosine = cosine.masked_fill(~keep[:, :, None, :], float("-inf"))
        similarity, target = cosine.max(dim=-1)  # [batch, kv, E]
        similarity = torch.where(present, similarity, 0.0)
        mean = similarity.sum(-1) / count.clamp(min=1)
        rows = view.seqs.to(view.device)
        previous = self.threshold[rows, view.layer]
        known = self.has_threshold[rows, view.layer]
        tau = torch.where(known, self.beta * mean + (1 - self.beta) * previous, mean)
        tau = torch.where(count > 0, tau, previous)
        self.threshold[rows, view.layer] = tau
        self.has_threshold[rows, view.layer] = known | (count > 0)
        merged = present & (similarity >= tau[..., None])
        weight = torch.where(merged, similarity.exp(), 0.0)  # [batch, kv, E]
        own = torch.where(keep, math.e, 0.0)
        total = own.scatter_add(2, target, weight)
        into = target[..., None].expand_as(rows_of)
        out = []
        for x in (view.keys, view.values):
            moved = weight[..., None] * x.gather(2, rows_of)
            summed = (own[..., None] * x).scatter_add(2, into, moved)
            out.append(torch.where(keep[..., None], summed / total.clamp(min=1e-30)[..., None], x))
        return out[0], out[1]

    def _fold(self, view: LayerView, evicted: torch.Tensor) -> None:
        """Add the column sums of the evicted prompt tokens to ``folded`` (their slots go)."""
        rows = view.seqs.to(view.device)
        width = evicted.shape[-1]
        gone = evicted & self.prompt_slot[rows, view.layer, :, :width]
        columns = self.prompt_columns[rows, view.layer, :, :width].double()
        self.folded[rows, view.layer] += moments(gone, columns, dim=2)


def moments(mask: torch.Tensor, columns: torch.Tensor, dim: int) -> torch.Tensor:
    """Count, sum and sum of squares of ``columns [..., slots, group]`` over the slots
    ``mask [..., slots]`` (``dim``: the slot axis), ``[..., group, 3]`` float64."""
    weight = mask[..., None].double()
    return torch.stack([weight.expand_as(columns).sum(dim), (weight * columns).sum(dim),
                        (weight * columns * columns).sum(dim)], dim=-1)
