"""DMC at inference (Algorithm 1 of the paper, hard decisions): one implementation shared by
``dmc.inference`` (engine and reference kernels) and the Hugging Face export.

Per (sequence, layer, KV head) the cache is a list of slots; the last one is *open*. Token t with
``alpha_t = round(sigmoid(k_t[-1] - c)) = [k_t[-1] - c > 0]`` (``alpha_0 = 0``) either appends a
slot (alpha 0) or merges into the open one (alpha 1) with the running weight ``z`` of Eq. 9;
with a window ``w`` (Sec. 3.3) the open slot is the omega-weighted mean of its last ``w`` tokens.
Keys are accumulated before RoPE and the slot's key is rotated at its newest token's position.

The open slot's state (float32, pre-RoPE) is kept as a *ring* ``[..., rows, dim]``: with a window,
``rows = w`` and token j of the slot sits in row ``j % w`` with its omega; with ``window=None``
one row holds the running mean and its weight ``z``. A prefill chunk is compressed at once: the
open slot's tokens are prepended as pseudo-tokens (:func:`open_slot_prefix`), Eq. 9 runs over
the whole chunk (:func:`dmc.ops.partial_accumulate`), the tokens that end a segment become slots
(:func:`slot_ends`, :func:`pack_slots`), and the open slot's *tail* (its last ``min(count, w)``
tokens, oldest first) is read off (:func:`open_slot_after_chunk`, :func:`ring_from_tail`).

Torch only, relative imports only: the Hugging Face export ships this file next to
``modeling_dmc.py``. Shapes are ``[batch, heads, seq, dim]`` (``...`` = any leading dims).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .accumulate import partial_accumulate
from .decisions import DECISION_CHANNEL, split_decision_channels, zero_decision_channel
from .rope import apply_rope


class HardDecisions(NamedTuple):
    """What :func:`hard_decisions` returns.

    query: ``[batch, q_heads, seq, dim]`` with the decision channel zeroed.
    key: ``[batch, kv_heads, seq, dim]`` with the decision channel zeroed.
    alpha: ``[batch, kv_heads, seq]`` float32 in {0, 1}, 1 = merge into the open slot.
    omega: ``[batch, kv_heads, seq]`` float32 importance.
    """

    query: torch.Tensor
    key: torch.Tensor
    alpha: torch.Tensor
    omega: torch.Tensor


class OpenSlot(NamedTuple):
    """The open slot's merge state of each head (see the module docstring).

    k, v: ``[..., rows, dim]`` pre-RoPE (ring, or tail oldest first, or the running mean),
        float32; a ring may hold a 16-bit model's keys in its dtype (computed on in float32).
    omega: ``[..., rows]`` their omegas (``window=None``: the running weight ``z``).
    count: ``[...]`` long, tokens merged into the open slot.
    """

    k: torch.Tensor
    v: torch.Tensor
    omega: torch.Tensor
    count: torch.Tensor


class PrefixTokens(NamedTuple):
    """Pseudo-tokens standing for the open slot, to prepend to a prefill chunk.

    k, v: ``[..., rows, dim]``; alpha, omega: ``[..., rows]``; count: ``[...]`` tokens in the slot.
    """

    k: torch.Tensor
    v: torch.Tensor
    alpha: torch.Tensor
    omega: torch.Tensor
    count: torch.Tensor


class CompressedChunk(NamedTuple):
    """What :func:`compress_chunk` returns for a chunk of ``n`` tokens.

    keys: ``[batch, kv, n, dim]`` float32, token i's accumulated key rotated at position i (what a
        later query of the chunk sees while i ends a segment); values: same, not rotated.
    counts: ``[batch, kv]`` slots the chunk produces; slot_keys, slot_values:
        ``[batch, kv, max(counts), dim]`` those slots in order (rows past ``counts`` are filler).
    open: the open slot's tail after the chunk (:class:`OpenSlot`, oldest first).
    """

    keys: torch.Tensor
    values: torch.Tensor
    counts: torch.Tensor
    slot_keys: torch.Tensor
    slot_values: torch.Tensor
    open: OpenSlot


class KeyDecision(NamedTuple):
    """Algorithm 1's decision (line 1) still in the key's last channel: ``alpha = [k[..., -1] -
    c > 0]``, the channel zeroed before the key is used (what :func:`hard_decisions` does to
    the key), left to whoever writes the key (the Triton decode write reads it in place)."""

    c: float

    def split(self, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``alpha [...]`` float32 in {0, 1} and ``key [..., dim]`` with the channel zeroed."""
        return ((key[..., DECISION_CHANNEL] - self.c) > 0).float(), zero_decision_channel(key)


