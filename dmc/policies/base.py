"""The base class of training-free KV-cache policies and the selection helpers they share.

A policy sees, for one layer and a batch of sequences, a :class:`LayerView` of the paged cache
(keys, values, the original position of every slot) and the attention of the newest queries
(:meth:`KVPolicy.observe`); then, under a budget of slots per head, it picks what each
(sequence, layer, KV head) keeps (:meth:`KVPolicy.select`) and may rewrite the kept slots
(:meth:`KVPolicy.merge`). :class:`~dmc.policies.runner.PolicyRunner` drives it against a
:class:`~dmc.inference.cache.PagedKVCache` and frees the evicted pages.

Budgets follow the DMC paper's accounting: when a policy compresses after ``n`` tokens, a head
keeps at most ``ceil(n / CR)`` slots. When it compresses is its *schedule* (:mod:`.schedule`,
each policy's paper by default): under ``"streaming"`` after every prefill chunk and decode step,
so the measured CR (tokens / kept slots) is the requested one at every token; under
``"prefill"`` once after the prompt, the decode phase then growing (or re-compressing every
``recompress_every`` steps), so the measured CR falls below the requested one as it generates.
Kept keys may be re-rotated to their cache positions after an eviction (``rerotate``,
:mod:`.rerotate`).

Per-slot state (e.g. H2O's accumulated attention) lives in policy-owned tensors
``[max_seqs, num_layers, kv_heads, max_slots]`` named in ``slot_state_names``; the runner moves
them along with the cache on every eviction and zeroes what lies past a head's length.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from functools import cached_property
from typing import ClassVar

import torch

from .schedule import Schedule


@dataclass
class PolicyShape:
    """What a policy needs to know of the model and the cache (given by the runner)."""

    num_layers: int
    num_kv_heads: int
    group: int  # query heads per KV head (GQA)
    head_dim: int
    max_seqs: int
    max_slots: int  # most slots one head may hold
    scale: float  # softmax scale
    inv_freq: torch.Tensor  # RoPE frequencies [head_dim // 2]
    device: torch.device


@dataclass
class LayerView:
    """One layer of the cache for a batch of sequences, as the runner reads it.

    seqs: ``[batch]`` host sequence slots. keys, values: ``[batch, kv_heads, L, head_dim]``
    float32 (post-RoPE keys, as cached), each gathered from the pages by ``read("keys")`` or
    ``read("values")`` when first used (a policy that selects from its own statistics, e.g. H2O,
    TOVA or StreamingLLM, reads no page to select; one that scores the observed attention reads
    the keys, not the values). positions: ``[batch, kv_heads, L]`` original token position
    of each slot, ``-1`` past a head's length. lengths: ``[batch, kv_heads]``. tokens:
    ``[batch]`` tokens the sequence has seen so far (long, on the device).
    """

    layer: int
    seqs: torch.Tensor
    read: Callable[[str], torch.Tensor] = field(repr=False)
    positions: torch.Tensor
    lengths: torch.Tensor
    tokens: torch.Tensor

    @cached_property
    def keys(self) -> torch.Tensor:
        return self.read("keys")

    @cached_property
    def values(self) -> torch.Tensor:
        return self.read("values")

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @property
    def valid(self) -> torch.Tensor:
        return self.positions >= 0

    @property
    def slot_index(self) -> torch.Tensor:
        """``[1, 1, L]`` slot indices."""
        return torch.arange(self.positions.shape[-1], device=self.positions.device)[None, None]


@dataclass(eq=False)
class KVPolicy:
    """Score cached tokens, keep the best ones under a per-head budget, optionally merge.

    Subclasses set ``name`` and implement :meth:`scores` (higher = keep) and, when some slots are
    always kept (recent window, sinks, observation window), :meth:`protected`; they update
    their state in :meth:`observe`. A policy is a ``@dataclass(eq=False)`` subclass whose
    options follow ``_: KW_ONLY`` (so ``get_policy`` sees them as keywords) and are checked in
    ``__post_init__`` after ``super().__post_init__()``; it sets ``paper_schedule`` (and
    ``paper_rerotate``) to what its paper does, citing the section in its docstring, and
    ``needs_prompt_end`` when its selection reads the end of the prompt (an observation window,
    prompt-wide statistics), which ``"streaming"`` with a chunk shorter than the prompt cuts off.

    Args:
        compression_ratio: CR >= 1; a head keeps at most ``ceil(n / CR)`` slots when the policy
            compresses after ``n`` tokens (per-layer policies keep the total over layers).
        schedule: ``"prefill"`` or ``"streaming"`` (:mod:`.schedule`); None: the paper's.
        recompress_every: with ``"prefill"``, re-compress every this many decode steps (None:
            never; with ``schedule=None``, None is the paper's).
        rerotate: after an eviction, re-rotate the kept keys to their cache positions
            (:mod:`.rerotate`); None: the paper's (StreamingLLM only).
    """

    compression_ratio: float = 2.0
    _: KW_ONLY
    schedule: str | None = None
    recompress_every: int | None = None
    rerotate: bool | None = None

    name: ClassVar[str] = ""
    evicts: ClassVar[bool] = True  # False: no token dropped (OmniKV, whose offload frees pages)
    paper_schedule: ClassVar[Schedule] = Schedule("streaming")
    paper_rerotate: ClassVar[bool] = False
    needs_prompt_end: ClassVar[bool] = False  # reads the prompt's end (window, prompt statistics)
    slot_state_names: ClassVar[tuple[str, ...]] = ()
    seq_state_names: ClassVar[tuple[str, ...]] = ()  # [max_seqs, ...] zeroed for a new sequence

    def __post_init__(self):
        ratio = float(self.compression_ratio)
        if not math.isfinite(ratio) or ratio < 1.0:
            raise ValueError(f"compression_ratio must be a finite number >= 1, got "
                             f"{self.compression_ratio!r}")
        self.compression_ratio = ratio
        paper = self.paper_schedule
        if self.schedule is None:
            plan = Schedule(paper.kind, paper.every if self.recompress_every is None
                            else self.recompress_every)
        else:
            plan = Schedule(self.schedule, self.recompress_every)
        self.schedule, self.recompress_every = plan.kind, plan.every
        if self.rerotate is None:
            self.rerotate = self.paper_rerotate
        if not isinstance(self.rerotate, bool):
            raise ValueError(f"rerotate must be True, False or None (the paper's), got "
                             f"{self.rerotate!r}")
        self.shape: PolicyShape | None = None

    @property
    def reads_attention(self) -> bool:
        """Whether :meth:`observe` reads the new queries' attention: a policy that keeps this
        base's :meth:`observe`, which reads nothing (StreamingLLM, Random, KNorm, KeyDiff), is
        handed none, and the runner skips computing it."""
        return type(self).observe is not KVPolicy.observe

    @property
    def merges(self) -> bool:
        """Whether :meth:`merge` may rewrite kept slots (D2O): the runner then calls it for
        each layer that evicts and hands the new contents to the compaction."""
        return type(self).merge is not KVPolicy.merge

    @property
    def plan(self) -> Schedule:
        """The compression schedule (:class:`~dmc.policies.schedule.Schedule`)."""
        return Schedule(self.schedule, self.recompress_every)

    def moving_slots(self) -> int | None:
        """With ``rerotate``: most leading slots of a head that can sit away from their original
        position after an eviction (they keep a float32 copy of their key, see
        :mod:`.rerotate`); None: any slot."""
        return None

    # ----------------------------------------------------------------- lifecycle
    def bind(self, shape: PolicyShape) -> None:
        """Allocate the state for ``shape`` (called once by the runner)."""
        self.shape = shape

    def slot_states(self) -> list[torch.Tensor]:
        """Per-slot state tensors ``[max_seqs, layers, kv_heads, max_slots, ...]``."""
        return [getattr(self, name) for name in self.slot_state_names]

    def seq_states(self) -> list[torch.Tensor]:
        """Per-sequence state tensors ``[max_seqs, ...]``."""
        return [getattr(self, name) for name in self.seq_state_names]

    def reset(self, seq: int) -> None:
        """Forget sequence slot ``seq`` (a new sequence starts there)."""
        for state in self.slot_states() + self.seq_states():
            state[seq] = 0

    def _slot_tensor(self, dtype=torch.float32) -> torch.Tensor:
        s = self.shape
        return torch.zeros(s.max_seqs, s.num_layers, s.num_kv_heads, s.max_slots, dtype=dtype,
                           device=s.device)

    # ----------------------------------------------------------------- budgets
    def budget(self, tokens: torch.Tensor) -> torch.Tensor:
        """``ceil(tokens / CR)`` slots per head, ``tokens [batch]`` -> ``[batch]`` (long)."""
        return torch.ceil(tokens.double() / self.compression_ratio).long().clamp(min=1)

    def budgets(self, view_seqs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Slots per head of every layer, ``[batch, num_layers]``; uniform by default."""
        return self.budget(tokens)[:, None].expand(-1, self.shape.num_layers)

    # ----------------------------------------------------------------- the policy
    def observe(self, view: LayerView, queries: torch.Tensor, q_positions: torch.Tensor,
                probs: torch.Tensor | None, prefill: bool) -> None:
        """Take in the newest queries of ``view.layer``, already written to the cache.

        queries: ``[batch, q_heads, n, head_dim]`` post-RoPE; q_positions: ``[batch, n]``
        (``-1`` = padding); probs: ``[batch, kv_heads, group, n, L]`` their causal attention
        over the cached slots (0 on padding and invalid slots; None for a policy that does not
        override this method, :attr:`reads_attention`); prefill: a prompt chunk (False: one
        decode step)."""

    def scores(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        """Importance of every slot ``[batch, kv_heads, L]`` (higher = keep)."""
        raise NotImplementedError

    def protected(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        """Slots kept whatever their score ``[batch, kv_heads, L]`` (they count in the budget)."""
        return torch.zeros_like(view.valid)

    def select(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        """Keep mask ``[batch, kv_heads, L]``: the protected slots plus the best-scored others,
        ``budget [batch]`` slots per head in all (every slot when a head holds no more)."""
        valid = view.valid
        guard = self.protected(view, budget) & valid
        room = (budget[:, None] - guard.sum(-1)).clamp(min=0)
        candidates = valid & ~guard
        scores = self.scores(view, budget).masked_fill(~candidates, float("-inf"))
        return guard | (top_mask(scores, room) & candidates)

    def merge(self, view: LayerView, keep: torch.Tensor):
        """New ``(keys, values)`` ``[batch, kv_heads, L, head_dim]`` for the kept slots, or
        None (no merge)."""
        return None


class PolicyWrapper(KVPolicy):
    """A policy over another one, ``base``: budgets, state, observation, protected slots, scores
    and merges are the base's; a subclass overrides what it changes (:meth:`scores`,
    :meth:`select`). Subclasses set ``bases`` (accepted names -> classes) and ``default_base``.
    The schedule and ``rerotate`` are the wrapper's (the runner drives the wrapper); by default
    the base's paper's.

    Args:
        base: a name in ``bases``.
        schedule, recompress_every, rerotate: as :class:`KVPolicy`.
        base_kwargs: passed to the base policy (e.g. SnapKV's ``window``).
    """

    bases: ClassVar[dict[str, type[KVPolicy]]] = {}
    default_base: ClassVar[str] = ""

    def __init__(self, compression_ratio: float = 2.0, *, base: str | None = None,
                 schedule: str | None = None, recompress_every: int | None = None,
                 rerotate: bool | None = None, **base_kwargs):
        base = self.default_base if base is None else base
        if base not in self.bases:
            raise ValueError(f"base must be one of {list(self.bases)}, got {base!r}")
        self.base = self.bases[base](compression_ratio, **base_kwargs)
        super().__init__(compression_ratio, schedule=schedule, recompress_every=recompress_every,
                         rerotate=rerotate)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(base={self.base!r}, schedule={self.plan.text!r}, "
                f"rerotate={self.rerotate})")

    @property
    def paper_schedule(self) -> Schedule:
        """The base policy's (a wrapper that changes it says so)."""
        return self.base.paper_schedule

    @property
    def paper_rerotate(self) -> bool:
        return self.base.paper_rerotate

    @property
    def needs_prompt_end(self) -> bool:
        return self.base.needs_prompt_end

    @property
    def reads_attention(self) -> bool:
        return self.base.reads_attention

    @property
    def merges(self) -> bool:
        return self.base.merges

    def bind(self, shape: PolicyShape) -> None:
        super().bind(shape)
        self.base.bind(shape)

    def slot_states(self) -> list[torch.Tensor]:
        return self.base.slot_states()

    def seq_states(self) -> list[torch.Tensor]:
        return self.base.seq_states()

    def reset(self, seq: int) -> None:
        self.base.reset(seq)

    def budgets(self, view_seqs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.base.budgets(view_seqs, tokens)

    def observe(self, view, queries, q_positions, probs, prefill) -> None:
        self.base.observe(view, queries, q_positions, probs, prefill)

    def scores(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        return self.base.scores(view, budget)

    def protected(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        return self.base.protected(view, budget)

    def merge(self, view: LayerView, keep: torch.Tensor):
        return self.base.merge(view, keep)


# ----------------------------------------------------------------------------- helpers
def top_mask(scores: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``[..., L]`` mask of the ``count [...]`` highest scores of each row (ties: lower index
    first)."""
    order = torch.argsort(-scores, dim=-1, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device)
                   .expand_as(order).contiguous())
    return ranks < count[..., None]


def recent_mask(view: LayerView, count: torch.Tensor) -> torch.Tensor:
    """The last ``count [batch]`` slots of every head (slots are in position order)."""
    start = view.lengths.to(view.positions.device) - count[:, None]
    return (view.slot_index >= start[..., None]) & view.valid


def first_mask(view: LayerView, count: torch.Tensor) -> torch.Tensor:
    """The first ``count [batch]`` slots of every head (attention sinks)."""
    return (view.slot_index < count[:, None, None]) & view.valid


def split_budget(total: int, weights, cap: int) -> list[int]:
    """Integers ``b_l <= cap`` summing to ``min(total, cap * len(weights))``, proportional to
    ``weights`` (water-filling for the cap, then largest remainders; ties to lower layers)."""
    weights = [float(w) for w in weights]
    if any(w < 0 for w in weights) or not any(weights):
        raise ValueError(f"split_budget: weights must be >= 0 and not all 0, got {weights}")
    total = min(int(total), cap * len(weights))
    shares = [0.0] * len(weights)
    free = [i for i, w in enumerate(weights) if w > 0]
    left = float(total)
    while free:
        unit = left / sum(weights[i] for i in free)
        capped = [i for i in free if unit * weights[i] >= cap]
        if not capped:
            for i in free:
                shares[i] = unit * weights[i]
            break
        for i in capped:
            shares[i] = float(cap)
            left -= cap
            free.remove(i)
    floors = [min(cap, math.floor(x + 1e-9)) for x in shares]
    missing = total - sum(floors)
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - floors[i]), i))
    for i in [i for i in order if floors[i] < cap][:missing]:
        floors[i] += 1
    return floors


def layer_budgets(per_head: torch.Tensor, tokens: torch.Tensor, weights) -> torch.Tensor:
    """Per-layer budgets ``[batch, layers]`` summing to ``layers * per_head [batch]``, split by
    ``weights [batch][layers]`` (:func:`split_budget`, a layer holding at most ``tokens``); a
    layer left with 0 slots takes 1 from the largest (every layer keeps its newest token)."""
    rows = []
    for b, n, w in zip(per_head.tolist(), tokens.tolist(), weights):
        alloc = split_budget(len(w) * b, w, int(n))
        for i in [i for i, x in enumerate(alloc) if x == 0]:
            alloc[max(range(len(alloc)), key=lambda j: (alloc[j], -j))] -= 1
            alloc[i] = 1
        rows.append(alloc)
    return torch.tensor(rows, dtype=torch.long, device=tokens.device)
