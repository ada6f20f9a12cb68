"""Glue between :class:`~dmc.inference.Engine` and a :class:`~dmc.policies.base.KVPolicy`.

The engine calls, for a sequence batch:

* :meth:`PolicyRunner.reset` when a sequence starts (its prefill's first chunk);
* :meth:`PolicyRunner.observe` after each layer wrote its new slots (a prefill chunk's pack, a
  decode step's append), with the post-RoPE queries of the new tokens: the runner records the
  slots' original positions, computes the queries' causal attention over the cached slots on the
  PyTorch path (GQA: ``[batch, kv_heads, group, n, L]``) and hands it to the policy;
* :meth:`PolicyRunner.evict` once all layers of the chunk (step) are done. OmniKV with
  ``offload`` moves its sparse layers' KV to a host pool after the prompt and loads the selected
  tokens at every decode step (:mod:`.context_bank`, driven from these hooks). When the policy's
  schedule (:mod:`.schedule`) says the sequence compresses now, per layer the policy picks what
  each head keeps under its budget (and may merge; with ``rerotate`` the kept keys get their
  cache positions, :mod:`.rerotate`), then the cache moves every layer's kept slots to the front
  at once and frees the pages past them (:meth:`PagedKVCache.compact`), and the per-slot state
  follows.

Evicting after the last layer instead of after each one gives the same result (a layer's cache
is read again only by the next chunk or step) and lets per-layer budgets (PyramidKV, D2O) see
every layer first.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from dmc.inference.cache import PagedKVCache

from .base import KVPolicy, LayerView, PolicyShape
from .context_bank import ContextBank
from .omnikv import OmniKV
from .rerotate import Rerotation


class PolicyRunner:
    """Drives ``policy`` on ``cache`` (vanilla appends, post-RoPE keys, one slot per token).

    Args:
        policy: an unbound :class:`KVPolicy` (a policy serves one runner).
        cache: the paged cache.
        num_heads: query heads (GQA group = ``num_heads // cache.num_kv_heads``).
        scale: softmax scale of the model.
    """

    # A preempted sequence prefills its prompt again and feeds the tokens it generated back one
    # per decode step (``Scheduler(replay=True)``): its evictions, and OmniKV's decode attention
    # and offload, come as before the preemption, not as for a longer prompt.
    replays_decode = True

    def __init__(self, policy: KVPolicy, cache: PagedKVCache, num_heads: int, scale: float):
        if policy.shape is not None:
            raise ValueError(f"{policy!r} already serves an engine; make a new one with "
                             f"dmc.policies.get_policy")
        self.policy, self.cache = policy, cache
        kv = cache.num_kv_heads
        if num_heads % kv:
            raise ValueError(f"{num_heads} query heads do not split into {kv} KV heads")
        max_slots = cache.max_pages_per_head * cache.page_size
        shape = PolicyShape(cache.num_layers, kv, num_heads // kv, cache.head_dim,
                            cache.max_seqs, max_slots, scale, cache.inv_freq, cache.device)
        self.group = shape.group
        self.positions = torch.full((cache.max_seqs, cache.num_layers, kv, max_slots), -1,
                                    dtype=torch.long, device=cache.device)
        self.plan = policy.plan
        self.compressed_at = torch.zeros(cache.max_seqs, dtype=torch.long)  # tokens, host
        self.warned = False
        policy.bind(shape)
        width = policy.moving_slots()
        self.rerotation = (Rerotation(shape, max_slots if width is None else min(width, max_slots))
                           if policy.rerotate else None)
        self.bank = (ContextBank(policy, cache, self.positions)
                     if isinstance(policy, OmniKV) and policy.offload else None)

    @property
    def compacts_in_forward(self) -> bool:
        """OmniKV's context bank compacts layers within a decode forward (:meth:`observe`), so a
        vanilla decode step cannot reserve every layer's next slot before its first layer."""
        return self.bank is not None

    @property
    def evicts_after_chunks(self) -> bool:
        """Whether the policy evicts after every prefill chunk (``"streaming"``): its chunks
        must then be whole, whatever memory the batch holds (:class:`Scheduler`)."""
        return self.policy.evicts and self.plan.kind == "streaming"

    def reset(self, seq: int) -> None:
        self.positions[seq] = -1
        self.compressed_at[seq] = 0
        self.policy.reset(seq)
        if self.bank is not None:
            self.bank.reset(seq)

    def view(self, layer: int, seqs: torch.Tensor, tokens: torch.Tensor,
             lengths: torch.Tensor | None = None) -> LayerView:
        """``layer`` of ``seqs`` (at ``tokens [batch]``; ``lengths``: its host slot counts
        ``[batch, kv_heads]`` if known); its keys and values are read from the pages when a
        policy or the runner first uses them."""
        if lengths is None:
            lengths = self.cache.layer_lengths(layer, seqs)
        longest = int(lengths.max()) if lengths.numel() else 0
        rows = seqs.to(self.cache.device)
        positions = self.positions[rows, layer, :, :longest]
        return LayerView(layer, seqs, lambda part: self.cache.read_part(layer, seqs, part),
                         positions, lengths, tokens.to(self.cache.device))

    # ------------------------------------------------------------------ hooks
    def observe(self, layer: int, seq_slots, queries: torch.Tensor, q_positions: torch.Tensor,
                prefill: bool) -> None:
        """The ``n`` newest slots of every head of ``(seq_slots, layer)`` hold the tokens at
        ``q_positions [batch, n]``; ``queries [batch, q_heads, n, head_dim]`` post-RoPE."""
        seqs = torch.as_tensor(seq_slots, dtype=torch.long).reshape(-1).cpu()
        device = self.cache.device
        q_positions = q_positions.to(device).long()
        n = q_positions.shape[1]
        host_lengths = self.cache.layer_lengths(layer, seqs)  # [batch, kv]
        lengths = host_lengths.to(device)
        rows = seqs.to(device)
        slot = lengths[..., None] - n + torch.arange(n, device=device)  # [batch, kv, n]
        b = torch.arange(len(seqs), device=device)[:, None, None].expand_as(slot)
        h = torch.arange(lengths.shape[1], device=device)[None, :, None].expand_as(slot)
        self.positions[rows[b], layer, h, slot] = q_positions[:, None, :].expand_as(slot)
        view = self.view(layer, seqs, q_positions[:, -1] + 1, host_lengths)
        if self.rerotation is not None:
            new = torch.zeros_like(view.valid)
            new[b, h, slot] = True
            self.rerotation.record(view, new)
        probs = (causal_probs(queries.float(), view, q_positions, self.policy.shape.scale)
                 if self.policy.reads_attention else None)
        self.policy.observe(view, queries.float(), q_positions, probs, prefill)
        if self.bank is not None and not prefill:
            self.bank.step(layer, seqs, view)

    def evict(self, seq_slots, tokens, *, decode: bool, prompt_end: bool = False) -> None:
        """After a decode step (``decode``) or a prefill chunk (ending the prompt or not) of
        ``seq_slots``, at ``tokens [batch]`` tokens: bring every layer of the sequences whose
        schedule compresses now to its budget (OmniKV's offload: after the prompt)."""
        seqs = torch.as_tensor(seq_slots, dtype=torch.long).reshape(-1).cpu()
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).cpu()
        if self.bank is not None and prompt_end:
            self.bank.offload(seqs, tokens)
        if not self.policy.evicts:
            return
        if not (decode or prompt_end):
            self._warn_early_eviction()
        due = torch.tensor([self.plan.due(decode=decode, prompt_end=prompt_end, since=int(since))
                            for since in tokens - self.compressed_at[seqs]], dtype=torch.bool)
        if due.any():
            self.compressed_at[seqs[due]] = tokens[due]
            self._compress(seqs[due], tokens[due])

    def _compress(self, seqs: torch.Tensor, tokens: torch.Tensor) -> None:
        """Per layer, the policy selects what each head keeps (and may merge or re-rotate the
        kept slots); then every layer compacts at once: slots whose contents stay move page to
        page, new contents are written where a layer has them."""
        budgets = self.policy.budgets(seqs, tokens.to(self.cache.device))
        rewrites = self.policy.merges or self.rerotation is not None
        layers = []  # (keep [batch, kv_heads, L], keys, values or None, view) per layer
        for layer in range(self.cache.num_layers):
            view = self.view(layer, seqs, tokens)
            keep = self.policy.select(view, budgets[:, layer].to(self.cache.device))
            keys = values = None
            if rewrites and not bool((keep == view.valid).all()):
                merged = self.policy.merge(view, keep)
                keys, values = merged if merged is not None else (None, None)
                if self.rerotation is not None:
                    keys = self.rerotation.rotate(view, keep, keys)
            layers.append((keep, keys, values, view))
        width = max(keep.shape[-1] for keep, *_ in layers)
        keep = torch.stack([F.pad(k, (0, width - k.shape[-1])) for k, *_ in layers], dim=1)
        keys = _stacked([(keys, view) for _, keys, _, view in layers], "keys")
        values = _stacked([(values, view) for _, _, values, view in layers], "values")
        self.cache.compact(slice(None), seqs, keep, keys, values)
        self._compact_state(slice(None), seqs, keep)

    def _warn_early_eviction(self) -> None:
        """Once: a policy that reads the end of the prompt evicts after a chunk that does not end
        it (``"streaming"`` with a chunk shorter than the prompt)."""
        if self.warned or self.plan.kind != "streaming" or not self.policy.needs_prompt_end:
            return
        self.warned = True
        warnings.warn(f"{type(self.policy).__name__} reads the end of the prompt (its paper "
                      f"compresses once after the whole prompt, schedule='prefill'), but runs "
                      f"with schedule='streaming' and a prefill chunk shorter than the prompt: "
                      f"it evicts before it has seen the end of the prompt", UserWarning,
                      stacklevel=3)

    def decode_attention(self, layer: int, seq_slots, queries: torch.Tensor):
        """Attention override of a decode step (OmniKV's sparse layers), or None."""
        attend = getattr(self.policy, "attend", None)
        if attend is None:
            return None
        seqs = torch.as_tensor(seq_slots, dtype=torch.long).reshape(-1).cpu()
        return attend(layer, seqs, queries, self)

    def state_bytes(self, seq: int) -> int:
        """Bytes of policy state held for sequence slot ``seq``: per kept slot, its original
        position (int64) and the policy's per-slot state; the float32 key copies of the slots
        that may move (``rerotate``); plus the policy's per-sequence state (e.g. SnapKV's
        observation-window queries)."""
        lengths = self.cache.head_lengths(seq).long()
        per_slot = self.positions.element_size() + sum(
            state[0, 0, 0, 0].numel() * state.element_size()
            for state in self.policy.slot_states())
        per_seq = sum(state[seq].numel() * state.element_size()
                      for state in self.policy.seq_states())
        copies = 0
        if self.rerotation is not None:
            anchors = self.rerotation.anchors  # [seqs, layers, kv, width, head_dim]
            held = int(lengths.clamp(max=anchors.shape[3]).sum())
            copies = held * anchors.shape[4] * anchors.element_size()
        return int(lengths.sum()) * per_slot + copies + per_seq

    def host_bytes(self, seq: int) -> int:
        """Bytes held for sequence slot ``seq`` in host memory (OmniKV's offloaded KV, counted
        apart from the device's pages and state)."""
        return 0 if self.bank is None else self.bank.bytes(seq)

    def reported_slots(self, seq: int, tokens: int) -> torch.Tensor:
        """Slots held per (layer, KV head) after ``tokens`` tokens, ``[layers, kv_heads]``: the
        compression is what the device memory holds (OmniKV without offload, which keeps every
        page, reports 1; with offload, its sparse layers hold the selected tokens)."""
        return self.cache.head_lengths(seq).long()

    # ------------------------------------------------------------------ helpers
    def _compact_state(self, layer, seqs: torch.Tensor, keep: torch.Tensor) -> None:
        """Move the positions and the policy's per-slot state like the cache moved the slots
        (``layer`` an index, or a slice of layers with ``keep [batch, layers, kv_heads, n]``)."""
        n = keep.shape[-1]
        rows = seqs.to(self.cache.device)
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)
        kept = torch.arange(n, device=keep.device) < keep.sum(-1, keepdim=True)
        for state, blank in [(self.positions, -1)] + [(s, 0) for s in self.policy.slot_states()]:
            current = state[rows, layer, :, :n]
            extra = (1,) * (current.dim() - keep.dim())
            index = order.reshape(order.shape + extra).expand_as(current)
            moved = current.gather(keep.dim() - 1, index)
            mask = kept.reshape(kept.shape + extra)
            state[rows, layer, :, :n] = torch.where(mask, moved, torch.full_like(moved, blank))


