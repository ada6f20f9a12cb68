"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context
LLM Inference in Resource-Constrained Environments", arXiv 2504.15364; kvpress's
``KeyDiffPress``).

Geometrically distinctive keys get high attention, so each (layer, KV head) keeps the keys least
similar to the cache's anchor: with ``k^_i = k_i / ||k_i||`` over the held keys,
``mu = mean_i k^_i`` and the score ``s_j = -cos(mu, k_j)``; the ``b = ceil(n / CR)`` highest
scores are kept. The anchor is taken over the keys held when the head is brought to its budget
(after each chunk or step: the paper's block-wise eviction with blocks of one chunk). No
attention needed.

Schedule: ``"streaming"`` by default, the paper's (block-wise prompt processing under a fixed
cache budget for resource-constrained devices, evicting after each block and each generated
token; the paper is not in ``papers/``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import KVPolicy, LayerView


@dataclass(eq=False)
class KeyDiff(KVPolicy):
    """Keep the keys least cosine-similar to the mean unit key."""

    name = "keydiff"

    def scores(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        """``-cos(mu, k_j)``, ``[batch, kv_heads, L]`` (``mu`` over the valid slots)."""
        unit = F.normalize(view.keys, dim=-1) * view.valid[..., None]
        anchor = unit.sum(2, keepdim=True) / view.valid.sum(-1)[..., None, None].clamp(min=1)
        return -F.cosine_similarity(view.keys, anchor, dim=-1)
