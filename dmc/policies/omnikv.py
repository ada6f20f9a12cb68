"""OmniKV (Hao et al., ICLR 2025, "OmniKV: Dynamic Context Selection for Efficient Long-Context
LLMs"): no eviction.

Token importance is similar across consecutive layers, so a few *filter layers* choose, at every
decode step, the tokens that the following layers attend to (Sec. 4): the filter layer's
attention of the current query (summed over its query heads) ranks the cached tokens and the
top ``ceil(n / CR)`` of them (plus the current token) are the context of every later layer up to
the next filter layer. Layers up to and including the first filter layer, and the filter layers
themselves, attend densely; prefill is dense, as in the paper.

Nothing is freed: the full cache stays (the paper offloads the sparse layers' full cache to CPU
memory and keeps on the GPU the dense layers' cache and the selected tokens). ``compression``
reports that GPU-resident footprint, as the paper reports its memory: a dense layer holds ``n``
slots per head, a sparse layer ``min(n, ceil(n / CR))``.
"""
from __future__ import annotations

import torch

from .base import KVPolicy, LayerView, top_mask


class OmniKV(KVPolicy):
    """Filter layers pick a token subset; the later layers attend to it (no eviction).

    Args:
        filter_layers: layer indices that select tokens; default ``(num_layers // 4,)``.
    """

    name = "omnikv"
    evicts = False
    seq_state_names = ("selected",)

    def __init__(self, compression_ratio: float = 2.0, *, filter_layers=None):
        super().__init__(compression_ratio)
        if filter_layers is not None:
            layers = list(filter_layers)
            if not layers or any(int(x) != x or x < 0 for x in layers):
                raise ValueError(f"filter_layers must be non-negative layer indices, got "
                                 f"{filter_layers!r}")
            filter_layers = tuple(sorted(set(int(x) for x in layers)))
        self.filter_layers = filter_layers

    def bind(self, shape) -> None:
        super().bind(shape)
        if self.filter_layers is None:
            self.filter_layers = (shape.num_layers // 4,)
        if max(self.filter_layers) >= shape.num_layers:
            raise ValueError(f"filter_layers must be below num_layers={shape.num_layers}, got "
                             f"{self.filter_layers}")
        self.selected = torch.zeros(shape.max_seqs, shape.max_slots, dtype=torch.bool,
                                    device=shape.device)

    def sparse(self, layer: int) -> bool:
        """Whether ``layer`` attends to the selected tokens only."""
        return layer > self.filter_layers[0] and layer not in self.filter_layers

    def observe(self, view: LayerView, queries, q_positions, probs, prefill) -> None:
        if prefill or view.layer not in self.filter_layers:
            return
        scores = probs[:, :, :, -1].sum(dim=(1, 2)).masked_fill(~view.valid[:, 0],
                                                                float("-inf"))
        chosen = top_mask(scores, self.budget(view.tokens)) & view.valid[:, 0]
        chosen |= view.positions[:, 0] == (view.tokens - 1)[:, None]  # the current token
        rows = view.seqs.to(scores.device)
        self.selected[rows] = False
        self.selected[rows, :scores.shape[-1]] = chosen

    def attend(self, layer: int, seqs: torch.Tensor, queries: torch.Tensor, runner):
        """Decode attention of a sparse layer over the selected tokens,
        ``queries [batch, q_heads, dim] -> [batch, q_heads, dim]``; None for a dense layer."""
        if not self.sparse(layer):
            return None
        keys, values, lengths = runner.cache.read(layer, seqs)
        batch, kv, length, dim = keys.shape
        rows = seqs.to(keys.device)
        chosen = self.selected[rows, :length][:, None, None]  # [batch, 1, 1, L]
        q = queries.float().reshape(batch, kv, -1, dim)
        logits = torch.einsum("bhgd,bhld->bhgl", q, keys) * self.shape.scale
        probs = torch.softmax(logits.masked_fill(~chosen, float("-inf")), dim=-1).nan_to_num(0.0)
        out = torch.einsum("bhgl,bhld->bhgd", probs, values)
        return out.reshape(queries.shape).to(queries.dtype)

    def reported_slots(self, lengths: torch.Tensor, tokens: int) -> torch.Tensor:
        selected = int(self.budget(torch.tensor([tokens]))[0])
        out = lengths.clone()
        for layer in range(lengths.shape[0]):
            if self.sparse(layer):
                out[layer] = lengths[layer].clamp(max=selected)
        return out