def hard_decisions(query: torch.Tensor, key: torch.Tensor, c: float,
                   omega_offset: float = 0.0) -> HardDecisions:
    """Eval-mode decisions (Algorithm 1, lines 1-3): ``alpha = [k[..., -1] - c > 0]`` and
    ``omega = sigmoid(mean over the query group of q[..., -1] + c) + omega_offset``
    (:func:`dmc.ops.split_decision_channels`), both channels zeroed.

    Args:
        query: ``[batch, q_heads, seq, dim]``; key: ``[batch, kv_heads, seq, dim]``.
    """
    channels = split_decision_channels(query, key, c, omega_offset)
    return HardDecisions(channels.query, channels.key, (channels.alpha_logit > 0).float(),
                         channels.omega.float())


def merge_into_open_slot(state: OpenSlot, append: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, omega: torch.Tensor, window: int | None
                         ) -> tuple[OpenSlot, torch.Tensor, torch.Tensor]:
    """One token per head (Algorithm 1, lines 4-12; Eq. 9 with hard alpha): ``append`` opens a
    slot holding the token alone, otherwise the token merges into the open slot.

    Args:
        state: the open slot's ring (:class:`OpenSlot`, ``[batch, kv, rows(, dim)]``).
        append: ``[batch, kv]`` bool.
        k, v: ``[batch, kv, dim]`` pre-RoPE key (decision channel zeroed) and value.
        omega: ``[batch, kv]`` importance > 0.
        window: the merge window ``w``, None for the exact running mean.

    Returns:
        the new ring and the slot's pre-RoPE mean key and value ``[batch, kv, dim]`` float32.
    """
    k, v, omega = k.float(), v.float(), omega.float()
    count = torch.where(append, 0, state.count)
    if window is None:
        z = torch.where(append, 0.0, state.omega[..., 0])
        z_new = z + omega
        mean_k = (z[..., None] * state.k[..., 0, :] + omega[..., None] * k) / z_new[..., None]
        mean_v = (z[..., None] * state.v[..., 0, :] + omega[..., None] * v) / z_new[..., None]
        ring = OpenSlot(mean_k[..., None, :], mean_v[..., None, :], z_new[..., None], count + 1)
        return ring, mean_k, mean_v
    rows = torch.arange(window, device=k.device)
    put = rows == (count % window)[..., None]  # [batch, kv, w]: the row this token takes
    ring_k = torch.where(put[..., None], k[..., None, :], state.k)
    ring_v = torch.where(put[..., None], v[..., None, :], state.v)
    ring_omega = torch.where(put, omega[..., None], state.omega)
    valid = rows < torch.clamp(count + 1, max=window)[..., None]
    weights = torch.where(valid, ring_omega, 0.0)
    total = weights.sum(-1, keepdim=True)
    mean_k = torch.einsum("...w,...wd->...d", weights, ring_k) / total
    mean_v = torch.einsum("...w,...wd->...d", weights, ring_v) / total
    return OpenSlot(ring_k, ring_v, ring_omega, count + 1), mean_k, mean_v


