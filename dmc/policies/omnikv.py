"""OmniKV (Hao et al., ICLR 2025, "OmniKV: Dynamic Context Selection for Efficient Long-Context
LLMs"), ``papers/omnikv.txt``: no token is dropped.

Token importance is similar across consecutive layers, so a few *filter layers* ``L`` choose, at
every decode step, the tokens the following layers attend to (Sec. 4.1, Algorithm 1). The context
selector (Sec. 4.2, Eq. 3-4) of filter layer ``i`` takes the attention ``A_i [H, |w|, n]`` of the
observation window (the queries of the last ``|w|`` tokens, ``H`` query heads, causal) over the
cache, its max over the heads, and a weighted sum over the window,
``S_i = sum_j alpha_j max_h A_i[h, j]``, with ``alpha`` ``"uniform"`` (1), ``"exponential"``
(``2^{j - |w|}``, newest last) or ``"last"`` (the current query only); ``|w| = 16`` for the first
two (Sec. 5). The top ``ceil(n / CR)`` of the ``n - 1`` earlier tokens by ``S_i``, plus the current
token (the query's own key), are the context of the sparse layers up to the next filter layer
(Eq. 1-2). Dense layers (Eq. 2): those before ``L_0``, the filter layers, and the layer right
after each filter layer. Prefill is dense.

Defaults: ``selector="exponential"`` over ``|w| = 16`` (Sec. 5: exponential and last do best on
single-step tasks, last on multi-step ones; ``"last"`` is selectable); ``filter_layers`` the
paper's Llama-3-8B set ``{2, 8, 18}`` of 32 layers scaled to the model (``round(l m / 32)``). On a
model of 5 layers or fewer that leaves no sparse layer (OmniKV is then the dense model): pass
``filter_layers``.

Memory (Sec. 4.1 "Context Bank", Fig. 2): with ``offload=True`` (default) the sparse layers' whole
KV moves to a host pool after the prompt and their device pages hold only the tokens selected at
the current step, loaded from it (:mod:`.context_bank`); the dense layers stay whole on the
device. The measured (device) CR is then ``t / (min(ceil(t / CR), t - 1) + 1)`` on the sparse
layers' heads and 1 on the dense ones; the host pool's bytes are reported apart
(:meth:`PolicyRunner.host_bytes`), never in the CR. ``offload=False`` is the paper's "OmniKV w/o
offload" (Sec. 5.2): every page resident (memory CR 1), the sparse layers masking the others out;
both attend to the same tokens, so their outputs agree.

Schedule: none applies (nothing is evicted): the selection runs at every decode step (Algorithm
1), the prefill is dense whatever ``schedule`` says; ``rerotate`` must stay off.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from .base import KVPolicy, LayerView, top_mask

SELECTORS = ("exponential", "uniform", "last")
PAPER_FILTER_LAYERS, PAPER_NUM_LAYERS = (2, 8, 18), 32  # Llama-3-8B-262K, Sec. 5


@dataclass(eq=False)
class OmniKV(KVPolicy):
    """Filter layers pick a token subset over their observation window; the later sparse layers
    attend to it (no token dropped).

    Args:
        filter_layers: layer indices that select tokens (default: the paper's, scaled).
        selector: window weights ``alpha`` of Eq. 4: ``"exponential"``, ``"uniform"``, ``"last"``.
        window: observation window ``|w|`` (paper 16; 1 for ``"last"``).
        offload: the sparse layers' KV lives in a host pool, their device pages hold the
            selected tokens only (Sec. 4.1); False: every page resident.
    """

    name = "omnikv"
    evicts = False
    seq_state_names = ("selected", "window_queries", "window_positions")  # positions: -1
    _: KW_ONLY
    filter_layers: tuple[int, ...] | None = None
    selector: str = "exponential"
    window: int = 16
    offload: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.rerotate:
            raise ValueError("rerotate: OmniKV evicts nothing, so no key moves; leave it off")
        filter_layers, selector, window = self.filter_layers, self.selector, self.window
        if filter_layers is not None:
            layers = list(filter_layers)
            if not layers or any(int(x) != x or x < 0 for x in layers):
                raise ValueError(f"filter_layers must be non-negative layer indices, got "
                                 f"{filter_layers!r}")
            filter_layers = tuple(sorted(set(int(x) for x in layers)))
        if selector not in SELECTORS:
            raise ValueError(f"selector must be one of {list(SELECTORS)}, got {selector!r}")
        if int(window) != window or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        if not isinstance(self.offload, bool):
            raise ValueError(f"offload must be True or False, got {self.offload!r}")
        self.filter_layers, self.selector = filter_layers, selector
        self.window = 1 if selector == "last" else int(window)

    def bind(self, shape) -> None:
        super().bind(shape)
        m = shape.num_layers
        if self.filter_layers is None:
            self.filter_layers = tuple(sorted({min(m - 1, round(layer * m / PAPER_NUM_LAYERS))
                                               for layer in PAPER_FILTER_LAYERS}))
        if max(self.filter_layers) >= m:
            raise ValueError(f"filter_layers must be below num_layers={m}, got "
                             f"{self.filter_layers}")
        s, w = shape, self.window
        self.selected = torch.zeros(s.max_seqs, s.max_slots, dtype=torch.bool, device=s.device)
        heads = s.num_kv_heads * s.group
        filters = len(self.filter_layers)
        self.window_queries = torch.zeros(s.max_seqs, filters, heads, w, s.head_dim,
                                          device=s.device)
        self.window_positions = torch.full((s.max_seqs, filters, w), -1, dtype=torch.long,
                                           device=s.device)
        offsets = torch.arange(w, dtype=torch.float32, device=s.device) - w
        self.alpha = torch.exp2(offsets) if self.selector == "exponential" else \
            torch.ones_like(offsets)  # [window], oldest query first

    def reset(self, seq: int) -> None:
        super().reset(seq)
        self.window_positions[seq] = -1

    def sparse(self, layer: int) -> bool:
        """Whether ``layer`` attends to the selected tokens only (Algorithm 1: not before
        ``L_0``, not a filter layer, not right after one)."""
        return (layer > self.filter_layers[0] and layer not in self.filter_layers
                and layer - 1 not in self.filter_layers)

    def observe(self, view: LayerView, queries, q_positions, probs, prefill) -> None:
        """Filter layers keep their last ``window`` queries; at a decode step they select the top
        ``ceil(t / CR)`` of the ``t - 1`` earlier tokens and the current one (``t``: tokens)."""
        if view.layer not in self.filter_layers:
            return
        rows = view.seqs.to(queries.device)
        f, w = self.filter_layers.index(view.layer), self.window
        kept_q = torch.cat([self.window_queries[rows, f], queries], dim=2)[:, :, -w:]
        kept_p = torch.cat([self.window_positions[rows, f], q_positions], dim=1)[:, -w:]
        self.window_queries[rows, f] = kept_q
        self.window_positions[rows, f] = kept_p
        if prefill:
            return
        current = view.positions[:, 0] == (view.tokens - 1)[:, None]
        earlier = view.valid[:, 0] & ~current
        scores = self.context_scores(view, kept_q, kept_p).masked_fill(~earlier, float("-inf"))
        chosen = (top_mask(scores, self.budget(view.tokens)) & earlier) | current
        self.selected[rows] = False
        self.selected[rows, :scores.shape[-1]] = chosen

    def context_scores(self, view: LayerView, queries: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
        """Eq. 4, ``S = sum_j alpha_j max_h A[h, j]``, ``[batch, L]``: ``queries [batch, H, w,
        dim]`` at ``positions [batch, w]`` (``-1``: none yet) attending causally to the view."""
        from .runner import causal_probs

        probs = causal_probs(queries, view, positions, self.shape.scale)  # [b, kv, g, w, L]
        top = probs.flatten(1, 2).amax(dim=1)  # [batch, w, L]: max over the query heads
        return torch.einsum("w,bwl->bl", self.alpha, top)

    def attend(self, layer: int, seqs: torch.Tensor, queries: torch.Tensor, runner):
        """Decode attention of a sparse layer over the selected tokens,
        ``queries [batch, q_heads, dim] -> [batch, q_heads, dim]``, every page resident
        (``offload=False``); None for a dense layer, and under ``offload`` (the device pages hold
        the selected tokens only: the engine's paged attention reads them)."""
        if self.offload or not self.sparse(layer):
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
