"""The checkpoints of one training run: where it starts and what it saves when.

Start (:meth:`RunCheckpoints.start`): the run's own latest checkpoint (exact resume: model,
optimizer, LR schedule, RNG, step; config drift checked by :mod:`dmc.training.resume`), else
``checkpoint.init_from`` (another run's checkpoint, same schedule), else the weights of
``checkpoint.load_base``; a ``checkpoint.dir`` changed away from the checkpoints of the run's
earlier launches is refused. Saving (:meth:`RunCheckpoints.after_step`): ``cr_X.Y`` when the
training-mode CR of one step (:meth:`RunCheckpoints._crossed_cr`) first reaches a half-integer,
``step_N`` every ``save_interval`` steps and at the end, and a copy named after each phase when
it ends; older ``step_*`` folders are pruned.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import torch.distributed as dist
import yaml
from megatron.core import parallel_state

from dmc.megatron import checkpoint as ckpt
from dmc.megatron.config import DMCConfig, ModelConfig
from dmc.training.config import ConfigError, RunConfig, to_dict
from dmc.training.logging import save_cr_heatmap
from dmc.training.phases import PhasePlan
from dmc.training.resume import check_init_from, check_resume_config


def cr_summary(cr: np.ndarray, prefix: str = "") -> dict:
    """Measured CR ``[layers, kv_heads]`` (n / kept slots per head) as JSON-ready numbers:
    ``cr`` over the whole model, ``cr_per_layer [layers]`` and ``cr_per_head`` (4 decimals).
    A layer's (the model's) CR is its tokens over its kept slots: the harmonic mean of its
    heads'."""
    return {f"{prefix}cr": float(cr.size / (1 / cr).sum()),
            f"{prefix}cr_per_layer": (cr.shape[1] / (1 / cr).sum(axis=1)).round(4).tolist(),
            f"{prefix}cr_per_head": cr.round(4).tolist()}