def open_slot_prefix(ring: OpenSlot, window: int | None) -> PrefixTokens:
    """Pseudo-tokens standing for each head's open slot, to prepend to the next prefill chunk so
    that its merges (Eq. 9) equal the full-sequence accumulation.

    Window ``w``: the slot's last ``min(count, w)`` tokens, right-aligned over
    ``max(min(count, w))`` rows; the oldest real row has alpha 0 and cuts off the padding rows
    before it. Exact: one row holding the running mean with weight ``z``. ``ring`` as
    :class:`OpenSlot` ``[..., rows(, dim)]``, every count >= 1.
    """
    count = ring.count.long()
    if window is None:
        return PrefixTokens(ring.k[..., :1, :], ring.v[..., :1, :],
                            torch.zeros_like(ring.omega[..., :1]), ring.omega[..., :1], count)
    given = count.clamp(max=window)
    rows = int(given.max())
    r = torch.arange(rows, device=count.device)
    pad = (rows - given)[..., None]  # leading padding rows
    real = r >= pad
    source = torch.where(real, (count[..., None] - given[..., None] + r - pad) % window, 0)
    index = source[..., None].expand(*source.shape, ring.k.shape[-1])
    k = torch.where(real[..., None], ring.k.gather(-2, index), 0.0)
    v = torch.where(real[..., None], ring.v.gather(-2, index), 0.0)
    omega = torch.where(real, ring.omega.gather(-1, source), 1.0)
    return PrefixTokens(k, v, (r > pad).float(), omega, count)


def empty_prefix(batch: int, heads: int, dim: int, device=None) -> PrefixTokens:
    """No pseudo-token (the first chunk of a sequence): ``[batch, heads, 0(, dim)]``."""
    rows = torch.zeros(batch, heads, 0, device=device)
    return PrefixTokens(rows[..., None].expand(batch, heads, 0, dim),
                        rows[..., None].expand(batch, heads, 0, dim), rows, rows,
                        torch.zeros(batch, heads, dtype=torch.long, device=device))


