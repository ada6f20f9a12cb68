"""The training loop on megatron-core alone (no ``megatron.training``).

DDP-wrapped GPTModel, megatron's optimizer and LR scheduler, ``forward_backward_func`` (so
tensor/pipeline/data parallelism come from the config), phases from :mod:`dmc.training.phases`,
the LM loss or logit distillation from a frozen teacher (:mod:`dmc.training.distill`), all
weights or only the decision rows trained (:mod:`dmc.training.adapter`), atomic distributed
checkpoints and exact resume (:mod:`dmc.training.checkpointing`): the data position is a
function of the step and the Gumbel noise is keyed by (seed, layer, step, micro-batch), so a
resumed run reproduces the uninterrupted one. SIGUSR1/SIGTERM end a run cleanly after a
checkpoint (:mod:`dmc.training.preemption`).
"""
from __future__ import annotations

import dataclasses
import math
import time
from contextlib import closing, nullcontext
from dataclasses import dataclass, field
from functools import partial
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
from dmc.megatron.compat import cuda_available
from dmc.megatron.config import ModelConfig
from dmc.megatron.model import build_model
from dmc.megatron.parallel import initialize_parallel
from dmc.megatron.runtime import DMCRuntime
from dmc.training.adapter import DecisionRowsOnly
from dmc.training.checkpointing import RunCheckpoints, cr_summary
from dmc.training.config import RunConfig, dump_config
from dmc.training.decision_lr import DecisionUpdateScale, zero_main_decision_rows_
from dmc.training.distill import (DistillLoss, DistillStage, build_teacher, masked_mean,
                                  teacher_path)
from dmc.training.logging import RunLogger
from dmc.training.phases import PhasePlan
from dmc.training.precision import cpu_autocast, params_dtype
from dmc.training.preemption import StopSignal

__all__ = ["StepResult", "Trainer", "cr_summary"]


@dataclass
class StepResult:
    """One training step's metrics; ``extra`` holds the distillation terms (``kl_loss``, the
    mixed ``loss``) when the run distils."""

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


