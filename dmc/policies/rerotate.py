"""Re-rotation of kept keys to their cache positions after an eviction (``KVPolicy.rerotate``).

StreamingLLM (Xiao et al., ICLR 2024, Sec. 3.2) gives a cached token the position of its slot IN
THE CACHE, not in the text: after ``n`` tokens a head holding ``L`` slots sees slot ``i`` at
position ``i`` and the next query at ``L``. Keys are cached post-RoPE at their original
positions, and RoPE scores depend on ``query - key`` positions only, so that layout equals one
shifted by ``delta = n - L`` everywhere: queries keep their original positions and slot ``i``
holds its key rotated to ``i + delta``. A token appended since the last eviction sits at its
original position, which is ``i + delta`` already, so between evictions the invariant "slot
``i`` is rotated to ``i + (n - L)``" holds by itself; an eviction changes ``delta`` and the kept
slots before the last contiguous run of tokens move.

Rotating a cached key again and again accumulates the cache dtype's rounding (in bfloat16 the
small angles of the low frequencies round away entirely), so each slot that can move keeps a
float32 copy of its key AT ITS ORIGINAL POSITION, taken when the token is written, and every
move rotates that copy once by ``target - original`` (:func:`dmc.ops.rope.apply_rope`: rotations
compose). The copies cover the first ``width`` slots of each head
(:meth:`KVPolicy.moving_slots`: StreamingLLM's sinks; every slot by default); a slot past them
that has to move is rotated from the cache. A key rewritten by a merge (D2O) gets a new copy,
rotated back from its slot's position to its token's. The copies are policy state
(:meth:`PolicyRunner.state_bytes` counts those of the held slots, ``4 head_dim`` bytes each), and
are allocated for every sequence slot, ``[max_seqs, layers, kv_heads, width, head_dim]`` float32:
with every slot copied that is about the size of a float32 key cache, the price of exact
re-rotation with post-RoPE keys in the cache.
"""
from __future__ import annotations

import torch

from dmc.ops.rope import apply_rope

from .base import LayerView, PolicyShape


class Rerotation:
    """Float32 copies of the keys of the first ``width`` slots per head, and the re-rotation.

    Args:
        shape: the policy's shape (RoPE frequencies, sizes, device).
        width: slots per head with a copy (``<= shape.max_slots``).
    """

    def __init__(self, shape: PolicyShape, width: int):
        self.inv_freq, self.width = shape.inv_freq, width
        self.anchors = torch.zeros(shape.max_seqs, shape.num_layers, shape.num_kv_heads, width,
                                   shape.head_dim, device=shape.device)

    def record(self, view: LayerView, new: torch.Tensor) -> None:
        """Copy the keys of the new slots ``new [batch, kv, L]`` (written at their original
        positions) that fall within ``width``."""
        width = min(self.width, new.shape[-1])
        if width == 0 or not bool(new[..., :width].any()):  # e.g. a decode step past the sinks
            return
        rows = view.seqs.to(view.device)
        held = self.anchors[rows, view.layer, :, :width]
        self.anchors[rows, view.layer, :, :width] = torch.where(
            new[..., :width, None], view.keys[:, :, :width], held)

    def rotate(self, view: LayerView, keep: torch.Tensor, keys: torch.Tensor | None
               ) -> torch.Tensor:
        """New keys ``[batch, kv, m, dim]`` of ``view``'s first ``m`` slots (before they move to
        the front): kept slot ``j``, which becomes slot ``i`` (its rank among the kept), is
        rotated to ``i + n - kept``. ``keys``: a merge's keys at the slots' current positions,
        or None. ``m`` is every slot, or only the ``width`` with a copy when no other kept slot
        changes (each sits at its original position before and after, as StreamingLLM's recent
        window does) and the copied slots keep the first ranks: the others then keep their
        cached keys, and no page is read."""
        slot = view.slot_index
        current = slot + (view.tokens[:, None] - view.lengths.to(slot.device))[..., None]
        kept = keep.sum(-1, keepdim=True)
        target = keep.long().cumsum(-1) - 1 + view.tokens[:, None, None] - kept
        shift = torch.where(keep, target - view.positions, 0)  # from the original position
        width = min(self.width, keep.shape[-1])
        rows = view.seqs.to(view.device)
        anchors = self.anchors[rows, view.layer, :, :width]
        if keys is None and self._copies_suffice(keep, shift, current - view.positions, width):
            self._move(view, keep, anchors, width)
            return apply_rope(anchors, shift[..., :width], self.inv_freq)
        written = view.keys if keys is None else keys
        source = apply_rope(written, view.positions - current, self.inv_freq)  # original position
        if width:
            if keys is not None:
                merged = (keys[:, :, :width] != view.keys[:, :, :width]).any(-1, keepdim=True)
                anchors = torch.where(merged, source[:, :, :width], anchors)
            source = torch.cat([anchors, source[:, :, width:]], dim=2)
            self._move(view, keep, source, width)
        return apply_rope(source, shift, self.inv_freq)

    @staticmethod
    def _copies_suffice(keep: torch.Tensor, shift: torch.Tensor, away: torch.Tensor,
                        width: int) -> bool:
        """Whether the kept slots past ``width`` are neither rotated now (``shift``) nor away
        from their original positions (``away``), and the kept slots below ``width`` take the
        first ranks (no slot past it lands among the copies)."""
        if width >= keep.shape[-1]:
            return False
        past = keep[..., width:]
        still = ~past | ((shift[..., width:] == 0) & (away[..., width:] == 0))
        first = keep[..., :width].sum(-1) == keep.sum(-1).clamp(max=width)
        return bool(still.all() & first.all())

    def _move(self, view: LayerView, keep: torch.Tensor, source: torch.Tensor,
              width: int) -> None:
        """Bring the copies along with their slots (kept slot ``j`` -> its rank ``i``); a slot
        arriving from past ``width`` brings its key at its original position (``source``)."""
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :width]
        moved = source.gather(2, order[..., None].expand(-1, -1, -1, source.shape[-1]))
        lands = torch.arange(width, device=keep.device) < keep.sum(-1, keepdim=True)
        rows = view.seqs.to(view.device)
        self.anchors[rows, view.layer, :, :width] = torch.where(lands[..., None], moved, 0.0)
