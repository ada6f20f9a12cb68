"""Distillation under two gloo processes: the vocab-parallel KL at TP=2 (vocabulary sharded)
and its gradient equal a float64 KL of the full logits, and a distilled tiny retrofit
(``dmc retrofit --nproc 2``) at TP=2 and at PP=2 (teacher run with the same split, both hidden
states passed along the pipeline) reproduces the single-process run step by step.

Run as a script (under torchrun) this file is the TP=2 KL worker."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dmc.megatron.parallel import torchrun_command

ROOT = Path(__file__).resolve().parents[2]
SHAPE, VOCAB, TEMPERATURE = (2, 6), 48, 1.5
RETROFIT = {"schedule.zero_out_steps": 1, "schedule.retrofit_steps": 3,
            "schedule.solidify_steps": 1, "checkpoint.save_interval": 0,
            "logging.heatmap": False, "distill.weight": 0.4, "distill.temperature": 2.0}
LAYOUTS = {"tp2": ["parallel.tensor=2"], "pp2": ["parallel.pipeline=2"]}

pytestmark = pytest.mark.distributed


def _logits():
    """Full student and teacher logits and per-token weights (the same on every rank)."""
    gen = torch.Generator().manual_seed(3)
    return (3 * torch.randn(*SHAPE, VOCAB, generator=gen),
            3 * torch.randn(*SHAPE, VOCAB, generator=gen), torch.rand(*SHAPE, generator=gen))


def _worker(out: str) -> None:
    """This rank's vocabulary shard through ``vocab_parallel_kl``; rank 0 saves the KL and
    the gathered student gradient."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from dmc.megatron.parallel import destroy_parallel, initialize_parallel
    from dmc.training.distill import vocab_parallel_kl

    initialize_parallel(2, 1, seed=1)
    rank = parallel_state.get_tensor_model_parallel_rank()
    student, teacher, weights = _logits()
    shard = slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)
    local = student[..., shard].clone().requires_grad_(True)
    kl = vocab_parallel_kl(local, teacher[..., shard], TEMPERATURE)
    (kl * weights).sum().backward()
    parts = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(parts, local.grad, group=parallel_state.get_tensor_model_parallel_group())
    if dist.get_rank() == 0:
        torch.save({"kl": kl.detach(), "grad": torch.cat(parts, dim=-1)}, out)
    destroy_parallel()


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def test_tp2_kl_and_gradient_match_float64(tmp_path):
    out = tmp_path / "kl.pt"
    proc = subprocess.run(
        [*torchrun_command(2), __file__, "--out", str(out)], env=_env(), capture_output=True,
        text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(out)
    student, teacher, weights = _logits()
    reference = student.double().requires_grad_(True)
    log_p = F.log_softmax(teacher.double() / TEMPERATURE, dim=-1)
    log_q = F.log_softmax(reference / TEMPERATURE, dim=-1)
    want = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    (want * weights.double()).sum().backward()
    torch.testing.assert_close(got["kl"].double(), want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["grad"].double(), reference.grad, rtol=1e-5, atol=1e-7)



def _dmc(*argv):
    proc = subprocess.run([sys.executable, "-m", "dmc.cli", *argv], env=_env(),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _metrics(run_dir):
    return {r["step"]: r for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").open())}


@pytest.fixture(scope="module")
def retrofit_args(tiny_data, tmp_path_factory):
    """Overrides of a distilled 5-step retrofit from a 3-step pretrained base (the teacher)."""
    from conftest import tiny_overrides

    base = tmp_path_factory.mktemp("base")
    _dmc("pretrain", *tiny_overrides(tiny_data, base, **{"schedule.pretrain_steps": 3}))
    return lambda run_dir: tiny_overrides(
        tiny_data, run_dir, **RETROFIT, **{"checkpoint.load_base": base / "checkpoints/pretrain"})


@pytest.fixture(scope="module")
def reference(retrofit_args, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    _dmc("retrofit", *retrofit_args(run_dir))
    return _metrics(run_dir)


@pytest.mark.slow  # ~85 s on 2 cores (a single-process reference and two 2-process runs); the
# fast suite keeps the TP2 KL check above and the undistilled layouts (test_distributed_training)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_distilled_retrofit_matches_single_process(layout, retrofit_args, reference, tmp_path):
    _dmc("retrofit", "--nproc", "2", *retrofit_args(tmp_path), *LAYOUTS[layout])
    got = _metrics(tmp_path)
    assert sorted(got) == sorted(reference) == list(range(5))
    assert max(r["kl_loss"] for r in reference.values()) > 1e-3
    for step, want in reference.items():
        for key in ("lm_loss", "kl_loss", "loss", "cr_loss", "measured_cr"):
            assert got[step][key] == pytest.approx(want[key], abs=1e-5), (step, key)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    _worker(parser.parse_args().out)
