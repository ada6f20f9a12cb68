"""SnapKV (Li et al., NeurIPS 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

The last ``window`` queries (the observation window) vote for the earlier tokens (Eq. 1-2): their
softmax attention over all visible keys is summed over the window for every prefix token, then
smoothed by a 1-D pooling of ``kernel_size`` (stride 1, padding ``k // 2``; the authors' default
is average pooling); the window tokens are always kept and the ``b - window`` best prefix tokens
join them (Eq. 3).

Schedule: ``"prefill"`` by default, the paper's (Sec. 4.1 and its Listing 1; the paper is not in
``papers/``): the prompt's cache is compressed once, after the prompt, the observation window
being its end; the generated tokens are appended uncompressed. Chunked prefill changes nothing:
the prompt is compressed after its last chunk, every prompt token still held. The observation
window is always the last ``window`` tokens seen (their post-RoPE queries are kept, ``[seqs,
layers, q_heads, window, head_dim]``), so ``"streaming"`` (after every chunk and decode step) and
``"prefill"`` with ``recompress_every`` also work; streaming with a chunk shorter than the prompt
evicts before the end of the prompt is seen (the runner warns). When the budget is smaller than
the window, the window shrinks to the budget.

GQA: a KV head's vote is the MEAN over the query heads of its group (as kvpress).
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch
import torch.nn.functional as F

from .base import KVPolicy, LayerView, recent_mask
from .schedule import Schedule

POOLINGS = ("avgpool", "maxpool")


@dataclass(eq=False)
class SnapKV(KVPolicy):
    """SnapKV eviction: observation-window votes, pooled; the window is kept.

    Args:
        window: observation window (paper: 32).
        kernel_size: pooling kernel, odd (authors' default 5).
        pooling: ``"avgpool"`` (authors' default) or ``"maxpool"``.
    """

    name = "snapkv"
    paper_schedule = Schedule("prefill")
    needs_prompt_end = True
    seq_state_names = ("window_queries", "window_positions")  # positions reset to -1
    _: KW_ONLY
    window: int = 32
    kernel_size: int = 5
    pooling: str = "avgpool"

    def __post_init__(self):
        super().__post_init__()
        window, kernel_size = self.window, self.kernel_size
        if int(window) != window or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        if int(kernel_size) != kernel_size or kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd integer >= 1, got {kernel_size!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {self.pooling!r}")
        self.window, self.kernel_size = int(window), int(kernel_size)

    def bind(self, shape) -> None:
        super().bind(shape)
        s = shape
        heads = s.num_kv_heads * s.group
        self.window_queries = torch.zeros(s.max_seqs, s.num_layers, heads, self.window,
                                          s.head_dim, device=s.device)
        self.window_positions = torch.full((s.max_seqs, s.num_layers, self.window), -1,
                                           dtype=torch.long, device=s.device)

    def reset(self, seq: int) -> None:
        super().reset(seq)
        self.window_positions[seq] = -1

    def observe(self, view, queries, q_positions, probs, prefill) -> None:
        rows = view.seqs.to(queries.device)
        w = self.window
        kept_q = torch.cat([self.window_queries[rows, view.layer], queries], dim=2)[:, :, -w:]
        kept_p = torch.cat([self.window_positions[rows, view.layer], q_positions], 1)[:, -w:]
        self.window_queries[rows, view.layer] = kept_q
        self.window_positions[rows, view.layer] = kept_p

    def _window(self, budget: torch.Tensor) -> torch.Tensor:
        return budget.clamp(max=self.window)

    def votes(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        """Eq. 1: window attention summed over the window, ``[batch, kv, L]`` (group mean)."""
        from .runner import causal_probs

        rows = view.seqs.to(view.device)
        positions = self.window_positions[rows, view.layer]  # [batch, window]
        used = torch.arange(self.window, device=rows.device) >= (self.window
                                                                 - self._window(budget))[:, None]
        positions = torch.where(used, positions, -1)
        probs = causal_probs(self.window_queries[rows, view.layer], view, positions,
                             self.shape.scale)
        return probs.sum(dim=3).mean(dim=2)

    def scores(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        """Eq. 2: the votes of the prefix (window excluded), pooled along the slots."""
        prefix = view.valid & ~recent_mask(view, self._window(budget))
        votes = self.votes(view, budget).masked_fill(~prefix, 0.0)
        batch, kv, length = votes.shape
        flat = votes.reshape(batch * kv, 1, length)
        pad = self.kernel_size // 2
        if self.pooling == "avgpool":
            pooled = F.avg_pool1d(flat, self.kernel_size, stride=1, padding=pad)
        else:
            pooled = F.max_pool1d(flat, self.kernel_size, stride=1, padding=pad)
        return pooled.reshape(batch, kv, length).masked_fill(~prefix, 0.0)

    def protected(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        return recent_mask(view, self._window(budget))
