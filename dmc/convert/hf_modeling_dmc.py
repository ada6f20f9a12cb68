"""A Llama model with Dynamic Memory Compression (Nawrot et al., 2024) for Hugging Face
transformers.

Imports torch, transformers and the DMC math of :mod:`dmc.ops.algorithm1` (Algorithm 1, Eq. 9,
RoPE): ``dmc convert mcore-to-hf`` copies this file and those ``dmc/ops`` files into an exported
folder and points ``config.json``'s ``auto_map`` at it, so that
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads the model
(transformers follows the relative imports).

Attention is DMC in eval mode (Algorithm 1 of the paper, hard decisions), the semantics of
``dmc.inference.Engine``:

* decision and importance come from the **last** channel of each head (NVIDIA's convention):
  ``alpha_t = [k_t[-1] - c > 0]`` with ``alpha_0 = 0`` (1 = merge into the open slot) and
  ``omega_t = sigmoid(mean over the query group of q_t[-1] + c) + omega_offset`` floored at
  ``1e-6`` (the offset is 2^-7 for models converted from NVIDIA's release, 0 otherwise); both
  channels are zeroed before and after RoPE;
* a merge makes the open slot the omega-weighted mean of the pre-RoPE keys and values of its last
  ``window`` tokens (Eq. 9, window-grouped; ``window: null`` = the exact running mean);
* a slot's key is rotated at the position of its newest token; a query sees every closed slot and
  the open one;
* with ``dmc_merge_delay`` = d >= 1 (DMC with delayed merging, ``dmc.merge_delay``: not in the
  paper, DMS's delayed eviction carried over to merging, see ``dmc.ops.delayed_merge_bias``), a
  query at position i sees its last d + 1 tokens raw (keys rotated at their own positions) and
  the slots Algorithm 1 leaves after token ``i - d - 1``: a token goes through Algorithm 1 when
  it leaves that raw window, with its own decisions.

Without a cache (or with an empty one) a forward computes all positions at once with the
hard-decision mask (App. H): key ``j < i`` is visible to query ``i`` only if token ``j + 1``
appended. :class:`DMCCache` holds the compressed cache that ``generate()`` uses: per (layer,
sequence, KV head) a variable number of slots, padded to the longest head and masked per head.
Under delayed merging :class:`DelayedCacheLayer` adds a ring of the last d + 1 tokens (pre-RoPE
keys, values, decisions, positions). Left padding is supported (a 2-D ``attention_mask`` of
zeros followed by ones per row). The Llama blocks and the model body are shared with the DMS
export (:mod:`.hf_modeling_common`).
"""
from __future__ import annotations

import torch

from .hf_modeling_common import (CompressedAttention, CompressedCache, CompressedCacheLayer,
                                  CompressedLlamaConfig, CompressedLlamaForCausalLM,
                                  CompressedLlamaModel)

try:  # the exported folder: the dmc/ops files shipped next to modeling_dmc.py
    from .algorithm1 import CompressedChunk, OpenSlot, compress_chunk, empty_prefix, pack_slots
    from .algorithm1 import hard_decisions, merge_into_open_slot, ring_from_tail, slot_ends
    from .decisions import zero_decision_channel
    from .rope import apply_rope
except ImportError:  # imported from the dmc package
    from dmc.ops.algorithm1 import CompressedChunk, OpenSlot, compress_chunk, empty_prefix
    from dmc.ops.algorithm1 import hard_decisions, merge_into_open_slot, pack_slots
    from dmc.ops.algorithm1 import ring_from_tail, slot_ends
    from dmc.ops.decisions import zero_decision_channel
    from dmc.ops.rope import apply_rope


