"""How a layer's new keys and values enter the paged cache and how its queries attend to it: one
strategy per kind of cache, so that the model runner never branches on the model's kind.

* :class:`VanillaKV`: one slot per token, keys rotated when written.
* :class:`DMCKV`: Algorithm 1 (:mod:`dmc.ops.algorithm1`): eval-mode decisions from the last
  channel, a decode token appends or merges into the open slot (Eq. 9; decided on the device,
  the host learns the lengths once per step: :meth:`PagedKVCache.settle`), a prefill chunk is
  compressed at once and packed; queries see a slot once closed and the open one.
* ``DMSKV`` (:mod:`dmc.inference.kv_write_dms`): DMS's delayed eviction over a window ring.
* ``DelayedDMCKV`` (:mod:`dmc.inference.kv_write_delayed`): DMC with delayed merging, Algorithm 1
  behind a window ring.

A KV policy (:class:`dmc.policies.PolicyRunner`) or :class:`NoPolicy` observes the written slots,
may replace decode attention and, when its schedule says so, evicts after a forward.

Shapes: queries ``[tokens, heads, dim]``, keys and values ``[tokens, kv_heads, dim]`` as megatron's
QKV split gives them for one batch row; chunk tensors ``[kv_heads, n, dim]``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from dmc.inference.block_allocator import SeqRows
from dmc.inference.paging import default_num_pages, to_device
from dmc.inference.cache import PagedKVCache, merge_ring_dtype
from dmc.inference.kernels import DecisionChannel, resolve_use_triton, run_decode_rope
from dmc.megatron.accumulate_backend import window_kernels
from dmc.megatron.config import DMCConfig
from dmc.ops import zero_decision_channel
from dmc.ops.algorithm1 import (KeyDecision, compress_chunk, empty_prefix, hard_decisions,
                                open_slot_prefix)
from dmc.ops.mask import bias_from_log_keep, log_keep_next
from dmc.ops.rope import apply_rope, rope_tables, rotate


class NoPolicy:
    """The policy hooks of an engine without a KV policy: every slot is kept."""

    compacts_in_forward = False
    evicts_after_chunks = False
    replays_decode = False

    def __init__(self, cache: PagedKVCache):
        self.cache = cache

    def reset(self, seq: int) -> None:
        """Nothing to forget when a sequence starts."""

    def observe(self, layer: int, seq_slots, queries, q_positions, prefill: bool) -> None:
        """Nothing to record."""

    def evict(self, seq_slots, tokens, *, decode: bool, prompt_end: bool = False) -> None:
        """Nothing to evict."""

    def decode_attention(self, layer: int, seq_slots, queries) -> None:
        """No override: decode attention reads the cache."""
        return None

    def state_bytes(self, seq: int) -> int:
        return 0

    def reported_slots(self, seq: int, tokens: int) -> torch.Tensor:
        return self.cache.held_slots(seq)


class DecodeStep(NamedTuple):
    """What the layers of one decode forward share (:meth:`KVWrite.begin_decode`).

    seqs: the sequences, validated once (host and device); positions: ``[batch]`` (device);
    reserved: the slots of vanilla appends, reserved for every layer at once
    (:meth:`PagedKVCache.begin_append`), or None; max_length: a fixed bound of the cached
    lengths that sets the attention's launch size (a captured step), or None (the host lengths);
    cos, sin: the RoPE tables at the positions, ``[batch, 1, dim]``
    (:func:`~dmc.ops.rope.rope_tables`), once :meth:`KVWrite.prepare_rotations` ran.
    """

    seqs: SeqRows
    positions: torch.Tensor
    reserved: tuple | None = None
    max_length: int | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class Chunk(NamedTuple):
    """A prefill chunk ready for attention and packing (``n`` tokens of one sequence).

    q_rot: ``[heads, n, dim]`` rotated queries; keys, values: ``[kv, n, dim]`` what each token's
    slot holds (rotated keys); bias: ``[kv, n, n]`` additive mask among the chunk's tokens;
    visible: ``[kv, cached]`` which cached slots the chunk's queries see; counts ``[kv]`` (host),
    slot_keys, slot_values ``[kv, max(counts), dim]``: the slots to pack; open: the open slot's
    tail (see :meth:`PagedKVCache.pack_prefill`); overwrite: ``[kv]`` bool or None, the first
    slot replaces the head's open one.
    """

    q_rot: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor
    visible: torch.Tensor
    counts: torch.Tensor
    slot_keys: torch.Tensor
    slot_values: torch.Tensor
    open: tuple
    overwrite: torch.Tensor | None


class KVWrite:
    """Shared skeleton: write, attend (policy override or the cache), let the policy observe.

    Args:
        cache: the paged cache; num_heads: query heads; scale: softmax scale;
        inv_freq: ``[dim // 2]`` RoPE frequencies; policy: a ``PolicyRunner`` or :class:`NoPolicy`;
        use_triton: kernel choice (None: Triton on CUDA).
    """

    keeps_merge_state = False  # the cache holds an open-slot merge state per head
    defers_writes = False  # decode writes decided on the device, in a step the cache opens

    def __init__(self, cache: PagedKVCache, num_heads: int, scale: float,
                 inv_freq: torch.Tensor, policy, use_triton: bool | None):
        self.cache, self.num_heads, self.scale = cache, num_heads, scale
        self.group = num_heads // cache.num_kv_heads
        self.inv_freq, self.policy, self.use_triton = inv_freq, policy, use_triton
        self.step: DecodeStep | None = None

    def begin_decode(self, seqs: list[int], positions: torch.Tensor, buffers=None,
                     max_length: int | None = None, overlap: bool = False) -> None:
        """Host work before a decode forward of ``seqs`` at ``positions [batch]`` (device), once
        for all its layers: validate the sequences, and open the cache's step when the writes
        are decided on the device (pages of every layer reserved at once) or reserve the slots
        of vanilla appends (unless the policy compacts within a forward).

        ``buffers`` (the static tensors of a captured step: ``rows [batch]``, ``pages,
        offsets [batch, layers, kv_heads]``) receive the sequence rows and reserved slots, which
        the step then reads from there; ``max_length`` fixes the attention's launch size.
        ``overlap``: the previous decode step of the same sequences is still running, its
        lengths not back yet (:mod:`dmc.inference.overlap`)."""
        def on_device(host: torch.Tensor, name: str) -> torch.Tensor:
            if buffers is None:
                return to_device(host, self.cache.device)
            return getattr(buffers, name).copy_(host, non_blocking=True)

        host = self.cache.allocator.seq_index(seqs)
        rows, reserved = SeqRows(host, on_device(host, "rows")), None
        if self.defers_writes:
            self.cache.begin_decode(rows, static=buffers is not None, overlap=overlap)
        elif not self.policy.compacts_in_forward:
            pages, offsets = self.cache.begin_append(rows)
            reserved = (on_device(pages, "pages"), on_device(offsets, "offsets"))
        self.step = DecodeStep(rows, positions, reserved, max_length)

    def static_ready(self, seqs: list[int]) -> bool:
        """Whether a decode step of ``seqs`` can run through static buffers (a captured step):
        always, unless the cache's step depends on host state (DMS's partly filled rings)."""
        return True

    def prepare_rotations(self) -> None:
        """The RoPE tables of the step's positions, computed once for all its layers (device
        work: part of a captured step)."""
        cos, sin = rope_tables(self.step.positions[:, None], self.inv_freq)
        self.step = self.step._replace(cos=cos, sin=sin)

    def decode(self, layer: int, query, key, value) -> torch.Tensor:
        """One token per sequence of the step :meth:`begin_decode` opened: ``query [batch,
        heads, dim]``, ``key, value [batch, kv, dim]``. Returns ``[batch, heads, dim]``."""
        step = self.step
        q_rot = self.write_token(layer, step, query, key, value)
        context = self.policy.decode_attention(layer, step.seqs.host, q_rot)
        if context is None:
            context = self.cache.attention(layer, step.seqs, q_rot, self.scale,
                                           use_triton=self.use_triton,
                                           max_length=step.max_length)
        self.policy.observe(layer, step.seqs.host, q_rot[:, :, None], step.positions[:, None],
                            prefill=False)
        return context

    def rotate_rows(self, x: torch.Tensor) -> torch.Tensor:
        """RoPE of the step's ``x [batch, heads, dim]`` at its positions, float32: one launch
        on the Triton path (:func:`~dmc.inference.kernels.run_decode_rope`), else
        :func:`~dmc.ops.rope.rotate`."""
        if resolve_use_triton(x.device, self.use_triton):
            return run_decode_rope(x, self.step.cos, self.step.sin)[0]
        return rotate(x.float(), self.step.cos, self.step.sin)

    def prefill(self, layer: int, seq: int, query, key, value, start: int) -> torch.Tensor:
        """Exact chunked prefill of ``n`` tokens of sequence ``seq`` at positions ``start ..``:
        ``query [n, heads, dim]``, ``key, value [n, kv, dim]``. Attends over the cached slots
        plus the chunk, then packs the chunk. Returns ``[n, heads, dim]``."""
        positions = torch.arange(start, start + query.shape[0], device=query.device)
        lengths = self.cache.head_lengths(seq)[layer].long()  # host [kv]
        chunk = self.prepare_chunk(layer, seq, query, key, value, positions, lengths)
        context = self._chunk_attention(layer, seq, chunk)
        self.cache.pack_prefill(layer, seq, chunk.slot_keys, chunk.slot_values, chunk.counts,
                                *chunk.open, overwrite_last=chunk.overwrite)
        self.policy.observe(layer, [seq], chunk.q_rot[None], positions[None], prefill=True)
        return context.transpose(0, 1)

    def write_token(self, layer: int, step: DecodeStep, query, key, value) -> torch.Tensor:
        """Write one token per sequence of ``step``; returns the rotated queries ``[batch,
        heads, dim]``."""
        raise NotImplementedError

    def prepare_chunk(self, layer, seq, query, key, value, positions, lengths) -> Chunk:
        raise NotImplementedError

    def _chunk_attention(self, layer: int, seq: int, chunk: Chunk) -> torch.Tensor:
        """Queries ``[heads, n, dim]`` over the visible cached slots and the chunk's keys (``[kv,
        k, dim]``) under ``chunk.bias`` ``[kv, n, k]``. Returns ``[heads, n, dim]`` float32."""
        (kv, _, dim), n = chunk.keys.shape, chunk.q_rot.shape[1]
        keys, values, bias = chunk.keys, chunk.values, chunk.bias
        cached = chunk.visible.shape[1]
        if cached:
            cached_k, cached_v, _ = self.cache.read(layer, [seq])
            keys = torch.cat([cached_k[0], keys], dim=1)
            values = torch.cat([cached_v[0], values], dim=1)
            cache_bias = torch.zeros(chunk.visible.shape, device=keys.device).masked_fill(
                ~chunk.visible, float("-inf"))
            bias = torch.cat([cache_bias[:, None].expand(kv, n, cached), bias], -1)
        q = chunk.q_rot.reshape(kv, self.group, n, dim)
        scores = torch.einsum("hgnd,hsd->hgns", q, keys) * self.scale + bias[:, None]
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hgns,hsd->hgnd", probs, values).reshape(kv * self.group, n, dim)

    def _slot_mask(self, lengths, hide_last=None) -> torch.Tensor:
        """``[kv, max_len]`` visibility of the cached slots to a chunk's queries: all of a head's
        slots, but its last (open) one when the chunk's first token merges into it."""
        max_len = int(lengths.max()) if lengths.numel() else 0
        slots = torch.arange(max_len)
        visible = slots[None] < lengths[:, None]
        if hide_last is not None:
            visible &= ~((slots[None] == lengths[:, None] - 1) & hide_last[:, None])
        return visible.to(self.cache.device)


