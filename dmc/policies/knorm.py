"""KNorm (Devoto et al., EMNLP 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"; kvpress's ``KnormPress``).

Keys with a low L2 norm receive high attention, so each (layer, KV head) keeps the
``b = ceil(n / CR)`` held tokens whose keys have the LOWEST norm: score ``-||k_j||_2``. Keys are
cached post-RoPE; RoPE is a rotation, so the norm is the pre-RoPE key's. No attention needed.

Schedule: ``"prefill"`` by default, as kvpress's ``KnormPress`` (one compression after the
prompt, the decode phase uncompressed; the paper is not in ``papers/``, so the schedule follows
the reference implementation the other rows are checked against). ``"streaming"`` bounds the
memory over long generations.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import KVPolicy, LayerView
from .schedule import Schedule


@dataclass(eq=False)
class KNorm(KVPolicy):
    """Keep the keys of lowest L2 norm."""

    name = "knorm"
    paper_schedule = Schedule("prefill")

    def scores(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        """``-||k_j||_2``, ``[batch, kv_heads, L]``."""
        return -view.keys.norm(dim=-1)