class DMCLlamaConfig(CompressedLlamaConfig):
    """Llama hyper-parameters (:class:`CompressedLlamaConfig`) plus the DMC settings.

    dmc_window: accumulation window w (None = exact running mean). dmc_c: decision offset c.
    dmc_omega_offset: added to omega (2^-7 in NVIDIA's models, 0 in the paper's).
    dmc_channel: which head channel carries the decision/importance logits (only "last").
    dmc_target_cr, dmc_measured_cr: the training target and the CR measured at export (or None).
    dmc_merge_delay: d, the raw tokens a query sees besides itself before they merge (0 = the
    paper's DMC).
    """

    model_type = "dmc_llama"

    def __init__(self, dmc_window=12, dmc_c=5.0, dmc_omega_offset=0.0, dmc_channel="last",
                 dmc_target_cr=None, dmc_measured_cr=None, dmc_merge_delay=0, **kwargs):
        if dmc_channel != "last":
            raise ValueError(f"dmc_channel must be 'last', got {dmc_channel!r}")
        if dmc_window is not None and int(dmc_window) < 1:
            raise ValueError(f"dmc_window must be null or >= 1, got {dmc_window!r}")
        if int(dmc_merge_delay) < 0:
            raise ValueError(f"dmc_merge_delay must be >= 0, got {dmc_merge_delay!r}")
        self.dmc_window = dmc_window
        self.dmc_c = dmc_c
        self.dmc_omega_offset = dmc_omega_offset
        self.dmc_channel = dmc_channel
        self.dmc_target_cr = dmc_target_cr
        self.dmc_measured_cr = dmc_measured_cr
        self.dmc_merge_delay = int(dmc_merge_delay)
        super().__init__(**kwargs)


# ----------------------------------------------------------------------------- cache
class DMCCacheLayer(CompressedCacheLayer):
    """The compressed cache of one layer.

    keys, values: ``[batch, kv_heads, capacity, dim]`` slots (keys rotated, decision channel 0);
    lengths: ``[batch, kv_heads]`` slots per head; open-slot state for Eq. 9: ``ring_k, ring_v
    [batch, kv_heads, rows, dim]`` pre-RoPE (rows = window, or 1 holding the running mean),
    ``ring_omega [batch, kv_heads, rows]`` (the weights, or z), ``count [batch, kv_heads]`` tokens
    merged into the open slot.
    """

    state_names = ("keys", "values", "lengths", "ring_k", "ring_v", "ring_omega", "count")

    def __init__(self, window: int | None):
        super().__init__(window)
        self.ring_k = self.ring_v = self.ring_omega = self.count = None

    @property
    def rows(self) -> int:
        return self.window or 1

    def lazy_initialization(self, key_states, value_states) -> None:
        batch, heads, _, dim = key_states.shape
        device = key_states.device
        self.keys = key_states.new_zeros(batch, heads, 0, dim)
        self.values = value_states.new_zeros(batch, heads, 0, dim)
        self.lengths = torch.zeros(batch, heads, dtype=torch.long, device=device)
        self.ring_k = torch.zeros(batch, heads, self.rows, dim, device=device)
        self.ring_v = torch.zeros_like(self.ring_k)
        self.ring_omega = torch.zeros(batch, heads, self.rows, device=device)
        self.count = torch.zeros(batch, heads, dtype=torch.long, device=device)
        self.is_initialized = True

    def _reserve(self, slots: int) -> None:
        """Grows ``keys``/``values`` to hold ``slots`` slots per head (doubling)."""
        capacity = self.keys.shape[2]
        if slots <= capacity:
            return
        grow = max(slots, 2 * capacity) - capacity
        pad = self.keys.new_zeros(self.keys.shape[:2] + (grow, self.keys.shape[3]))
        self.keys = torch.cat([self.keys, pad], dim=2)
        self.values = torch.cat([self.values, pad.to(self.values.dtype)], dim=2)

    def fill(self, chunk: CompressedChunk, ends: torch.Tensor) -> None:
        """Packs a prefilled batch into an empty layer cache: ``chunk`` from
        :func:`compress_chunk`, ``ends [batch, kv, n]`` the real tokens that close a slot."""
        self.lazy_initialization(chunk.keys[:, :, :0], chunk.values[:, :, :0])
        self.lengths, self.keys, self.values = pack_slots(ends, chunk.keys, chunk.values)
        self.ring_k, self.ring_v, self.ring_omega, self.count = ring_from_tail(chunk.open,
                                                                               self.rows)

    def merge_token(self, k, v, omega, append, positions, inv_freq, active=None):
        """Algorithm 1 for one token per (sequence, KV head): ``k, v [batch, kv, dim]`` pre-RoPE
        (zeroed channel), ``omega [batch, kv]``, ``append [batch, kv]`` bool, ``positions
        [batch]``. Opens a slot or merges into the open one (Eq. 9), then stores the slot's mean
        key rotated at ``positions``. ``active [batch]`` bool (None: every row): a row whose
        token is padding keeps its state (its write lands past its heads' slots)."""
        old = OpenSlot(self.ring_k, self.ring_v, self.ring_omega, self.count)
        ring, mean_k, mean_v = merge_into_open_slot(old, append, k, v, omega, self.window)
        slot = torch.where(append, self.lengths, self.lengths - 1)
        lengths = torch.where(append, self.lengths + 1, self.lengths)
        if active is not None:
            ring = OpenSlot(*(_rows_where(active, new, was) for new, was in zip(ring, old)))
            slot = torch.where(active[:, None], slot, self.lengths)
            lengths = torch.where(active[:, None], lengths, self.lengths)
        self.ring_k, self.ring_v, self.ring_omega, self.count = ring
        self._reserve(int(torch.maximum(lengths, slot + 1).max()))
        self.lengths = lengths
        rotated = apply_rope(mean_k, positions[:, None], inv_freq)[:, :, None]
        index = slot[..., None, None].expand(-1, -1, 1, k.shape[-1])
        self.keys.scatter_(2, index, rotated.to(self.keys.dtype))
        self.values.scatter_(2, index, mean_v[:, :, None].to(self.values.dtype))

    def visible(self, inv_freq):
        """What the next query attends: keys (rotated) and values ``[batch, kv, s, dim]`` float32
        and ``valid [batch, kv, s]`` bool."""
        most = int(self.lengths.max())
        valid = torch.arange(most, device=self.keys.device) < self.lengths[..., None]
        return self.keys[:, :, :most].float(), self.values[:, :, :most].float(), valid

    def held(self) -> torch.Tensor:
        """``[batch, kv_heads]`` slots a query of each head attends."""
        return self.lengths