class Trainer:
    """One pretrain or retrofit run in ``cfg.run_dir``; call :meth:`run`."""

    def __init__(self, cfg: RunConfig, kind: str, allow_config_change: bool = False):
        self.cfg, self.kind = cfg, kind
        self.plan = PhasePlan(cfg, kind)
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)  # unwritable: fail before megatron
        initialize_parallel(cfg.parallel.tensor, cfg.parallel.pipeline, seed=cfg.seed)
        self.rank = dist.get_rank()
        self.run_dir = Path(cfg.run_dir)
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
        self.checkpoints = RunCheckpoints(cfg, kind, self.plan, self.model_config(),
                                          self.module, self.optimizer, self.scheduler)
        self.step, self.resumed_from = self.checkpoints.start(allow_config_change)
        self.last_cr = None  # [layers, kv_heads] CR measured at the last retrofit/solidify step
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

    def model_config(self) -> ModelConfig:
        """The architecture of the model (the run's ``model`` section, the vocabulary size and
        the query groups resolved)."""
        m = self.cfg.model
        return dataclasses.replace(m, vocab_size=self.vocab_size, num_query_groups=m.kv_heads)

    def _build_model(self):
        """The student (``self.module``), with the frozen teacher beside it in a
        :class:`DistillStage` when distilling, wrapped in DDP (``self.model``); the optimizer
        over the trainable parameters and the LR schedule."""
        cfg = self.cfg
        dtype = params_dtype(cfg)
        self.runtime = DMCRuntime(cfg.dmc.model_settings(), seed=cfg.seed,
                                  cr_loss_weight=cfg.dmc.cr_loss_weight)
        module = build_model(self.model_config(), self.runtime, params_dtype=dtype)
        self.module, self.tconfig = module, module.config
        self.adapter = DecisionRowsOnly(module) if cfg.optim.trainable == "decisions" else None
        self.stage, self.distill_loss = None, None
        if cfg.distill.weight > 0:
            teacher = build_teacher(teacher_path(cfg), self.model_config(), dtype)
            self.stage = DistillStage(module, teacher)
            self.distill_loss = DistillLoss(cfg.distill.weight, cfg.distill.temperature)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False)
        self.model = DistributedDataParallel(self.tconfig, ddp_config, self.stage or module)
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
        """pretrain: warmup + cosine to min; retrofit: constant, cosine during solidify. With
        ``override_opt_param_scheduler`` a resume takes only the step count from a checkpoint."""
        o, total = self.cfg.optim, max(self.plan.total_steps, 1)
        common = dict(init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr,
                      min_lr=o.lr * o.min_lr_ratio, lr_warmup_steps=min(o.warmup_steps, total - 1),
                      lr_decay_steps=total, start_wd=o.weight_decay, end_wd=o.weight_decay,
                      wd_incr_steps=total, wd_incr_style="constant",
                      override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
        if self.kind == "pretrain":
            return OptimizerParamScheduler(self.optimizer, lr_decay_style="cosine", **common)
        solidify = self.cfg.schedule.solidify_steps
        if solidify == 0:
            return OptimizerParamScheduler(self.optimizer, lr_decay_style="constant", **common)
        return OptimizerParamScheduler(self.optimizer, lr_decay_style="WSD",
                                       wsd_decay_steps=solidify, lr_wsd_decay_style="cosine",
                                       **common)

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
    def _forward_backward(self, batches, forward_only: bool, distill: bool = False) -> list[dict]:
        """One pass of ``forward_backward_func`` over ``batches``: the student's LM loss, or
        with ``distill`` the mixed loss of the student and the teacher (whose hidden states
        travel beside the student's between pipeline stages: twice the sequence length)."""
        runtime = self.runtime
        data, micro = iter(batches), iter(range(len(batches)))
        if self.stage is not None:
            self.stage.distilling = distill

        def forward_step(_, model):
            runtime.microbatch = self.dp_rank * len(batches) + next(micro)
            b = next(data)
            with cpu_autocast(self.cfg):
                if distill:
                    return (model(b["tokens"], b["position_ids"], None),
                            partial(self.distill_loss, b))
                output = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            return output, partial(_lm_loss, b["loss_mask"])

        MoEAuxLossAutoScaler.set_loss_scale(
            torch.tensor(1.0 / len(batches), device="cuda" if cuda_available() else "cpu"))
        seq = self.cfg.data.seq_length * (2 if distill else 1)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=None, model=[self.model],
            num_microbatches=len(batches), seq_length=seq,
            micro_batch_size=self.cfg.data.micro_batch_size, forward_only=forward_only,
        )

    def _reduce_means(self, results: list[dict], keys) -> dict[str, float]:
        """Means over micro-batches and DP ranks of the ``keys`` of ``results`` (what the
        last pipeline stage reports; other stages hold none)."""
        count = len(results) if parallel_state.is_pipeline_last_stage() else 0
        local = torch.tensor([sum(r[k].item() for r in results) for k in keys] + [count],
                             dtype=torch.float64)
        if cuda_available():
            local = local.cuda()
        dist.all_reduce(local)
        return {k: (local[i] / local[-1].clamp_min(1)).item() for i, k in enumerate(keys)}

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
        distill = self.stage is not None
        results = self._forward_backward(self._train_microbatches(step), forward_only=False,
                                         distill=distill)
        adapter = self.adapter.around_step() if self.adapter is not None else nullcontext()
        with self.decision_scale.around_step(enabled=plan.mode == "train"), adapter:
            success, grad_norm, _ = self.optimizer.step()
        if not success:
            raise FloatingPointError(f"optimizer step {step} was skipped (non-finite gradients)")
        lr = self.optimizer.param_groups[0]["lr"]  # this step's: the scheduler sets the next
        self.scheduler.step(1)
        elapsed = time.perf_counter() - start
        losses = self._reduce_means(results, ("lm_loss", "kl_loss", "loss") if distill
                                    else ("lm_loss",))
        measured = 1.0
        if plan.mode == "train":
            measured = cr_summary(self.measured_cr())["cr"]
        tokens = self.cfg.data.global_batch_size * self.cfg.data.seq_length
        return StepResult(
            step=step, phase=plan.phase, lm_loss=losses.pop("lm_loss"), cr_loss=self._cr_loss(),
            target_cr=plan.target_cr, measured_cr=measured,
            lr=lr, grad_norm=float(grad_norm or 0.0),
            tokens_per_s=tokens / elapsed, extra=losses)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out LM loss and perplexity in eval mode (hard decisions) and the measured CR;
        inside zero-out, in ``zero_out`` mode at the last step's scale (the model it trains)."""
        runtime = self.runtime
        previous = runtime.mode
        zeroing = self.plan.dmc and self.step < self.plan.ranges["retrofit"][0]
        runtime.set_mode("zero_out" if zeroing else "eval" if self.plan.dmc else "vanilla")
        self._reset_cr_stats()
        self.model.eval()
        mbs, iters = self.cfg.data.micro_batch_size, max(self.cfg.logging.eval_iters, 1)
        first = self.dp_rank * iters * mbs
        batches = [self._microbatch(self.valid_data, first + i * mbs) for i in range(iters)]
        results = self._forward_backward(batches, forward_only=True)
        loss = self._reduce_means(results, ("lm_loss",))["lm_loss"]
        out = {"valid_loss": loss, "valid_ppl": math.exp(min(loss, 50.0))}
        if self.plan.dmc and not zeroing:
            out.update(cr_summary(self.measured_cr(), prefix="valid_"))
        runtime.set_mode(previous)
        self.model.train()
        return out

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
        log_cfg = self.cfg.logging
        signals = nullcontext(stop) if stop is not None else StopSignal()
        with signals as stop, closing(logger):
            if self.step < end and stop.requested():  # arrived during start-up: nothing to save
                self.preempted = stop.received or "a stop signal on another rank"
                logger.write(f"{self.preempted} received during start-up: stopping at step "
                             f"{self.step}, nothing new to save")
            while self.step < end and self.preempted is None:
                step = self.step
                if self.plan.dmc and step == self.plan.ranges["retrofit"][0] and step > 0:
                    self._hand_off()  # a zero-out checkpoint written before the hand-off moved
                result = self.train_step(step)
                self.step = step + 1
                if self.plan.dmc and self.step == self.plan.ranges["retrofit"][0]:
                    self._hand_off()  # before the zero-out phase's checkpoint is written
                ran.append(result)
                if self.plan.dmc and result.phase in ("retrofit", "solidify"):
                    self.last_cr = self.measured_cr()
                record = {k: v for k, v in vars(result).items() if k != "extra"}
                record.update(result.extra)
                evaluated = bool(log_cfg.eval_interval) and self.step % log_cfg.eval_interval == 0
                if evaluated:
                    record.update(self.evaluate())
                if evaluated or self.step % log_cfg.log_interval == 0 or self.step == end:
                    logger.log(record)
                logger.progress(self.step, {
                    "phase": result.phase, "loss": f"{result.lm_loss:.3f}",
                    **({"kl": f"{result.extra['kl_loss']:.3f}"} if result.extra else {}),
                    "cr": f"{result.measured_cr:.2f}/{result.target_cr:.2f}",
                    "lr": f"{result.lr:.1e}", "tok/s": f"{result.tokens_per_s:.0f}"})
                saved = self.checkpoints.after_step(step, end, self.last_cr, logger)
                if stop.requested():
                    self._stop_on_signal(stop, saved, logger)
                    break
                if stop_after is not None and len(ran) >= stop_after:
                    break
        return ran

    def _hand_off(self) -> None:
        """Eq. 12 at t = n_t: the decision rows and their float32 main copies zeroed."""
        zero_decision_rows_(self.module)
        zero_main_decision_rows_(self.module)

    def _stop_on_signal(self, stop: StopSignal, saved: bool, logger) -> None:
        """After SIGUSR1/SIGTERM: a regular checkpoint (unless this step just wrote one), then
        ``self.preempted`` names the signal so the CLI exits with ``EXIT_PREEMPTED``."""
        if not saved:
            self.checkpoints.save_regular(self.step, self.last_cr)
        self.preempted = stop.received or "a stop signal on another rank"
        logger.write(f"{self.preempted} received: checkpoint saved at step {self.step} "
                     f"({self.checkpoints.dir / ckpt.LATEST}); stopping so the run can be "
                     f"resumed")


def _lm_loss(loss_mask: torch.Tensor, per_token: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The LM loss of one micro-batch: the token mean of the cross entropy over the loss mask."""
    loss = masked_mean(per_token, loss_mask)
    return loss, {"lm_loss": loss.detach().clone()}  # the schedule divides loss in place