class VanillaKV(KVWrite):
    """One slot per token; keys rotated at their position when written."""

    def write_token(self, layer, step, query, key, value):
        if step.reserved is not None and resolve_use_triton(query.device, self.use_triton):
            return self.cache.append_rotating(layer, step.seqs.device, step.reserved, query,
                                              key, value, step.cos, step.sin)  # one launch
        self.cache.append(layer, step.seqs, self.rotate_rows(key), value, step.reserved)
        return self.rotate_rows(query)

    def prepare_chunk(self, layer, seq, query, key, value, positions, lengths):
        heads, n, dim = self.cache.num_kv_heads, query.shape[0], query.shape[-1]
        keys = apply_rope(key.float().transpose(0, 1), positions, self.inv_freq)
        values = value.float().transpose(0, 1)
        rows = torch.zeros(heads, 1, dim, device=keys.device)
        return Chunk(apply_rope(query.float().transpose(0, 1), positions, self.inv_freq), keys,
                     values, bias_from_log_keep(keys.new_zeros(heads, n)),
                     self._slot_mask(lengths), torch.full((heads,), n), keys, values,
                     (rows, rows, rows[..., 0], torch.zeros(heads, dtype=torch.long)), None)


class DMCKV(KVWrite):
    """Algorithm 1 with the eval-mode decisions of ``config`` (``c``, ``omega_offset``,
    ``window``)."""

    keeps_merge_state = True
    defers_writes = True

    def __init__(self, config: DMCConfig, *args):
        super().__init__(*args)
        self.config = config

    def _decide(self, query, key):
        """:func:`hard_decisions` of ``query [batch, heads, n, dim]``, ``key [batch, kv, n,
        dim]``."""
        return hard_decisions(query, key, self.config.c, self.config.omega_offset)

    def write_token(self, layer, step, query, key, value):
        if resolve_use_triton(query.device, self.use_triton):
            # one launch: the write reads the importance from the queries and rotates them
            channel = DecisionChannel(key.shape[1], self.config.c, self.config.omega_offset)
            return self.cache.write(layer, step.seqs, step.positions, key, value, None,
                                    KeyDecision(self.config.c), use_triton=True, defer=True,
                                    query=(query, step.cos, step.sin, channel))
        decided = self._decide(query[:, :, None], key[:, :, None])
        self.cache.write(layer, step.seqs, step.positions, decided.key[:, :, 0], value,
                         decided.omega[..., 0], decided.alpha[..., 0], use_triton=self.use_triton,
                         defer=True)
        return zero_decision_channel(rotate(decided.query[:, :, 0].float(), step.cos, step.sin))

    def prepare_chunk(self, layer, seq, query, key, value, positions, lengths):
        decided = self._decide(query.transpose(0, 1)[None], key.transpose(0, 1)[None])
        q_rot = apply_rope(decided.query[0].float(), positions, self.inv_freq)
        chunk = self._compress(layer, seq, decided.key[0], value.transpose(0, 1),
                               decided.alpha[0], decided.omega[0], positions, lengths)
        return chunk._replace(q_rot=zero_decision_channel(q_rot))

    def _compress(self, layer, seq, key, value, alpha, omega, positions, lengths) -> Chunk:
        """Algorithm 1 over ``m`` tokens at ``positions [m]`` following the cache's slots of
        ``layer`` (``lengths [kv]`` host): pre-RoPE ``key`` and ``value`` ``[kv, m, dim]``,
        decisions ``alpha``, ``omega`` ``[kv, m]`` (alpha of position 0 taken as 0). A
        :class:`Chunk` without queries (``q_rot`` None): the tokens' accumulated keys and their
        DMC mask, the cached slots they leave visible, what to pack."""
        start = int(positions[0])
        alpha = alpha.clone()
        if start == 0:
            alpha[:, 0] = 0
        prefix = (empty_prefix(1, key.shape[0], key.shape[-1], key.device) if start == 0 else
                  open_slot_prefix(self.cache.open_state(layer, [seq]), self.config.window))
        packed = compress_chunk(key[None], value[None], alpha[None], omega[None], positions,
                                self.inv_freq, self.config.window, prefix,
                                window_kernels(self.config.accumulate_backend, key))
        overwrite = (alpha[:, 0] > 0.5) if start else None  # first token merges: open slot
        return Chunk(None, packed.keys[0], packed.values[0],
                     bias_from_log_keep(log_keep_next(alpha)),
                     self._slot_mask(lengths, None if overwrite is None else overwrite.cpu()),
                     packed.counts[0].cpu(), packed.slot_keys[0], packed.slot_values[0],
                     tuple(x[0] for x in packed.open), overwrite)