def _rows_where(rows, new, old):
    """``new`` where ``rows [batch]`` is set, else ``old`` (any shape ``[batch, ...]``)."""
    return torch.where(rows.view(-1, *[1] * (new.dim() - 1)), new, old)


class DelayedCacheLayer(DMCCacheLayer):
    """Under ``dmc_merge_delay`` d: :class:`DMCCacheLayer` (Algorithm 1's slots of the tokens
    that left the raw window) behind a ring of the last ``R = d + 1`` tokens, token t of the
    (padded) batch in row ``t % R``: ``raw_k`` (pre-RoPE, decision channel zeroed) and ``raw_v``
    ``[batch, kv, R, dim]`` float32, their decisions ``raw_alpha``, ``raw_omega`` ``[batch, kv,
    R]``, ``raw_position`` and ``raw_real`` (not padding, row filled) ``[batch, R]``;
    ``written``: tokens of the batch so far."""

    state_names = DMCCacheLayer.state_names + ("raw_k", "raw_v", "raw_alpha", "raw_omega",
                                               "raw_position", "raw_real")

    def __init__(self, window: int | None, delay: int):
        super().__init__(window)
        self.delay, self.written = delay, 0
        self.raw_k = self.raw_v = self.raw_alpha = self.raw_omega = None
        self.raw_position = self.raw_real = None

    def reset(self) -> None:
        self.__init__(self.window, self.delay)

    def fill_delayed(self, chunk, ends, k, v, alpha, omega, positions, real) -> None:
        """Packs a prefilled batch of ``n`` tokens: ``chunk``, ``ends`` as :meth:`fill` for the
        first ``n - R`` tokens (None when none left the window), the last ``min(n, R)`` of
        ``k, v [batch, kv, n, dim]`` (pre-RoPE), ``alpha, omega [batch, kv, n]``, ``positions,
        real [batch, n]`` into the ring."""
        if chunk is None:
            self.lazy_initialization(k[:, :, :0], v[:, :, :0])
        else:
            self.fill(chunk, ends)
        (batch, heads, n, dim), size = k.shape, self.delay + 1
        stay = min(n, size)
        rows = torch.arange(n - stay, n, device=k.device) % size
        self.raw_k = torch.zeros(batch, heads, size, dim, device=k.device)
        self.raw_v = torch.zeros_like(self.raw_k)
        self.raw_alpha = torch.zeros(batch, heads, size, device=k.device)
        self.raw_omega = torch.zeros_like(self.raw_alpha)
        self.raw_position = torch.zeros(batch, size, dtype=torch.long, device=k.device)
        self.raw_real = torch.zeros(batch, size, dtype=torch.bool, device=k.device)
        for ring, x in ((self.raw_k, k), (self.raw_v, v), (self.raw_alpha, alpha),
                        (self.raw_omega, omega)):
            ring[:, :, rows] = x[:, :, n - stay:].float()
        self.raw_position[:, rows] = positions[:, n - stay:]
        self.raw_real[:, rows] = real[:, n - stay:]
        self.written = n

    def push(self, k, v, alpha, omega, positions, inv_freq) -> None:
        """One token per sequence (``k, v [batch, kv, dim]`` pre-RoPE, ``alpha, omega [batch,
        kv]``, ``positions [batch]``) takes the ring row of the token that leaves the window,
        which goes through Algorithm 1 with its own decisions (padding leaves no trace)."""
        row = self.written % (self.delay + 1)
        if self.written > self.delay:
            append = (self.raw_alpha[:, :, row] <= 0.5) | (self.lengths == 0)
            self.merge_token(self.raw_k[:, :, row], self.raw_v[:, :, row],
                             self.raw_omega[:, :, row], append, self.raw_position[:, row],
                             inv_freq, active=self.raw_real[:, row])
        self.raw_k[:, :, row], self.raw_v[:, :, row] = k.float(), v.float()
        self.raw_alpha[:, :, row], self.raw_omega[:, :, row] = alpha.float(), omega.float()
        self.raw_position[:, row], self.raw_real[:, row] = positions, True
        self.written += 1

    def visible(self, inv_freq):
        """:meth:`DMCCacheLayer.visible`'s slots, then the ring's tokens rotated at their
        positions."""
        keys, values, valid = super().visible(inv_freq)
        raw_k = apply_rope(self.raw_k, self.raw_position[:, None], inv_freq)
        heads = keys.shape[1]
        raw_valid = self.raw_real[:, None].expand(-1, heads, -1)
        return (torch.cat([keys, raw_k], 2), torch.cat([values, self.raw_v], 2),
                torch.cat([valid, raw_valid], 2))

    def held(self) -> torch.Tensor:
        return self.lengths + self.raw_real.sum(-1)[:, None]


