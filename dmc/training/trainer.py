"""The training loop on megatron-core alone (no ``megatron.training``).

DDP-wrapped GPTModel, megatron's optimizer and LR scheduler, ``forward_backward_func`` (so
tensor/pipeline/data parallelism come from the config), phases from :mod:`dmc.training.phases`,
atomic distributed checkpoints and exact resume: the data position is a function of the step and
the Gumbel noise is keyed by (seed, layer, step, micro-batch), so a resumed run reproduces the
uninterrupted one. SIGUSR1/SIGTERM end a run cleanly after a checkpoint
(:mod:`dmc.training.preemption`).
"""
from __future__ import annotations

import dataclasses
import math
import time
import warnings
from contextlib import closing, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from dmc.data import build_gpt_dataset, load_meta, load_tokenizer, split_prefix
from dmc.megatron import checkpoint as ckpt
from dmc.megatron.attention import dmc_layers, zero_decision_rows_
from dmc.training.decision_lr import DecisionUpdateScale
from dmc.megatron.compat import cuda_available
from dmc.megatron.config import DMCConfig, ModelConfig
from dmc.megatron.model import build_model
from dmc.megatron.parallel import initialize_parallel
from dmc.megatron.runtime import DMCRuntime
from dmc.training.config import RunConfig, dump_config, to_dict
from dmc.training.logging import RunLogger, save_cr_heatmap
from dmc.training.phases import PhasePlan
from dmc.training.preemption import StopSignal
from dmc.training.resume import check_init_from, check_resume_config


@dataclass
class StepResult:
    step: int
    phase: str
    lm_loss: float
    cr_loss: float
    target_cr: float
    measured_cr: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    extra: dict = field(default_factory=dict)


def cr_summary(cr: np.ndarray, prefix: str = "") -> dict:
    """Measured CR ``[layers, kv_heads]`` (n / kept slots per head) as JSON-ready numbers:
    ``cr`` over the whole model, ``cr_per_layer [layers]`` and ``cr_per_head`` (4 decimals).
    A layer's (the model's) CR is its tokens over its kept slots: the harmonic mean of its heads'."""
    return {f"{prefix}cr": float(cr.size / (1 / cr).sum()),
            f"{prefix}cr_per_layer": (cr.shape[1] / (1 / cr).sum(axis=1)).round(4).tolist(),
            f"{prefix}cr_per_head": cr.round(4).tolist()}


def _precision(cfg: RunConfig) -> torch.dtype:
    if cfg.precision == "auto":
        return torch.bfloat16 if cuda_available() else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.precision]


