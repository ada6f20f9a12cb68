"""CAOTE and FastCAOTE (Goel et al., 2025, "CAOTE: KV Caching through Attention Output Error
based Token Eviction"), on top of H2O, TOVA or SnapKV.

The base policy's scores are normalised into attention weights ``alpha_j = s_j / sum_i s_i``
over the head's cached tokens and the attention output ``o = sum_i alpha_i v_i``. Evicting token
``j`` alone turns the output into ``(o - alpha_j v_j) / (1 - alpha_j)``, an error of norm
``e_j = alpha_j / (1 - alpha_j) * ||o - v_j||`` (the CAOTE score, Eq. 8, with a base policy's
scores normalised by their sum: Eq. 20-22); the tokens with the smallest errors are evicted, the
base policy's always-kept slots (recent / observation window) kept. FastCAOTE drops the need for
the output: ``o`` is replaced by the mean of the cached values (Eq. 23: the output under uniform
attention), so the score needs only the values and the base scores.

Over SnapKV, whose observation window is kept unscored (score 0), the window's slots get
``alpha = 0``: ``o`` and the normalisation cover the prefix only. The paper does not say how
SnapKV's window enters Eq. 20-22; this keeps the base's scores as they are, as it does for H2O's
and TOVA's.

Budgets and the base's protected slots are the base policy's. GQA: scores and values are per KV
head (the base's group aggregation).

Schedule: ``"streaming"`` by default, whatever the base, the paper's (Sec. 2 "Block-wise prompt
prefill" and Sec. 4 "Prompt consumption": the prompt is consumed in blocks of 128 tokens with an
eviction after each block, then one eviction per generated token).
"""
from __future__ import annotations

import torch

from .base import LayerView, PolicyWrapper
from .h2o import H2O
from .schedule import Schedule
from .snapkv import SnapKV
from .tova import TOVA


class CAOTE(PolicyWrapper):
    """The base policy's selection with CAOTE scores (eviction error of the attention output).

    Args:
        base: ``"h2o"``, ``"tova"`` or ``"snapkv"``.
        schedule, recompress_every, rerotate: see :class:`~dmc.policies.base.PolicyWrapper`.
        base_kwargs: passed to the base policy (e.g. SnapKV's ``window``).
    """

    name = "caote"
    bases = {"h2o": H2O, "tova": TOVA, "snapkv": SnapKV}
    default_base = "h2o"
    paper_schedule = Schedule("streaming")
    paper_rerotate = False
    needs_prompt_end = False  # the paper's block-wise prefill, even over SnapKV

    def __init__(self, compression_ratio: float = 2.0, *, base: str | None = None, **kwargs):
        if base == "tova":  # heads select apart, so TOVA scores each by its own tokens
            kwargs["per_head"] = True
        super().__init__(compression_ratio, base=base, **kwargs)

    def output(self, view: LayerView, alpha: torch.Tensor) -> torch.Tensor:
        """``o = sum_i alpha_i v_i``, ``[batch, kv, head_dim]``."""
        return torch.einsum("bhl,bhld->bhd", alpha, view.values)

    def scores(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        base = torch.where(view.valid, self.base.scores(view, budget).clamp(min=0), 0.0)
        alpha = base / base.sum(-1, keepdim=True).clamp(min=1e-30)
        distance = (self.output(view, alpha)[:, :, None] - view.values).norm(dim=-1)
        return alpha / (1 - alpha).clamp(min=1e-12) * distance


class FastCAOTE(CAOTE):
    """CAOTE with the attention output replaced by the mean cached value."""

    name = "fastcaote"

    def output(self, view: LayerView, alpha: torch.Tensor) -> torch.Tensor:
        valid = view.valid.float()
        total = torch.einsum("bhl,bhld->bhd", valid, view.values)
        return total / valid.sum(-1, keepdim=True).clamp(min=1)
