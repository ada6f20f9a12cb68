"""Tiny retrofits on CPU: phases, CR, checkpoints at CR crossings, exact resume."""
import json
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