def slot_ends(alpha: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bool: token j ends a slot of the chunk (token j + 1 appends, or j is last).
    ``alpha [..., n]`` hard decisions."""
    ends = torch.ones_like(alpha, dtype=torch.bool)
    ends[..., :-1] = alpha[..., 1:] <= 0.5
    return ends


def pack_slots(ends: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slots a chunk produces per head, in order: the tokens marked in ``ends [..., n]``.

    ``keys, values [..., n, dim]``. Returns ``counts [...]`` and ``[..., max(counts), dim]`` keys
    and values (rows past a head's count repeat its last token)."""
    n = ends.shape[-1]
    counts = ends.sum(-1)
    position = torch.arange(n, device=ends.device).expand_as(ends)
    most = int(counts.max()) if counts.numel() else 0
    order = torch.where(ends, position, n).sort(dim=-1).values[..., :most].clamp(max=n - 1)
    index = order[..., None].expand(*order.shape, keys.shape[-1])
    return counts, keys.gather(-2, index), values.gather(-2, index)


def open_slot_after_chunk(prefix: PrefixTokens, k: torch.Tensor, v: torch.Tensor,
                          omega: torch.Tensor, alpha: torch.Tensor, k_acc: torch.Tensor,
                          v_acc: torch.Tensor, window: int | None) -> OpenSlot:
    """The open slot's tail after a chunk: with a window, its last ``min(count, w)`` pre-RoPE
    tokens oldest first over ``w`` rows (later rows are filler); exact, the running mean and ``z``.

    Args:
        prefix: the pseudo-tokens prepended to the chunk (:func:`open_slot_prefix`).
        k, v: ``[..., n, dim]`` the chunk's pre-RoPE keys and values; omega, alpha: ``[..., n]``.
        k_acc, v_acc: ``[..., n, dim]`` their accumulation (Eq. 9) after the prefix.
    """
    ext_k, ext_v = torch.cat([prefix.k, k], dim=-2), torch.cat([prefix.v, v], dim=-2)
    ext_omega = torch.cat([prefix.omega, omega], dim=-1)
    n, total = alpha.shape[-1], ext_omega.shape[-1]
    position = torch.arange(n, device=alpha.device).expand_as(alpha)
    last_start = torch.where(alpha <= 0.5, position, -1).max(dim=-1).values
    count = torch.where(last_start >= 0, n - last_start, prefix.count + n)
    if window is None:
        first = torch.where(last_start >= 0, total - n + last_start, 0)
        in_segment = torch.arange(total, device=alpha.device) >= first[..., None]
        z = (ext_omega * in_segment).sum(dim=-1, keepdim=True)
        return OpenSlot(k_acc[..., -1:, :], v_acc[..., -1:, :], z, count)
    given = count.clamp(max=window)
    rows = (total - given)[..., None] + torch.arange(window, device=alpha.device)
    rows = rows.clamp(max=total - 1)
    index = rows[..., None].expand(*rows.shape, k.shape[-1])
    return OpenSlot(ext_k.gather(-2, index), ext_v.gather(-2, index), ext_omega.gather(-1, rows),
                    count)


def ring_from_tail(tail: OpenSlot, rows: int) -> OpenSlot:
    """Places the open slot's last ``min(count, rows)`` tokens (``tail`` oldest first,
    ``[..., >= given(, dim)]``) at their ring rows ``j % rows`` (token j of the slot); rows
    holding no token are 0. ``rows`` is the window, or 1 for the running mean."""
    count = tail.count.long()
    given = torch.clamp(count, max=rows)
    ring = torch.arange(rows, device=count.device)
    source = (ring - (count - given)[..., None]) % rows  # the tail row each ring row takes
    keep = source < given[..., None]
    source = source.clamp(max=tail.k.shape[-2] - 1)
    index = source[..., None].expand(*source.shape, tail.k.shape[-1])
    k = torch.where(keep[..., None], tail.k.float().gather(-2, index), 0.0)
    v = torch.where(keep[..., None], tail.v.float().gather(-2, index), 0.0)
    omega = torch.where(keep, tail.omega.float().gather(-1, source), 0.0)
    return OpenSlot(k, v, omega, count)


def compress_chunk(k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, omega: torch.Tensor,
                   positions: torch.Tensor, inv_freq: torch.Tensor, window: int | None,
                   prefix: PrefixTokens, windowed=None) -> CompressedChunk:
    """Algorithm 1 over a prefill chunk at once (exact under the hard-decision mask, App. H):
    Eq. 9 over the open slot's pseudo-tokens plus the chunk, keys rotated at each token's
    position, the slots the chunk closes, and the open slot's tail.

    Args:
        k, v: ``[batch, kv, n, dim]`` pre-RoPE keys (decision channel zeroed) and values.
        alpha: ``[batch, kv, n]`` hard decisions (0 on a sequence's first token); omega: same.
        positions: ``[n]`` or ``[batch, 1, n]`` RoPE positions; inv_freq ``[dim // 2]``.
        prefix: :func:`open_slot_prefix` of the cache, or :func:`empty_prefix`.
        windowed: Eq. 9's window-grouped kernels (see :func:`partial_accumulate`; None: PyTorch).
    """
    ext = [torch.cat([p, x], dim=-2 if x.dim() == 4 else -1).float()
           for p, x in zip(prefix[:4], (k, v, alpha, omega))]
    k_acc, v_acc = partial_accumulate(*ext, window=window, windowed=windowed)
    skip = prefix.omega.shape[-1]
    k_acc, v_acc = k_acc[..., skip:, :], v_acc[..., skip:, :]
    keys = apply_rope(k_acc, positions, inv_freq)
    counts, slot_keys, slot_values = pack_slots(slot_ends(alpha), keys, v_acc)
    tail = open_slot_after_chunk(prefix, k.float(), v.float(), omega, alpha, k_acc, v_acc,
                                 window)
    return CompressedChunk(keys, v_acc, counts, slot_keys, slot_values, tail)