class RunCheckpoints:
    """Checkpoints of a ``kind`` run (``pretrain`` or ``retrofit``) of the student ``module``
    with its ``optimizer`` and ``scheduler``, in ``checkpoint.dir`` (default
    ``<run_dir>/checkpoints``)."""

    def __init__(self, cfg: RunConfig, kind: str, plan: PhasePlan, model_config: ModelConfig,
                 module, optimizer, scheduler):
        self.cfg, self.kind, self.plan, self.model_config = cfg, kind, plan, model_config
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.rank = dist.get_rank()
        self.dir = Path(cfg.checkpoint.dir or Path(cfg.run_dir) / "checkpoints")
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ start
    def start(self, allow_config_change: bool) -> tuple[int, str | None]:
        """Loads what the run starts from; returns ``(step, where it continues from)``, the
        latter None for a fresh run (``load_base`` or nothing)."""
        cfg = self.cfg
        latest = ckpt.resumable_checkpoint(self.dir, fallback=cfg.checkpoint.fallback)
        if latest is not None:
            saved = ckpt.read_state(latest)
            if saved["kind"] != self.kind:
                raise ValueError(f"{latest} belongs to a {saved['kind']} run, not {self.kind}")
            check_resume_config(saved.get("config", {}), to_dict(cfg), latest, cfg.run_dir,
                                saved["step"], allow_config_change, write=self.rank == 0,
                                hands_off=self.plan.dmc)
            state = ckpt.load_checkpoint(latest, self.module, self.optimizer, self.scheduler,
                                         contents=False)  # resumable_checkpoint hashed it
            self._complete_phase_folders(state["step"])
            return state["step"], self._describe_resume(latest, state)
        self._check_moved_dir()
        if cfg.checkpoint.init_from:
            init = Path(cfg.checkpoint.init_from)
            check_init_from(init, to_dict(cfg), self.kind)
            state = ckpt.load_checkpoint(init, self.module, self.optimizer, self.scheduler)
            return state["step"], self._describe_resume(init, state)
        if cfg.checkpoint.load_base:  # weights only: a retrofit's base, or a shorter-context stage
            base = Path(cfg.checkpoint.load_base)
            self._check_base_shape(base)
            ckpt.load_checkpoint(base, self.module, optional=("decision_proj",))  # DMS adapter
            self.optimizer.reload_model_params()  # bf16/fp16: the main copies take the weights
        return 0, None

    def _check_moved_dir(self) -> None:
        """Called when this folder holds no checkpoint: raises :class:`ConfigError` naming
        ``checkpoint.dir`` when the run's earlier launch (its ``config.yaml`` in ``run_dir``)
        saved checkpoints (a ``latest``) in another folder, since starting over at step 0 would
        drop the steps and metrics logged since."""
        previous = Path(self.cfg.run_dir) / "config.yaml"
        if not previous.is_file():
            return
        try:
            tree = yaml.safe_load(previous.read_text())
            before = Path(tree["checkpoint"]["dir"] or Path(tree["run_dir"]) / "checkpoints")
        except (yaml.YAMLError, TypeError, KeyError, UnicodeDecodeError):
            return  # not a config this code wrote: nothing to compare with
        if before.resolve() != self.dir.resolve() and (before / ckpt.LATEST).is_file():
            raise ConfigError(
                f"checkpoint.dir: {self.dir} holds no checkpoint, but this run ({previous}) "
                f"saved its checkpoints in {before}; starting over would drop the steps trained "
                f"since. Move them into {self.dir}, set checkpoint.dir back to {before}, or "
                f"start a new run_dir")

    def _describe_resume(self, path: Path, state: dict) -> str:
        """Where the run continues from, and whether the layout changed (dist_checkpointing
        reshards the model and the optimizer state on load)."""
        now = (parallel_state.get_tensor_model_parallel_world_size(),
               parallel_state.get_pipeline_model_parallel_world_size())
        saved = (state.get("tp", now[0]), state.get("pp", now[1]))
        note = f"{path} at step {state['step']}"
        if saved != now:
            note += (f" (written at TP={saved[0]} PP={saved[1]}, resharded to TP={now[0]} "
                     f"PP={now[1]}: model and optimizer state)")
        return note

    def _check_base_shape(self, base: Path):
        """A clear error when ``checkpoint.load_base`` holds another architecture (e.g. a GQA
        conversion with fewer KV heads than the model preset, or a Qwen3 conversion, whose
        head dim ``kv_channels`` and q/k norms ``qk_layernorm`` a Llama preset lacks)."""
        saved = ckpt.read_state(base).get("model_config", {})
        ours = self.model_config.to_dict()
        if "hidden_size" in saved and "num_attention_heads" in saved:
            # fields to_dict leaves out at their defaults; kv_channels compared as head dims
            saved = {"qk_layernorm": False, **saved, "kv_channels": saved.get("kv_channels")
                     or saved["hidden_size"] // saved["num_attention_heads"]}
            ours = {**ours, "qk_layernorm": self.model_config.qk_layernorm,
                    "kv_channels": self.model_config.head_dim}
        wrong = [k for k in ("num_layers", "hidden_size", "num_attention_heads",
                             "num_query_groups", "ffn_hidden_size", "vocab_size",
                             "kv_channels", "qk_layernorm")
                 if k in saved and saved[k] != ours.get(k)]
        if wrong:
            raise ValueError(
                f"checkpoint.load_base {base} does not match the model: "
                + ", ".join(f"model.{k} is {ours[k]} but the checkpoint has {saved[k]}"
                            for k in wrong)
                + "; override them, e.g. " + " ".join(f"model.{k}={saved[k]}" for k in wrong))
        moved = [k for k in ("rotary_base", "rope_scaling_factor")
                 if k in saved and saved[k] != ours[k]]
        if moved:  # intended for a long-context extension (adjusted base frequency), else a slip
            warnings.warn(f"checkpoint.load_base {base}: "
                          + ", ".join(f"model.{k} is {ours[k]} but the checkpoint was trained with "
                                      f"{saved[k]}" for k in moved)
                          + "; positions change meaning (intended when extending the context, "
                          "e.g. Llama 3's larger RoPE base; otherwise set them to the "
                          "checkpoint's)")

    def _complete_phase_folders(self, step: int) -> None:
        """On resume at ``step``: every phase that ended at or before it gets its phase folder,
        copied again from the step checkpoint of its end when a kill interrupted the copy
        (checkpoints are pruned only after the copy, so the source is still there)."""
        if self.rank != 0:
            return
        for phase, (start, end) in self.plan.ranges.items():
            final = self.dir / phase
            if end <= start or end > step or ckpt.is_complete(final):
                continue
            src = self.dir / f"step_{end:07d}"
            if not ckpt.is_complete(src):
                warnings.warn(f"{final} is missing or incomplete and {src}, the checkpoint it "
                              f"is copied from, is gone: the {phase} phase folder cannot be "
                              f"recreated", stacklevel=2)
                continue
            ckpt.copy_checkpoint(src, final)

    # ------------------------------------------------------------------ save
    def dmc_config_for(self, step: int) -> DMCConfig | None:
        """DMC settings of the model saved after ``step`` steps: None until the decision rows
        are zeroed (pretraining, zero_out), since the model then computes vanilla attention."""
        if not self.plan.dmc or step <= self.plan.ranges["retrofit"][0]:
            return None
        return self.cfg.dmc.model_settings()

    def save(self, name: str, step: int, last_cr: np.ndarray | None,
             update_latest: bool = True) -> Path:
        """Writes checkpoint ``name`` of the model after ``step`` steps; ``last_cr``: the CR
        ``[layers, kv_heads]`` measured at the last step (None outside retrofit/solidify)."""
        dmc_config = self.dmc_config_for(step)
        meta = {"kind": self.kind, "step": step, "phase": self.plan.phase_of(max(step - 1, 0)),
                "target_cr": self.plan.target_cr(step - 1) if step else 1.0,
                "measured_cr": cr_summary(last_cr)["cr"] if last_cr is not None else None,
                "config": to_dict(self.cfg), "model_config": self.model_config.to_dict(),
                "dmc_config": dmc_config and dmc_config.to_dict(),
                "tp": parallel_state.get_tensor_model_parallel_world_size(),
                "pp": parallel_state.get_pipeline_model_parallel_world_size()}
        heatmap = None
        if self.plan.dmc and self.cfg.logging.heatmap and last_cr is not None:
            title = f"{self.kind} step {step}: target CR {meta['target_cr']:.2f}"

            def heatmap(folder: Path) -> None:  # written inside the folder before its rename
                save_cr_heatmap(last_cr, folder / "cr_heatmap.png", title)
        return ckpt.save_checkpoint(self.dir, name, self.module, self.optimizer, self.scheduler,
                                    meta, update_latest=update_latest, extras=heatmap)

    def after_step(self, step: int, end: int, last_cr: np.ndarray | None, logger) -> bool:
        """The checkpoints due after step index ``step`` of a run (or phase) ending at ``end``;
        returns whether a regular (resumable) checkpoint was written."""
        done = step + 1
        crossed = self._crossed_cr(step, last_cr) if self.cfg.checkpoint.save_at_cr_crossings \
            else None
        if crossed is not None:
            path = self.save(f"cr_{crossed:.1f}", done, last_cr, update_latest=False)
            logger.write(f"measured CR {crossed:.1f}x reached: {path}")
        interval = self.cfg.checkpoint.save_interval
        phase_done = done in {e for _, e in self.plan.ranges.values()}
        regular = interval and done % interval == 0
        if not (phase_done or regular or done == end):
            return False
        self.save(f"step_{done:07d}", done, last_cr)
        if phase_done and self.rank == 0:
            phase = self.plan.phase_of(step)
            final = ckpt.copy_checkpoint(self.dir / f"step_{done:07d}", self.dir / phase)
            logger.write(f"phase {phase} finished at step {done}: {final}")
        ckpt.prune_checkpoints(self.dir, self.cfg.checkpoint.keep_last + (1 if phase_done else 0))
        return True

    def save_regular(self, step: int, last_cr: np.ndarray | None) -> None:
        """A resumable ``step_N`` checkpoint after ``step`` steps (a stop signal), pruned."""
        self.save(f"step_{step:07d}", step, last_cr)
        ckpt.prune_checkpoints(self.dir, self.cfg.checkpoint.keep_last)

    def _crossed_cr(self, step: int, last_cr: np.ndarray | None) -> float | None:
        """The highest half-integer CR (1.5, 2, 2.5, ...) that the CR measured at ``step``
        reaches and that has no ``cr_*`` checkpoint yet. A ``cr_X`` name thus measures one
        training step (retrofit or solidify, ``last_cr``): the whole model's tokens over its
        kept slots ``sum(1 - alpha)`` on that step's global batch, alpha the decisions as
        trained (Gumbel noise; soft unless ``dmc.hard`` / ``dmc.hard_loss`` round them). It is
        neither the target CR annealed towards nor the CR of evaluation and inference
        (noise-free rounded decisions), which can differ. A replay after a resume finds its
        folder saved."""
        if last_cr is None or self.plan.phase_of(step) not in ("retrofit", "solidify"):
            return None
        half = math.floor(2 * cr_summary(last_cr)["cr"] + 1e-9) / 2
        if half < 1.5 or (self.dir / f"cr_{half:.1f}").is_dir():
            return None
        return half