def make_cache(dmc: DMCConfig | None, num_layers: int, num_kv_heads: int, head_dim: int, *,
               num_pages: int | None, kv_cache_bytes: int | None, page_size: int,
               max_batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device,
               inv_freq: torch.Tensor, model_dtype: torch.dtype = torch.float32) -> PagedKVCache:
    """The cache of a model kind: a :class:`PagedKVCache` (vanilla, GQA, DMC), a
    ``DMSPagedCache`` (``method="dms"``) or a ``DelayedMergeCache`` (``merge_delay``), of
    ``num_pages`` pages or, when None, as many as :func:`default_num_pages` gives for
    ``max_batch`` sequences of ``max_seq_len`` tokens within ``kv_cache_bytes``, which holds
    everything the cache allocates (:func:`~dmc.inference.allocation.cache_allocation`: the
    pages, and per sequence slot the block tables and lengths, DMC's merge state, DMS's and
    delayed merging's rings of raw tokens). A DMC cache with a window keeps its merge ring in
    ``model_dtype`` (the
    dtype of the keys and values the model writes, held exactly; float32 under delayed
    merging, whose ring takes keys rotated back from the cache dtype)."""
    from dmc.inference.allocation import cache_allocation, page_bytes
    from dmc.inference.delayed_cache import DelayedMergeCache
    from dmc.inference.dms_cache import DMSPagedCache

    dms = dmc is not None and dmc.method == "dms"
    delay = dmc.merge_delay if dmc is not None else 0
    window = None if dms or dmc is None else dmc.window
    ring_dtype = merge_ring_dtype(window, delay, model_dtype)
    if num_pages is not None and num_pages < 1:
        raise ValueError(f"num_pages must be >= 1 (or None: as many as kv_cache_bytes holds), "
                         f"got {num_pages}")
    if num_pages is None:
        shape = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     page_size=page_size, window=window, dtype=dtype, max_seq_len=max_seq_len,
                     dms_window=dmc.dms_window if dms else None, merge_delay=delay or None,
                     device=torch.device(device).type, ring_dtype=ring_dtype)
        num_pages = default_num_pages(
            max_batch, max_seq_len, page_size, num_layers * num_kv_heads, page_bytes(**shape),
            kv_cache_bytes, device,
            reserved=cache_allocation(num_pages=0, max_seqs=max_batch, **shape)["total"])
    shape = (num_layers, num_kv_heads, head_dim, num_pages)
    options = dict(page_size=page_size, max_seqs=max_batch, dtype=dtype, device=device,
                   max_seq_len=max_seq_len, inv_freq=inv_freq)
    if dms:
        return DMSPagedCache(*shape, dmc.dms_window, **options)
    if delay:
        return DelayedMergeCache(*shape, delay, window=window, **options)
    return PagedKVCache(*shape, window=window, ring_dtype=ring_dtype, **options)


