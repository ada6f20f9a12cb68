"""Tiny retrofits on CPU: phases, CR, checkpoints at CR crossings, exact resume."""
import json
import math
import warnings

import pytest
import torch

from dmc.megatron import checkpoint as ckpt
from dmc.training.config import load_config
from dmc.training.trainer import Trainer

from conftest import tiny_overrides


def _cfg(tiny_data, run_dir, **extra):
    return load_config([], tiny_overrides(tiny_data, run_dir, **extra))


@pytest.fixture(scope="module")
def full_run(tiny_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    cfg = _cfg(tiny_data, run_dir, **{
        "schedule.zero_out_steps": 3, "schedule.retrofit_steps": 12,
        "schedule.solidify_steps": 5, "dmc.target_cr": 2.0, "checkpoint.save_interval": 0,
        "optim.lr": 1e-2, "logging.eval_interval": 10, "logging.log_interval": 4})
    trainer = Trainer(cfg, "retrofit")
    results = trainer.run()
    return trainer, results, run_dir


def test_three_phases_run_and_cr_rises(full_run):
    trainer, results, _ = full_run
    assert [r.phase for r in results] == ["zero_out"] * 3 + ["retrofit"] * 12 + ["solidify"] * 5
    assert results[2].target_cr == 1.0 and results[3].target_cr > 1.0
    assert results[14].target_cr == pytest.approx(2.0) and results[-1].target_cr == 2.0
    first, last = results[3], results[-1]
    assert last.measured_cr > first.measured_cr + 0.1
    assert all(r.cr_loss >= 0 for r in results)
    assert results[-1].lr < results[14].lr  # cosine during solidify
    # the LR logged is the one the step trained with: the last step's is above the minimum the
    # schedule reaches after it
    assert results[-1].lr > trainer.cfg.optim.lr * trainer.cfg.optim.min_lr_ratio * 1.01
    evaluation = trainer.evaluate()
    assert evaluation["valid_cr"] >= 1.0 and evaluation["valid_loss"] > 0


def test_checkpoints_at_crossed_crs_and_phase_ends(full_run, tiny_data, tmp_path):
    trainer, _, run_dir = full_run
    root = run_dir / "checkpoints"
    for name in ("cr_1.5", "cr_2.0", "zero_out", "retrofit", "solidify"):
        assert (root / name / "state.json").is_file(), name
    assert (root / "cr_2.0" / "cr_heatmap.png").stat().st_size > 1000
    state = ckpt.read_state(root / "cr_1.5")
    assert 1.5 <= state["measured_cr"] < 2.0 and state["phase"] == "retrofit"
    assert ckpt.read_state(root / "cr_2.0")["measured_cr"] >= 2.0
    fresh = Trainer(_cfg(tiny_data, tmp_path, **{"checkpoint.load_base": str(root / "cr_1.5"),
                                                 "schedule.zero_out_steps": 0}), "retrofit")
    ckpt.load_checkpoint(root / "cr_1.5", fresh.module)
    assert fresh.evaluate()["valid_loss"] > 0


def test_the_zero_out_checkpoint_holds_the_handed_off_model(full_run, tiny_data, tmp_path):
    """The zero-out phase ends with its decision rows zeroed (Eq. 12 at t = n_t) before its
    checkpoint is written: zeroing them again changes nothing."""
    from dmc.megatron.attention import zero_decision_rows_

    _, _, run_dir = full_run
    model = Trainer(_cfg(tiny_data, tmp_path, **{"schedule.zero_out_steps": 0}),
                    "retrofit").module
    ckpt.load_checkpoint(run_dir / "checkpoints" / "zero_out", model)
    before = {k: v.clone() for k, v in model.state_dict().items()
              if "linear_qkv.weight" in k}
    assert zero_decision_rows_(model) > 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_load_base_warns_when_the_rope_base_changes(full_run, tiny_data, tmp_path):
    _, _, run_dir = full_run
    base = str(run_dir / "checkpoints" / "solidify")
    with pytest.warns(UserWarning, match=r"model.rotary_base is 500000.0 but the checkpoint was "
                                         r"trained with 10000.0"):
        Trainer(_cfg(tiny_data, tmp_path / "a", **{"checkpoint.load_base": base,
                                                   "model.rotary_base": 500000.0}), "retrofit")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(_cfg(tiny_data, tmp_path / "b", **{"checkpoint.load_base": base}), "retrofit")
    assert not [w for w in caught if "positions change meaning" in str(w.message)]


def test_every_evaluation_logs_the_cr_per_layer_and_head(full_run):
    _, _, run_dir = full_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # after 4, 8, 10 (an evaluation between two log intervals), 12, 16 and 20 steps
    assert [r["step"] + 1 for r in records] == [4, 8, 10, 12, 16, 20]
    for record in (records[2], records[5]):
        per_head = record["valid_cr_per_head"]
        assert len(per_head) == 2 and all(len(row) == 2 for row in per_head)
        harmonic = [len(row) / sum(1 / cr for cr in row) for row in per_head]
        assert record["valid_cr_per_layer"] == pytest.approx(harmonic, rel=1e-3)
        overall = 4 / sum(1 / cr for row in per_head for cr in row)
        assert record["valid_cr"] == pytest.approx(overall, rel=1e-3)
    assert "valid_loss" not in records[1]


def test_kill_and_resume_reproduces_losses(tiny_data, tmp_path):
    extra = {"schedule.zero_out_steps": 2, "schedule.retrofit_steps": 6,
             "schedule.solidify_steps": 3, "checkpoint.save_interval": 3}
    straight = Trainer(_cfg(tiny_data, tmp_path / "a", **extra), "retrofit").run()
    killed = Trainer(_cfg(tiny_data, tmp_path / "b", **extra), "retrofit")
    killed.run(stop_after=7)  # dies after step index 6; last checkpoint holds 6 steps
    resumed = Trainer(_cfg(tiny_data, tmp_path / "b", **extra), "retrofit")
    assert resumed.step == 6
    tail = resumed.run()
    assert [r.step for r in tail] == list(range(6, 11))
    for got, want in zip(tail, straight[6:]):
        assert got.lm_loss == pytest.approx(want.lm_loss, abs=1e-6)
        assert got.cr_loss == pytest.approx(want.cr_loss, abs=1e-6)


def test_one_phase_at_a_time(tiny_data, tmp_path):
    extra = {"schedule.zero_out_steps": 2, "schedule.retrofit_steps": 2,
             "schedule.solidify_steps": 1}
    first = Trainer(_cfg(tiny_data, tmp_path, **extra), "retrofit")
    with pytest.raises(ValueError, match="run the earlier phases first"):
        first.run(phase="retrofit")
    assert [r.phase for r in first.run(phase="zero_out")] == ["zero_out"] * 2
    second = Trainer(_cfg(tiny_data, tmp_path, **extra), "retrofit")
    assert [r.phase for r in second.run(phase="retrofit")] == ["retrofit"] * 2


def test_engine_loads_run_checkpoints(full_run, capsys):
    """A retrofit checkpoint serves as a DMC model, a zero_out one as a vanilla model."""
    import torch

    from dmc.cli import main
    from dmc.inference import Engine
    from dmc.inference.loading import load_model

    trainer, _, run_dir = full_run
    loaded = load_model(run_dir)
    assert loaded.source.name == "step_0000020" and loaded.dmc_config.window == 4
    tokens = torch.arange(3, 19)[None]
    positions = torch.arange(16)[None]
    runtime = trainer.runtime
    runtime.set_mode("eval")
    trainer.module.eval()
    with torch.no_grad():
        want = trainer.module(tokens, positions, None)
        got = loaded.model(tokens, positions, None)
    runtime.set_mode("train")
    trainer.module.train()
    assert torch.allclose(got, want, atol=1e-5)
    scored = Engine.from_path(run_dir).score(tokens[0].tolist())
    assert scored.compression.overall > 1.0
    vanilla = load_model(run_dir / "checkpoints" / "zero_out")
    assert vanilla.dmc_config is None
    assert Engine(vanilla.model).dmc is None
    assert main(["generate", "--model", str(run_dir), "--prompt-ids", "3 4 5",
                 "--max-new-tokens", "4", "--json"]) == 0
    assert '"results"' in capsys.readouterr().out
    # a text prompt: the tokenizer comes from the run's data.path
    assert main(["generate", "--model", str(run_dir), "--prompt", "To be", "--no-stop",
                 "--max-new-tokens", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["results"][0]
    assert len(result["tokens"]) == 3 and isinstance(result["text"], str)
    assert main(["generate", "--model", str(run_dir / "nowhere"), "--prompt-ids", "3"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_data_cache_dir_holds_megatron_sample_indices(tiny_data, tmp_path):
    """For a read-only data folder: megatron's index cache goes where data.cache_dir says."""
    Trainer(_cfg(tiny_data, tmp_path / "run", **{"data.cache_dir": str(tmp_path / "idx"),
                                                 "schedule.retrofit_steps": 1}), "retrofit")
    assert list((tmp_path / "idx").glob("*.npy"))


@pytest.mark.parametrize("kind, extra", [
    ("pretrain", {"schedule.pretrain_steps": 3, "dmc.enabled": False}),
    ("retrofit", {"schedule.zero_out_steps": 1, "schedule.retrofit_steps": 2,
                  "schedule.solidify_steps": 0}),
])
def test_bf16_on_cpu_is_autocast_over_float32_parameters(tiny_data, tmp_path, kind, extra):
    """precision=bf16 without CUDA: float32 parameters (megatron's bf16 optimizer takes CUDA
    tensors only), matmuls in bfloat16 under autocast, backward included; the losses follow the
    float32 run's from the same start to bfloat16's rounding."""
    if torch.cuda.is_available():
        pytest.skip("bf16 on a GPU is megatron's own (bf16 weights, float32 main copies)")
    overrides = {"checkpoint.save_interval": 0, "logging.heatmap": False, **extra}
    runs = {}
    for precision in ("fp32", "bf16"):
        trainer = Trainer(_cfg(tiny_data, tmp_path / precision, precision=precision,
                               **overrides), kind)
        assert {p.dtype for p in trainer.module.parameters()} == {torch.float32}
        runs[precision] = [r.lm_loss for r in trainer.run()]
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert len(fp32) == len(bf16) == 3
    assert bf16 != fp32  # bfloat16 matmuls really ran
    assert bf16 == pytest.approx(fp32, rel=2e-2)


def _pretrain_lr(lr, floor, warmup, total, step):
    """Closed form of a pretrain's LR at ``step``: linear warmup from 0 over ``warmup`` steps,
    then cosine from ``lr`` down to ``floor`` at ``total``."""
    if step <= warmup:
        return lr * step / warmup
    return floor + 0.5 * (math.cos(math.pi * (step - warmup) / (total - warmup)) + 1) * (lr - floor)


def test_pretrain_lr_warms_up_for_exactly_warmup_steps_then_cosine_decays(tiny_data, tmp_path):
    """Every pretrain step logs the closed-form warmup + cosine LR (optim.warmup_steps,
    min_lr_ratio): step ``warmup`` is the first at the peak LR."""
    lr, ratio, warmup, total = 1e-2, 0.1, 2, 6
    trainer = Trainer(_cfg(tiny_data, tmp_path, **{
        "schedule.pretrain_steps": total, "optim.warmup_steps": warmup, "optim.lr": lr,
        "optim.min_lr_ratio": ratio, "dmc.enabled": False, "checkpoint.save_interval": 0,
        "logging.log_interval": 1, "logging.heatmap": False}), "pretrain")
    results = trainer.run()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.step for r in results] == [r["step"] for r in logged] == list(range(total))
    for r, record in zip(results, logged):
        want = _pretrain_lr(lr, lr * ratio, warmup, total, r.step)
        assert r.lr == pytest.approx(want, rel=1e-12, abs=1e-15), r.step
        assert record["lr"] == pytest.approx(want, rel=1e-12, abs=1e-15), r.step
    assert results[warmup].lr == pytest.approx(lr, rel=1e-12)


def test_cr_checkpoints_record_the_target_cr_of_the_step_they_follow(full_run):
    """A cr_X checkpoint saved after ``step`` steps records the target CR that its last step
    trained with (the float64 linear anneal 1 -> 2 over the 12 retrofit steps 3..14)."""
    trainer, results, run_dir = full_run
    states = [ckpt.read_state(path) for path in sorted((run_dir / "checkpoints").glob("cr_*"))]
    assert len(states) >= 2
    for state in states:
        last = state["step"] - 1  # the step the checkpoint was saved after
        want = 1.0 + (2.0 - 1.0) * min(last - 3 + 1, 12) / 12
        assert state["target_cr"] == pytest.approx(want, abs=1e-12), state["step"]
        assert state["target_cr"] == results[last].target_cr
    assert any(state["step"] < 15 for state in states)  # inside the anneal: the target moves


class _IndexedSamples:
    """A stand-in train set whose sample ``k`` is ``seq`` copies of token ``k`` (k < 300)."""

    def __init__(self, seq):
        self.seq = seq

    def __len__(self):
        return 300

    def __getitem__(self, k):
        return {"tokens": torch.full((self.seq,), k), "labels": torch.full((self.seq,), k),
                "loss_mask": torch.ones(self.seq), "position_ids": torch.arange(self.seq)}


def test_each_step_reads_its_global_batch_of_samples_once_split_over_dp_ranks(tiny_data,
                                                                             tmp_path):
    """Step s reads samples s * gbs .. s * gbs + gbs - 1, each once, micro-batch i of DP rank r
    the mbs samples from s * gbs + (r * num_micro + i) * mbs on (gbs 8, mbs 2)."""
    trainer = Trainer(_cfg(tiny_data, tmp_path, **{
        "data.global_batch_size": 8, "data.micro_batch_size": 2,
        "schedule.retrofit_steps": 3, "checkpoint.save_interval": 0}), "retrofit")
    trainer.train_data = _IndexedSamples(trainer.cfg.data.seq_length)
    assert trainer.num_micro == 4

    def samples(step):
        return [b["tokens"][:, 0].tolist() for b in trainer._train_microbatches(step)]

    for step in range(3):
        assert samples(step) == [[8 * step + 2 * i, 8 * step + 2 * i + 1] for i in range(4)]
    trainer.num_micro = 2  # as one of two DP ranks
    for step in range(3):
        ranks = []
        for trainer.dp_rank in (0, 1):
            ranks += samples(step)
        assert ranks == [[8 * step + 2 * i, 8 * step + 2 * i + 1] for i in range(4)]


def test_dp_ranks_draw_the_noise_of_the_single_process_micro_batch(tiny_data, tmp_path):
    """The Gumbel noise key of micro-batch i on DP rank r is r * num_micro + i, the index of the
    same samples in a single-process step, so each (rank, micro-batch) draws its own noise and
    a DP=2 step computes the single-process losses."""
    trainer = Trainer(_cfg(tiny_data, tmp_path, **{
        "schedule.zero_out_steps": 0, "schedule.retrofit_steps": 2,
        "checkpoint.save_interval": 0}), "retrofit")
    keys = []
    trainer.module.register_forward_pre_hook(lambda *_: keys.append(trainer.runtime.microbatch))
    trainer.runtime.start_step(0, "train", 1.5, 0.0)
    batches = trainer._train_microbatches(0)
    assert len(batches) == 2

    def losses(batches):
        keys.clear()
        with torch.no_grad():
            out = [r["lm_loss"].item() for r in trainer._forward_backward(batches, True)]
        trainer.runtime.pop_cr_losses()
        return out

    single = losses(batches)
    assert keys == [0, 1]
    trainer.num_micro = 1  # as one of two DP ranks, one micro-batch each
    by_rank = {}
    for trainer.dp_rank in (0, 1):
        by_rank[trainer.dp_rank] = (losses(batches[trainer.dp_rank:trainer.dp_rank + 1]), keys[:])
    assert by_rank == {0: ([single[0]], [0]), 1: ([single[1]], [1])}
    trainer.dp_rank = 0  # the second micro-batch under the first one's key: other noise
    assert losses(batches[1:]) != [single[1]]