class Trainer:
    """One pretrain or retrofit run in ``cfg.run_dir``; call :meth:`run`."""

    def __init__(self, cfg: RunConfig, kind: str, allow_config_change: bool = False):
        self.cfg, self.kind = cfg, kind
        self.allow_config_change = allow_config_change
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)  # unwritable: fail before megatron
        initialize_parallel(cfg.parallel.tensor, cfg.parallel.pipeline, seed=cfg.seed)
        self.rank = dist.get_rank()
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = Path(cfg.checkpoint.dir or self.run_dir / "checkpoints")
        if self.rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.plan = PhasePlan(cfg, kind)
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        per_step = cfg.data.micro_batch_size * self.dp_size
        if cfg.data.global_batch_size % per_step:
            raise ValueError(
                f"data.global_batch_size ({cfg.data.global_batch_size}) must be a multiple of "
                f"micro_batch_size x data-parallel size ({per_step})"
            )
        self.num_micro = cfg.data.global_batch_size // per_step
        self._build_data()
        self._build_model()
        self.step = 0
        self.last_cr = None  # [layers, kv_heads] CR measured at the last retrofit/solidify step
        self._resume_or_load_base()
        if self.rank == 0:
            (self.run_dir / "config.yaml").write_text(dump_config(cfg))

    # ------------------------------------------------------------------ set-up
    def _build_data(self):
        cfg = self.cfg
        meta = load_meta(cfg.data.path)
        self.tokenizer = load_tokenizer(Path(cfg.data.path) / meta["tokenizer"]["path"])
        self.vocab_size = cfg.model.vocab_size or meta["vocab_size"]
        if self.vocab_size < meta["vocab_size"]:
            raise ValueError(
                f"model.vocab_size ({self.vocab_size}) is smaller than the tokenizer's "
                f"({meta['vocab_size']})"
            )
        seq = cfg.data.seq_length
        total = max(self.plan.total_steps, 1) * cfg.data.global_batch_size
        self.train_data = build_gpt_dataset(split_prefix(cfg.data.path, "train"), seq, total,
                                            cfg.seed, self.tokenizer, cfg.data.cache_dir)
        eval_samples = max(cfg.logging.eval_iters, 1) * cfg.data.micro_batch_size * self.dp_size
        self.valid_data = build_gpt_dataset(split_prefix(cfg.data.path, "valid"), seq,
                                            eval_samples, cfg.seed, self.tokenizer,
                                            cfg.data.cache_dir)

    def _build_model(self):
        cfg = self.cfg
        dtype = _precision(cfg)
        self.runtime = DMCRuntime(cfg.dmc.model_settings(), seed=cfg.seed,
                                  cr_loss_weight=cfg.dmc.cr_loss_weight)
        module = build_model(self.model_config(), self.runtime, params_dtype=dtype)
        self.tconfig = module.config
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                   overlap_grad_reduce=False,
                                                   use_distributed_optimizer=False)
        self.model = DistributedDataParallel(self.tconfig, ddp_config, module)
        self.module = module
        o = cfg.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.lr * o.min_lr_ratio,
                            weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
                            bf16=dtype == torch.bfloat16, params_dtype=dtype,
                            use_distributed_optimizer=False),
            [self.model],
        )
        self.scheduler = self._lr_scheduler()
        self.decision_scale = DecisionUpdateScale(module, o.decision_lr_mult)
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        self.tconfig.no_sync_func = self.model.no_sync

    def _lr_scheduler(self) -> OptimizerParamScheduler:
        """pretrain: warmup + cosine to min; retrofit: constant, cosine during solidify."""
        o, total = self.cfg.optim, max(self.plan.total_steps, 1)
        common = dict(init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr,
                      min_lr=o.lr * o.min_lr_ratio, lr_warmup_steps=min(o.warmup_steps, total - 1),
                      lr_decay_steps=total, start_wd=o.weight_decay, end_wd=o.weight_decay,
                      wd_incr_steps=total, wd_incr_style="constant")
        if self.kind == "pretrain":
            return OptimizerParamScheduler(self.optimizer, lr_decay_style="cosine", **common)
        solidify = self.cfg.schedule.solidify_steps
        if solidify == 0:
            return OptimizerParamScheduler(self.optimizer, lr_decay_style="constant", **common)
        return OptimizerParamScheduler(self.optimizer, lr_decay_style="WSD",
                                       wsd_decay_steps=solidify, lr_wsd_decay_style="cosine",
                                       **common)

    def _resume_or_load_base(self):
        latest = ckpt.resumable_checkpoint(self.ckpt_dir, fallback=self.cfg.checkpoint.fallback)
        if latest is not None:
            saved = ckpt.read_state(latest)
            if saved["kind"] != self.kind:
                raise ValueError(f"{latest} belongs to a {saved['kind']} run, not {self.kind}")
            check_resume_config(saved.get("config", {}), to_dict(self.cfg), latest,
                                self.run_dir, saved["step"], self.allow_config_change,
                                write=self.rank == 0)
            state = ckpt.load_checkpoint(latest, self.module, self.optimizer, self.scheduler)
            self.step = state["step"]
            self.resumed_from = self._describe_resume(latest, state)
            self._complete_phase_folders()
            return
        self.resumed_from = None
        init = self.cfg.checkpoint.init_from
        if init:
            check_init_from(Path(init), to_dict(self.cfg), self.kind)
            state = ckpt.load_checkpoint(Path(init), self.module, self.optimizer, self.scheduler)
            self.step = state["step"]
            self.resumed_from = self._describe_resume(Path(init), state)
            return
        base = self.cfg.checkpoint.load_base
        if base:  # weights only: e.g. a retrofit's base, or a pretraining stage at a longer context
            self._check_base_shape(Path(base))
            ckpt.load_checkpoint(Path(base), self.module)

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
        conversion with fewer KV heads than the model preset)."""
        saved = ckpt.read_state(base).get("model_config", {})
        ours = self.model_config().to_dict()
        wrong = [k for k in ("num_layers", "hidden_size", "num_attention_heads",
                             "num_query_groups", "ffn_hidden_size", "vocab_size")
                 if k in saved and saved[k] != ours[k]]
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
                          "e.g. Llama 3's larger RoPE base; otherwise set them to the checkpoint's)")

    # ------------------------------------------------------------------ data
    def _microbatch(self, dataset, index: int) -> dict:
        mbs = self.cfg.data.micro_batch_size
        samples = [dataset[(index + j) % len(dataset)] for j in range(mbs)]
        batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in
                 ("tokens", "labels", "loss_mask", "position_ids")}
        if cuda_available():
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        return batch

    def _train_microbatches(self, step: int):
        mbs, gbs = self.cfg.data.micro_batch_size, self.cfg.data.global_batch_size
        first = step * gbs + self.dp_rank * self.num_micro * mbs
        return [self._microbatch(self.train_data, first + i * mbs) for i in range(self.num_micro)]

    # ------------------------------------------------------------------ steps
    def _forward_backward(self, batches, forward_only: bool) -> list[dict]:
        runtime = self.runtime
        data, micro = iter(batches), iter(range(len(batches)))

        def forward_step(_, model):
            runtime.microbatch = self.dp_rank * len(batches) + next(micro)
            b = next(data)
            output = model(b["tokens"], b["position_ids"], None, labels=b["labels"])

            def loss_func(per_token):
                mask = b["loss_mask"].float()
                loss = (per_token.float() * mask).sum() / mask.sum().clamp_min(1)
                return loss, {"lm_loss": loss.detach().clone()}  # the schedule divides loss in place

            return output, loss_func

        MoEAuxLossAutoScaler.set_loss_scale(
            torch.tensor(1.0 / len(batches), device="cuda" if cuda_available() else "cpu"))
        seq = self.cfg.data.seq_length
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=None, model=[self.model],
            num_microbatches=len(batches), seq_length=seq,
            micro_batch_size=self.cfg.data.micro_batch_size, forward_only=forward_only,
        )

    def _reduce_mean(self, values: list[float], on_last_stage: bool) -> float:
        """Mean over micro-batches and DP ranks of a value known on the last pipeline stage."""
        local = torch.tensor([sum(values), len(values) if on_last_stage else 0],
                             dtype=torch.float64)
        if cuda_available():
            local = local.cuda()
        dist.all_reduce(local)
        return (local[0] / local[1].clamp_min(1)).item()

    def _cr_loss(self) -> float:
        """CR loss of this step summed over pipeline stages, averaged over micro-batches."""
        losses = self.runtime.pop_cr_losses()
        total = torch.tensor([sum(l.item() for l in losses) / max(self.num_micro, 1)],
                             dtype=torch.float64)
        if cuda_available():
            total = total.cuda()
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        return total.item() / self.dp_size

    def measured_cr(self) -> np.ndarray:
        """``[layers, kv_heads]`` CR measured since the last reset, gathered over TP/PP/DP."""
        layers, heads = self.cfg.model.num_layers, self.tconfig.num_query_groups
        kept = torch.zeros(layers, heads, dtype=torch.float64)
        count = torch.zeros(layers, heads, dtype=torch.float64)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        for layer in dmc_layers(self.module):
            n = layer.cr_kept.numel()
            kept[layer.layer_number - 1, tp_rank * n:(tp_rank + 1) * n] = layer.cr_kept.cpu()
            count[layer.layer_number - 1, tp_rank * n:(tp_rank + 1) * n] = layer.cr_count.cpu()
        if cuda_available():
            kept, count = kept.cuda(), count.cuda()
        for group in (parallel_state.get_model_parallel_group(),
                      parallel_state.get_data_parallel_group()):  # DP ranks saw other samples
            dist.all_reduce(kept, group=group)
            dist.all_reduce(count, group=group)
        return (count / kept.clamp_min(1e-12)).cpu().numpy()

    def _reset_cr_stats(self):
        for layer in dmc_layers(self.module):
            layer.reset_cr_stats()

    def train_step(self, step: int) -> StepResult:
        plan = self.plan.at(step)
        self.runtime.start_step(step, plan.mode, plan.target_cr, plan.zero_out_scale)
        self._reset_cr_stats()
        start = time.perf_counter()
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        results = self._forward_backward(self._train_microbatches(step), forward_only=False)
        with self.decision_scale.around_step(enabled=plan.mode == "train"):
            success, grad_norm, _ = self.optimizer.step()
        if not success:
            raise FloatingPointError(f"optimizer step {step} was skipped (non-finite gradients)")
        self.scheduler.step(1)
        elapsed = time.perf_counter() - start
        lm = self._reduce_mean([r["lm_loss"].item() for r in results],
                               parallel_state.is_pipeline_last_stage())
        measured = 1.0
        if plan.mode == "train":
            measured = cr_summary(self.measured_cr())["cr"]
        tokens = self.cfg.data.global_batch_size * self.cfg.data.seq_length
        return StepResult(
            step=step, phase=plan.phase, lm_loss=lm, cr_loss=self._cr_loss(),
            target_cr=plan.target_cr, measured_cr=measured,
            lr=self.optimizer.param_groups[0]["lr"], grad_norm=float(grad_norm or 0.0),
            tokens_per_s=tokens / elapsed,
        )

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out LM loss and perplexity in eval mode (hard decisions) and the measured CR."""
        runtime = self.runtime
        previous = runtime.mode
        runtime.set_mode("eval" if self.plan.dmc else "vanilla")
        self._reset_cr_stats()
        self.model.eval()
        mbs, iters = self.cfg.data.micro_batch_size, max(self.cfg.logging.eval_iters, 1)
        first = self.dp_rank * iters * mbs
        batches = [self._microbatch(self.valid_data, first + i * mbs) for i in range(iters)]
        results = self._forward_backward(batches, forward_only=True)
        loss = self._reduce_mean([r["lm_loss"].item() for r in results],
                                 parallel_state.is_pipeline_last_stage())
        out = {"valid_loss": loss, "valid_ppl": math.exp(min(loss, 50.0))}
        if self.plan.dmc:
            out.update(cr_summary(self.measured_cr(), prefix="valid_"))
        runtime.set_mode(previous)
        self.model.train()
        return out

    # ------------------------------------------------------------------ checkpoints
    def model_config(self) -> ModelConfig:
        """The architecture of the model (the run's ``model`` section, the vocabulary size and
        the query groups resolved)."""
        m = self.cfg.model
        return dataclasses.replace(m, vocab_size=self.vocab_size, num_query_groups=m.kv_heads)

    def dmc_config_for(self, step: int) -> DMCConfig | None:
        """DMC settings of the model saved after ``step`` steps: None until the decision rows
        are zeroed (pretraining, zero_out), since the model then computes vanilla attention."""
        if not self.plan.dmc or step <= self.plan.ranges["retrofit"][0]:
            return None
        return self.cfg.dmc.model_settings()

    def save(self, name: str, step: int, update_latest: bool = True) -> Path:
        dmc_config = self.dmc_config_for(step)
        meta = {"kind": self.kind, "step": step, "phase": self.plan.phase_of(max(step - 1, 0)),
                "target_cr": self.plan.target_cr(step - 1) if step else 1.0,
                "measured_cr": (cr_summary(self.last_cr)["cr"]
                                if self.last_cr is not None else None),
                "config": to_dict(self.cfg), "model_config": self.model_config().to_dict(),
                "dmc_config": dmc_config and dmc_config.to_dict(),
                "tp": parallel_state.get_tensor_model_parallel_world_size(),
                "pp": parallel_state.get_pipeline_model_parallel_world_size()}
        path = ckpt.save_checkpoint(self.ckpt_dir, name, self.module, self.optimizer,
                                    self.scheduler, meta, update_latest=update_latest)
        if self.plan.dmc and self.cfg.logging.heatmap and self.rank == 0:
            cr = self.last_cr if self.last_cr is not None else None
            if cr is not None:
                save_cr_heatmap(cr, path / "cr_heatmap.png",
                                f"{self.kind} step {step}: target CR {meta['target_cr']:.2f}")
        return path

    # ------------------------------------------------------------------ main loop
    def run(self, phase: str | None = None, stop_after: int | None = None,
            stop: StopSignal | None = None) -> list[StepResult]:
        """Trains to the end of the run (or of ``phase``); ``stop_after`` ends early after
        that many steps, as a kill would (tests). ``stop``: a :class:`StopSignal` already
        installed by the caller (the CLI installs one before start-up, so a signal that arrives
        while the model is built stops the run before its first step); by default one is
        installed for the loop. Returns the steps it ran."""
        end = self.plan.total_steps if phase is None else self.plan.phase_end(phase)
        if phase is not None and self.step < self.plan.ranges[phase][0]:
            raise ValueError(
                f"phase {phase} starts at step {self.plan.ranges[phase][0]} but the run is at "
                f"step {self.step}: run the earlier phases first"
            )
        logger = RunLogger(self.run_dir, self.plan.total_steps, self.step, self.cfg,
                           enabled=self.rank == 0)
        if self.resumed_from is not None:
            logger.write(f"resumed from {self.resumed_from}")
        self.last_cr = None
        self.preempted = None
        ran: list[StepResult] = []
        log_cfg, ckpt_cfg = self.cfg.logging, self.cfg.checkpoint
        signals = nullcontext(stop) if stop is not None else StopSignal()
        with signals as stop, closing(logger):
            if self.step < end and stop.requested():  # arrived during start-up: nothing to save
                self.preempted = stop.received or "a stop signal on another rank"
                logger.write(f"{self.preempted} received during start-up: stopping at step "
                             f"{self.step}, nothing new to save")
            while self.step < end and self.preempted is None:
                step = self.step
                if self.plan.dmc and step == self.plan.ranges["retrofit"][0] and step > 0:
                    zero_decision_rows_(self.module)
                result = self.train_step(step)
                self.step = step + 1
                ran.append(result)
                if self.plan.dmc and result.phase in ("retrofit", "solidify"):
                    self.last_cr = self.measured_cr()
                record = {k: v for k, v in vars(result).items() if k != "extra"}
                evaluated = bool(log_cfg.eval_interval) and self.step % log_cfg.eval_interval == 0
                if evaluated:
                    record.update(self.evaluate())
                if evaluated or self.step % log_cfg.log_interval == 0 or self.step == end:
                    logger.log(record)
                logger.progress(self.step, {
                    "phase": result.phase, "loss": f"{result.lm_loss:.3f}",
                    "cr": f"{result.measured_cr:.2f}/{result.target_cr:.2f}",
                    "lr": f"{result.lr:.1e}", "tok/s": f"{result.tokens_per_s:.0f}"})
                saved = self._checkpoint_after(step, end, logger, ckpt_cfg)
                if stop.requested():
                    self._stop_on_signal(stop, saved, logger)
                    break
                if stop_after is not None and len(ran) >= stop_after:
                    break
        return ran

    def _checkpoint_after(self, step, end, logger, ckpt_cfg):
        crossed = self._crossed_cr(step) if ckpt_cfg.save_at_cr_crossings else None
        if crossed is not None:
            path = self.save(f"cr_{crossed:.1f}", self.step, update_latest=False)
            logger.write(f"measured CR {crossed:.1f}x reached: {path}")
        phase_done = self.step in {e for _, e in self.plan.ranges.values()}
        regular = ckpt_cfg.save_interval and self.step % ckpt_cfg.save_interval == 0
        if phase_done or regular or self.step == end:
            self.save(f"step_{self.step:07d}", self.step)
            if phase_done and self.rank == 0:
                phase = self.plan.phase_of(step)
                final = ckpt.copy_checkpoint(self.ckpt_dir / f"step_{self.step:07d}",
                                             self.ckpt_dir / phase)
                logger.write(f"phase {phase} finished at step {self.step}: {final}")
            ckpt.prune_checkpoints(self.ckpt_dir, ckpt_cfg.keep_last + (1 if phase_done else 0))
        return bool(phase_done or regular or self.step == end)

    def _crossed_cr(self, step: int) -> float | None:
        """The highest half-integer CR (1.5, 2, 2.5, ...) that the CR measured at ``step``
        (retrofit or solidify, over the global batch) reaches and that has no ``cr_*``
        checkpoint yet: checkpoints are named by the compression the model achieves, not by
        the target it is annealed towards. A replay after a resume finds its folder saved."""
        if self.last_cr is None or self.plan.phase_of(step) not in ("retrofit", "solidify"):
            return None
        half = math.floor(2 * cr_summary(self.last_cr)["cr"] + 1e-9) / 2
        if half < 1.5 or (self.ckpt_dir / f"cr_{half:.1f}").is_dir():
            return None
        return half

    def _complete_phase_folders(self) -> None:
        """On resume: every phase that ended at or before the resumed step gets its phase folder,
        copied again from the step checkpoint of its end when a kill interrupted the copy
        (checkpoints are pruned only after the copy, so the source is still there)."""
        if self.rank != 0:
            return
        for phase, (start, end) in self.plan.ranges.items():
            final = self.ckpt_dir / phase
            if end <= start or end > self.step or ckpt.is_complete(final):
                continue
            src = self.ckpt_dir / f"step_{end:07d}"
            if not ckpt.is_complete(src):
                warnings.warn(f"{final} is missing or incomplete and {src}, the checkpoint it "
                              f"is copied from, is gone: the {phase} phase folder cannot be "
                              f"recreated", stacklevel=2)
                continue
            ckpt.copy_checkpoint(src, final)

    def _stop_on_signal(self, stop: StopSignal, saved: bool, logger) -> None:
        """After SIGUSR1/SIGTERM: a regular checkpoint (unless this step just wrote one), then
        ``self.preempted`` names the signal so the CLI exits with ``EXIT_PREEMPTED``."""
        if not saved:
            self.save(f"step_{self.step:07d}", self.step)
            ckpt.prune_checkpoints(self.ckpt_dir, self.cfg.checkpoint.keep_last)
        self.preempted = stop.received or "a stop signal on another rank"
        logger.write(f"{self.preempted} received: checkpoint saved at step {self.step} "
                     f"({self.ckpt_dir / ckpt.LATEST}); stopping so the run can be resumed")
