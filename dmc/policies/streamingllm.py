"""StreamingLLM (Xiao et al., ICLR 2024, "Efficient Streaming Language Models with Attention
Sinks").

Keep the first ``sinks`` tokens (attention sinks, 4 in the paper) and the most recent
``b - sinks`` ones (Sec. 3.2, Fig. 4: a rolling KV cache updated at every token). The paper's
budgets are far above the sinks; here a budget ``b <= sinks`` (the first ``sinks * CR`` tokens
of a stream scored from its start) keeps the first ``b`` tokens and no recent one, so the sinks
are all still there once the budget passes them (an evicted token never comes back).

Schedule: ``"streaming"`` by default, the paper's rolling cache (Sec. 3.2: the cache is
evicted as every token arrives, prompt and generation alike, for unbounded streams).

Positions: ``rerotate`` is on by default, as the paper assigns positions IN THE CACHE (Sec. 3.2,
"we focus on positions within the cache rather than those in the original text"): a kept key
sits at its cache index and the query at the next one. The runner re-rotates the kept keys
(:mod:`.rerotate`); the recent window stays where it was written, so only the sink slots move
and only they keep a float32 copy of their key (:meth:`moving_slots`).
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from .base import KVPolicy, LayerView, first_mask, recent_mask


@dataclass(eq=False)
class StreamingLLM(KVPolicy):
    """Attention sinks + recent window, keys at their cache positions.

    Args:
        sinks: attention-sink tokens kept at the start (paper: 4).
    """

    name = "streamingllm"
    paper_rerotate = True
    _: KW_ONLY
    sinks: int = 4

    def __post_init__(self):
        super().__post_init__()
        if int(self.sinks) != self.sinks or self.sinks < 0:
            raise ValueError(f"sinks must be an integer >= 0, got {self.sinks!r}")
        self.sinks = int(self.sinks)

    def moving_slots(self) -> int:
        """The sinks: the recent window is contiguous up to the newest token, which sits at its
        cache position already."""
        return self.sinks

    def scores(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(view.positions, dtype=torch.float32)

    def protected(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        sinks = budget.clamp(max=self.sinks)
        return first_mask(view, sinks) | recent_mask(view, budget - sinks)
