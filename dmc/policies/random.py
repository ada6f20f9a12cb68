"""Random eviction: the floor every scored policy should beat (kvpress's ``RandomPress``).

Each (layer, KV head) gives every token a uniform random priority, fixed when the token arrives
(a 32-bit integer hash of ``(seed, layer, head, position)``), and every eviction keeps the
``b = ceil(n / CR)`` held tokens of highest priority: a uniform random choice among the held
tokens. kvpress draws fresh scores at its single compression; a priority fixed per token is that
draw made once, which keeps a token's fate consistent from step to step and the choice
independent of how sequences are batched. Every sequence sees the same priorities per position;
another ``seed`` draws others.

Schedule: ``"prefill"`` by default, as kvpress's ``RandomPress`` (one compression after the
prompt): the floor of the prompt-compressing policies it is compared with.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from .base import KVPolicy, LayerView
from .schedule import Schedule

MASK = 0xFFFFFFFF
MULTIPLIER = 0x45D9F3B  # < 2^27, so a 32-bit value times it stays within int64


def mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of ``x`` (int64 in ``[0, 2^32)``), same shape."""
    for _ in range(2):
        x = (((x >> 16) ^ x) * MULTIPLIER) & MASK
    return (x >> 16) ^ x


@dataclass(eq=False)
class Random(KVPolicy):
    """Keep ``b`` held tokens uniformly at random (fixed per-token priorities).

    Args:
        seed: which random priorities (an integer).
    """

    name = "random"
    paper_schedule = Schedule("prefill")
    _: KW_ONLY
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        if int(self.seed) != self.seed:
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        self.seed = int(self.seed)

    def scores(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        """Priorities in ``[0, 1)``, ``[batch, kv_heads, L]``."""
        head = torch.arange(view.positions.shape[1], device=view.positions.device)[None, :, None]
        key = mix(torch.full_like(head, self.seed & MASK) ^ view.layer)
        key = mix(key ^ head)
        return mix(key ^ (view.positions & MASK)).double().div(2.0 ** 32).float()
