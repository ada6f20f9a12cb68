"""The mutable state that every DMC layer of one model shares (its static settings:
:class:`dmc.megatron.config.DMCConfig`)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from dmc.megatron.config import DMCConfig
from dmc.ops.decisions import without_decision_channel
from dmc.ops.rope import rotation_tables

MODES = ("vanilla", "zero_out", "train", "eval")


@dataclass
class DMCRuntime:
    """Shared by all :class:`~dmc.megatron.attention.DMCSelfAttention` layers of a model (or
    all :class:`~dmc.megatron.dms_attention.DMSSelfAttention` layers: ``config.method``).

    mode: "vanilla" (plain attention), "zero_out" (decision channels scaled by
        ``zero_out_scale``), "train" (Gumbel decisions, DMC's accumulation or DMS's delayed
        eviction, additive mask, CR loss), "eval" (hard decisions: what inference with a
        compressed cache computes).
    target_cr: the CR of the loss (Eq. 10) at the current step.
    cr_loss_weight: the CR loss's weight in the objective (Eq. 11 has 1).
    zero_out_scale: the factor 1 - t / n_t of the decision channels in ``zero_out`` mode.
    seed, step, microbatch: with the layer number they seed the decision noise,
        so a resumed run draws the same noise (``microbatch`` should be the global micro-batch
        index: ``dp_rank * num_microbatches + i``).
    """

    config: DMCConfig = field(default_factory=DMCConfig)
    mode: str = "vanilla"
    target_cr: float = 1.0
    cr_loss_weight: float = 1.0
    zero_out_scale: float = 1.0
    step: int = 0
    microbatch: int = 0
    seed: int = 1234
    layers: list = field(default_factory=list, repr=False)
    stage_kept: list = field(default_factory=list, repr=False)
    cr_losses: list = field(default_factory=list, repr=False)
    _rope_tables: dict = field(default_factory=dict, repr=False)

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"DMC mode must be one of {MODES}, got {mode!r}")
        self.mode = mode

    def start_step(self, step: int, mode: str, target_cr: float = 1.0,
                   zero_out_scale: float = 1.0) -> None:
        """Sets every per-step field at once: the mode, the step (it seeds the decision noise),
        the CR loss's target and the zero-out scale. ``microbatch`` is set per forward."""
        self.set_mode(mode)
        self.step, self.target_cr, self.zero_out_scale = step, target_cr, zero_out_scale

    def noise_generator(self, layer_number: int, device: torch.device) -> torch.Generator:
        """A generator seeded from (seed, layer, step, micro-batch) alone."""
        key = f"{self.seed}:{layer_number}:{self.step}:{self.microbatch}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        return torch.Generator(device=device).manual_seed(seed)

    def decision_free_tables(self, angles: torch.Tensor,
                             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`dmc.ops.rope.rotation_tables` of megatron's RoPE ``angles [seq, 1, 1,
        head_dim]`` in ``dtype``, without the decision channel
        (:func:`dmc.ops.without_decision_channel`), built once per angles tensor: megatron-core
        computes the angles once per forward for every layer and caches them across forwards
        (an ``lru_cache`` on ``RotaryEmbedding.forward``), so the layers share one pair of
        tables instead of building it each (eight small ops a layer). An entry holds its angles,
        so their ``id`` is not reused while it lives; tables built in inference mode are kept
        apart (autograd cannot save them)."""
        key = (id(angles), dtype, torch.is_inference_mode_enabled())
        entry = self._rope_tables.get(key)
        if entry is None:
            if len(self._rope_tables) >= 8:  # angles of other lengths: megatron's cache is 32
                self._rope_tables.clear()
            entry = self._rope_tables[key] = (
                angles, without_decision_channel(*rotation_tables(angles, dtype)))
        return entry[1]

    def pop_cr_losses(self) -> list[torch.Tensor]:
        """Detached CR-loss values attached since the last call: one per forward of the last
        pipeline stage (global prior) or of each layer (local prior); their sum is the loss."""
        losses, self.cr_losses = self.cr_losses, []
        return losses