def _stacked(contents, name: str) -> torch.Tensor | None:
    """New ``name`` (keys or values) of every layer's first ``m`` slots ``[batch, layers,
    kv_heads, m, head_dim]`` from ``(given or None, the layer's view)`` per layer, ``m`` the
    most any layer gives: what a layer does not give of them is its cached ones, read from its
    view. None when no layer gives any."""
    given = [new.shape[-2] for new, _ in contents if new is not None]
    if not given:
        return None
    m = max(given)

    def first(new, view):
        if new is not None and new.shape[-2] == m:
            return new
        cached = getattr(view, name)[..., :m, :]
        if new is not None:
            cached = torch.cat([new, cached[..., new.shape[-2]:, :]], dim=-2)
        return F.pad(cached, (0, 0, 0, m - cached.shape[-2]))

    return torch.stack([first(new, view) for new, view in contents], dim=1)


def causal_probs(queries: torch.Tensor, view: LayerView, q_positions: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Softmax attention of ``queries [batch, q_heads, n, dim]`` (at ``q_positions [batch, n]``,
    ``-1`` = none) over the slots of ``view`` that are not later than the query:
    ``[batch, kv_heads, group, n, L]``, zeros where nothing is visible."""
    batch, heads, n, dim = queries.shape
    kv = view.keys.shape[1]
    q = queries.reshape(batch, kv, heads // kv, n, dim)
    logits = torch.einsum("bhgnd,bhld->bhgnl", q, view.keys) * scale
    visible = (view.valid[:, :, None, :] & (view.positions[:, :, None, :]
                                            <= q_positions[:, None, :, None])
               & (q_positions >= 0)[:, None, :, None])  # [batch, kv, n, L]
    logits = logits.masked_fill(~visible[:, :, None], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)