def make_kv_write(dmc: DMCConfig | None, *args) -> KVWrite:
    """:class:`DMCKV` for a DMC config, ``DelayedDMCKV``
    (:mod:`~dmc.inference.kv_write_delayed`; its cache a ``DelayedMergeCache``) under
    ``merge_delay``, :class:`~dmc.inference.kv_write_dms.DMSKV` for ``method="dms"`` (its cache
    a ``DMSPagedCache``), else :class:`VanillaKV` (arguments of :class:`KVWrite`)."""
    if dmc is not None and dmc.merge_delay:
        from dmc.inference.kv_write_delayed import DelayedDMCKV

        return DelayedDMCKV(dmc, *args)
    if dmc is not None and dmc.method == "dms":
        from dmc.inference.kv_write_dms import DMSKV

        return DMSKV(dmc, *args)
    return VanillaKV(*args) if dmc is None else DMCKV(dmc, *args)


def make_policy(policy, dmc: DMCConfig | None, cache: PagedKVCache, num_heads: int,
                scale: float):
    """The policy hooks of an engine: :class:`NoPolicy` for None, else a
    :class:`dmc.policies.PolicyRunner` driving ``policy`` (vanilla or GQA models only)."""
    if policy is None:
        return NoPolicy(cache)
    if dmc is not None:
        raise ValueError(f"Engine: policy is not supported on a {dmc.method.upper()} model "
                         f"(dmc.method={dmc.method!r}; dmc must be None for a vanilla or GQA "
                         f"model)")
    from dmc.policies import KVPolicy, PolicyRunner

    if not isinstance(policy, KVPolicy):
        raise ValueError(f"Engine: policy must be a dmc.policies.KVPolicy (e.g. "
                         f"dmc.policies.get_policy('h2o', 4)) or None, got {policy!r}")
    return PolicyRunner(policy, cache, num_heads, scale)
