"""DMC hyper-parameters and the mutable state that every DMC layer of one model shares."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from dmc.ops import PRIORS

MODES = ("vanilla", "zero_out", "train", "eval")


@dataclass
class DMCConfig:
    """Static DMC settings (defaults: Sec. 4 of the paper and NVIDIA's recipe).

    window: partial-accumulation window w (None = exact scan; 12 in the paper).
    tau: Gumbel-sigmoid temperature. c: decision/importance offset.
    hard: straight-through hard decisions in training, in the attention (mask and accumulation)
        and in the loss (soft relaxation otherwise, as in the paper).
    hard_loss: straight-through hard decisions in the CR loss only, soft ones in the attention:
        NVIDIA's released training code (``hard=False, hard_loss=True``). Off: the paper's
        soft relaxation.
    prior: "global" (Eq. 10: one hinge over all layers) or "local" (App. G: one per layer).
    omega_offset: added to omega = sigmoid(q[..., -1] + c); 2^-7 reproduces NVIDIA's models
        (see :func:`dmc.ops.importance`), 0 is the paper's.
    seed: base seed of the decision noise.
    attention_backend: "auto" (FlexAttention on CUDA, dense on CPU), "dense" or "flex".
    """

    window: int | None = 12
    tau: float = 0.1
    c: float = 5.0
    hard: bool = False
    hard_loss: bool = False
    prior: str = "global"
    omega_offset: float = 0.0
    seed: int = 1234
    attention_backend: str = "auto"

    def __post_init__(self):
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"dmc.window must be null or an integer >= 1, got {self.window!r}")
        if self.tau <= 0:
            raise ValueError(f"dmc.tau must be > 0, got {self.tau!r}")
        if self.attention_backend not in ("auto", "dense", "flex"):
            raise ValueError(
                f"dmc.attention_backend must be one of auto, dense, flex; got "
                f"{self.attention_backend!r}"
            )
        if self.prior not in PRIORS:
            raise ValueError(f"dmc.prior must be one of {', '.join(PRIORS)}; got {self.prior!r}")
        if self.omega_offset < 0:
            raise ValueError(f"dmc.omega_offset must be >= 0, got {self.omega_offset!r}")


@dataclass
class DMCRuntime:
    """Shared by all :class:`~dmc.megatron.attention.DMCSelfAttention` layers of a model.

    mode: "vanilla" (plain attention), "zero_out" (decision channels scaled by
        ``zero_out_scale``), "train" (Gumbel decisions, accumulation, additive mask, CR loss),
        "eval" (hard decisions: what inference with a compressed cache computes).
    target_cr: the CR of the loss (Eq. 10) at the current step.
    zero_out_scale: the factor 1 - t / n_t of the decision channels in ``zero_out`` mode.
    step, microbatch: with ``config.seed`` and the layer number they seed the decision noise,
        so a resumed run draws the same noise (``microbatch`` should be the global micro-batch
        index: ``dp_rank * num_microbatches + i``).
    """

    config: DMCConfig = field(default_factory=DMCConfig)
    mode: str = "vanilla"
    target_cr: float = 1.0
    zero_out_scale: float = 1.0
    step: int = 0
    microbatch: int = 0
    layers: list = field(default_factory=list, repr=False)
    stage_kept: list = field(default_factory=list, repr=False)
    cr_losses: list = field(default_factory=list, repr=False)

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"DMC mode must be one of {MODES}, got {mode!r}")
        self.mode = mode

    def noise_generator(self, layer_number: int, device: torch.device) -> torch.Generator:
        """A generator seeded from (seed, layer, step, micro-batch) alone."""
        key = f"{self.config.seed}:{layer_number}:{self.step}:{self.microbatch}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        return torch.Generator(device=device).manual_seed(seed)

    def pop_cr_losses(self) -> list[torch.Tensor]:
        """Detached CR-loss values attached since the last call: one per forward of the last
        pipeline stage (global prior) or of each layer (local prior); their sum is the loss."""
        losses, self.cr_losses = self.cr_losses, []
        return losses
