"""The KV-write strategy of DMC with delayed merging (``dmc.merge_delay`` = d >= 1; not in the
paper, see :func:`dmc.ops.delayed_merge_bias`) over a
:class:`~dmc.inference.delayed_cache.DelayedMergeCache`.

Decisions and queries are DMC's (:class:`~dmc.inference.kv_write.DMCKV`: eval-mode hard
decisions, the decision channel zeroed before and after RoPE); a decode token goes to the cache's
ring and the token leaving the ring through Algorithm 1 (:meth:`DelayedMergeCache.write`).

Prefill of a chunk of n tokens at positions ``s ..`` (exact, equal to the eval-mode forward):
with ``R = d + 1`` and the ring holding tokens ``s - held .. s - 1`` (``held = min(s, R)``), the
``m = held + n - min(s + n, R)`` oldest tokens of the *window* (ring, then chunk) leave it during
the chunk. Algorithm 1 runs over them, continuing the cached slots (:meth:`DMCKV._compress`: their
accumulated keys and DMC mask). Query ``s + a`` sees Algorithm 1's state after token
``s + a - R``: the cached slots (the open one hidden when the first leaving token merges into
it) and the leaving tokens' accumulated keys up to row ``a - (R - held)`` under the DMC mask
(none for the first ``n - m`` queries, whose merged tokens were all cached or do not exist);
and the raw window tokens ``s + a - d .. s + a``. Then the leaving tokens' slots are packed into
the pages and the last ``min(s + n, R)`` window tokens fill the ring.
"""
from __future__ import annotations

import torch

from dmc.ops import zero_decision_channel
from dmc.ops.mask import bias_from_log_keep
from dmc.ops.rope import apply_rope

from .kv_write import Chunk, DMCKV


class DelayedDMCKV(DMCKV):
    """:class:`DMCKV` with the decode writes and prefill of delayed merging (see the module
    docstring); ``config.merge_delay`` >= 1, the cache a ``DelayedMergeCache``."""

    def static_ready(self, seqs: list[int]) -> bool:
        """A static (captured) decode step needs every sequence's ring full."""
        return self.cache.rings_full(seqs)

    def prefill(self, layer: int, seq: int, query, key, value, start: int) -> torch.Tensor:
        """Exact chunked prefill of ``n`` tokens at positions ``start ..``: ``query [n, heads,
        dim]``, ``key, value [n, kv, dim]``. Returns ``[n, heads, dim]``."""
        cache, n = self.cache, query.shape[0]
        positions = torch.arange(start, start + n, device=query.device)
        decided = self._decide(query.transpose(0, 1)[None], key.transpose(0, 1)[None])
        q_rot = zero_decision_channel(apply_rope(decided.query[0].float(), positions,
                                                 self.inv_freq))
        chunk_k, values = decided.key[0].float(), value.transpose(0, 1).float()
        window_k, window_v, ring_rows = cache.raw_window(
            layer, seq, start, apply_rope(chunk_k, positions, self.inv_freq), values)
        alpha, omega = cache.window_decisions(layer, seq, ring_rows, decided.alpha[0],
                                              decided.omega[0])
        held, kv = ring_rows.numel(), window_k.shape[0]
        window_positions = torch.arange(start - held, start + n, device=query.device)
        leave = held + n - min(start + n, cache.ring_size)
        raw_bias = bias_from_log_keep(torch.full((kv, held + n), float("-inf"),
                                                 device=query.device),
                                      q_len=n, delay=self.config.merge_delay)
        lengths = cache.head_lengths(seq)[layer].long()
        chunk = Chunk(q_rot, window_k, window_v, raw_bias, self._slot_mask(lengths),
                      *([None] * 5))
        if leave:
            # pre-RoPE keys of the leaving tokens: the ring's rotated back, the chunk's as decided
            pre_k = torch.cat([apply_rope(window_k[:, :held], -window_positions[:held],
                                          self.inv_freq), chunk_k], 1)[:, :leave]
            merged = self._compress(layer, seq, pre_k, window_v[:, :leave], alpha[:, :leave],
                                    omega[:, :leave], window_positions[:leave], lengths)
            hidden = torch.full((kv, n - leave, leave), float("-inf"), device=query.device)
            chunk = merged._replace(
                q_rot=q_rot, keys=torch.cat([merged.keys, window_k], 1),
                values=torch.cat([merged.values, window_v], 1),
                bias=torch.cat([torch.cat([hidden, merged.bias], 1), raw_bias], -1))
        context = self._chunk_attention(layer, seq, chunk)
        if leave:
            cache.pack_prefill(layer, seq, chunk.slot_keys, chunk.slot_values, chunk.counts,
                               *chunk.open, overwrite_last=chunk.overwrite)
        rows = cache.keep_window_tail(layer, seq, start + n, window_k, window_v)
        cache.keep_decisions(layer, seq, rows, alpha[:, leave:], omega[:, leave:])
        self.policy.observe(layer, [seq], q_rot[None], positions[None], prefill=True)
        return context.transpose(0, 1)