class DMCCache(CompressedCache):
    """Compressed KV cache of a :class:`DMCLlamaForCausalLM`: one :class:`DMCCacheLayer` per
    layer plus, per sequence, the tokens seen (``seen``) and real (unpadded) tokens seen
    (``next_position [batch]``, the RoPE position of the next token)."""

    def __init__(self, config: DMCLlamaConfig):
        delay = getattr(config, "dmc_merge_delay", 0)
        super().__init__([DelayedCacheLayer(config.dmc_window, delay) if delay else
                          DMCCacheLayer(config.dmc_window)
                          for _ in range(config.num_hidden_layers)])


# ----------------------------------------------------------------------------- modules
class DMCAttention(CompressedAttention):
    """Eval-mode DMC self-attention (see the module docstring)."""

    def __init__(self, config: DMCLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.c = float(config.dmc_c)
        self.omega_offset = float(config.dmc_omega_offset)
        self.window = config.dmc_window
        self.delay = getattr(config, "dmc_merge_delay", 0)

    def forward(self, hidden, positions, real, inv_freq, cache: DMCCacheLayer | None,
                prefill: bool):
        """``hidden [batch, n, hidden]``, ``positions [batch, n]``, ``real [batch, n]`` bool.
        ``prefill``: the cache (if any) is empty and all ``n`` tokens are processed at once;
        otherwise ``n == 1`` and the token goes through ``cache``."""
        batch, n, _ = hidden.shape
        q, k = self._queries(hidden), self._keys(hidden)
        v = self._split(self.v_proj(hidden), self.kv_heads)
        q, k, alpha, omega = hard_decisions(q, k, self.c, self.omega_offset)  # alpha [batch, kv, n]
        q_rot = zero_decision_channel(apply_rope(q, positions[:, None], inv_freq))
        if prefill:
            context = self._prefill(q_rot, k, v, alpha, omega, positions, real, inv_freq, cache)
        elif self.delay:
            cache.push(k[:, :, 0], v[:, :, 0], alpha[..., 0], omega[..., 0], positions[:, 0],
                       inv_freq)
            context = self._attend_cache(q_rot, *cache.visible(inv_freq))
        else:
            append = (alpha[..., 0] <= 0.5) | (cache.lengths == 0)
            cache.merge_token(k[:, :, 0], v[:, :, 0], omega[..., 0], append, positions[:, 0],
                              inv_freq)
            context = self._attend_cache(q_rot, *cache.visible(inv_freq))
        context = context.transpose(1, 2).reshape(batch, n, self.heads * self.head_dim)
        return self.o_proj(context.to(hidden.dtype))

    def _prefill(self, q_rot, k, v, alpha, omega, positions, real, inv_freq, cache):
        """All ``n`` tokens at once: Algorithm 1 over the tokens that left the raw window (all
        of them without a delay), each query over their accumulated keys under the DMC mask and,
        under a delay d, its last d + 1 tokens raw."""
        batch, n = real.shape
        first_real = real.float().argmax(dim=-1)  # left padding: the first real token
        index = torch.arange(n, device=k.device)
        alpha = alpha * (index[None, None] > first_real[:, None, None]).float()
        merged = n - min(n, self.delay + 1) if self.delay else n
        chunk = compress_chunk(
            k[:, :, :merged], v[:, :, :merged], alpha[..., :merged], omega[..., :merged],
            positions[:, None, :merged], inv_freq, self.window,
            empty_prefix(batch, self.kv_heads, self.head_dim, k.device)) if merged else None
        ends = slot_ends(alpha[..., :merged]) & real[:, None, :merged]
        lag = index[:, None] - index[None, :]  # [query i, key j]: i - j
        if self.delay:  # the slots left after token i - d - 1 (its open one), then raw keys
            lag_m = lag[:, :merged]
            accumulated = ((lag_m == self.delay + 1)
                           | ((lag_m > self.delay + 1) & ends[..., None, :]))
            accumulated = accumulated & real[:, None, None, :merged]
            raw = ((lag >= 0) & (lag <= self.delay) & real[:, None, None, :]) | (lag == 0)
            visible = torch.cat([accumulated, raw.expand(-1, self.kv_heads, -1, -1)], -1)
            keys, values = apply_rope(k.float(), positions[:, None], inv_freq), v.float()
            if chunk is not None:
                keys = torch.cat([chunk.keys, keys], 2)
                values = torch.cat([chunk.values, values], 2)
        else:
            visible = (ends[..., None, :] & (lag > 0)) | (lag == 0)
            keys, values = chunk.keys, chunk.values
        scores = torch.einsum("bhgqd,bhkd->bhgqk",
                              q_rot.view(batch, self.kv_heads, self.group, n, -1),
                              keys) * self.scale
        scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
        context = torch.einsum("bhgqk,bhkd->bhgqd", scores.softmax(-1), values)
        if cache is not None and self.delay:
            cache.fill_delayed(chunk, ends, k, v, alpha, omega, positions, real)
        elif cache is not None:
            cache.fill(chunk, ends)
        return context.reshape(q_rot.shape)

    def _attend_cache(self, q_rot, keys, values, valid):
        """One query per sequence over each head's visible entries (:meth:`DMCCacheLayer.visible`):
        ``q_rot [batch, heads, 1, dim]``."""
        batch = q_rot.shape[0]
        q = q_rot.view(batch, self.kv_heads, self.group, -1)
        scores = torch.einsum("bhgd,bhsd->bhgs", q, keys) * self.scale
        scores = scores.masked_fill(~valid[:, :, None], float("-inf"))
        context = torch.einsum("bhgs,bhsd->bhgd", scores.softmax(-1), values)
        return context.reshape(batch, self.heads, 1, -1)


class DMCLlamaModel(CompressedLlamaModel):
    config_class = DMCLlamaConfig
    attention_class = DMCAttention
    cache_class = DMCCache


class DMCLlamaForCausalLM(CompressedLlamaForCausalLM):
    config_class = DMCLlamaConfig
    model_class = DMCLlamaModel
