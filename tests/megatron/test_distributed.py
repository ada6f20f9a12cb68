"""TP=2 and PP=2 (two gloo processes) reproduce the single-process DMC and DMS training steps,
with the per-sequence CR hinge of the global prior (carried across pipeline stages) and the
per-layer hinge of the local prior; the single-process CR loss equals a float64 Eq. 10."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dmc.megatron.parallel import torchrun_command
from dist_worker import DMS_TARGET_CR, GROUPS, LAYERS, MBS, MICRO, SEQ, TARGET_CR

WORKER = Path(__file__).with_name("dist_worker.py")
ROOT = WORKER.parents[2]


def _run(tmp_path, nproc, *flags):
    out = tmp_path / f"result_{nproc}_{'_'.join(flags) or 'single'}.pt"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = [sys.executable, str(WORKER), "--out", str(out), *flags]
    else:
        cmd = [*torchrun_command(nproc), str(WORKER), "--out", str(out), *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), 1)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Results of the two-process layouts (both priors in one run), run on first use."""
    runs = {}

    def get(flags):
        if flags not in runs:
            runs[flags] = _run(tmp_path_factory.mktemp("layout"), 2, *flags)
        return runs[flags]

    return get


def _eq10(kept_per_sequence, count, target_cr):
    """Float64 Eq. 10 (global prior) from the kept slots of each sequence of each micro-batch:
    the mean of the per-sequence hinges (the step's loss is the mean over micro-batches)."""
    kept = kept_per_sequence.double().flatten().tolist()
    return sum(max(0.0, k - count / target_cr) / count for k in kept) / len(kept)


def test_single_process_cr_loss_is_the_per_sequence_hinge(single):
    result = single["global"]
    per_sequence = result["kept_per_sequence"]  # [micro-batches, sequences]
    count = LAYERS * GROUPS * SEQ
    above = per_sequence / count > 1 / TARGET_CR
    assert above[1].tolist() == [False, True]  # micro-batch 1 straddles the target
    want = _eq10(per_sequence, count, TARGET_CR)
    assert result["cr_loss"].item() == pytest.approx(want, abs=1e-6)
    batch_sum = sum(max(0.0, kept - MBS * count / TARGET_CR) / (MBS * count)
                    for kept in per_sequence.sum(dim=1).tolist()) / len(per_sequence)
    assert abs(batch_sum - want) > 1e-3


def test_single_process_dms_cr_loss_is_the_per_sequence_hinge(single):
    result = single["dms"]["global"]
    want = _eq10(result["kept_per_sequence"], LAYERS * GROUPS * SEQ, DMS_TARGET_CR)
    assert result["cr_loss"].item() == pytest.approx(want, abs=1e-6) and want > 0.03
    kept = result["kept"].sum().item() / (MICRO * MBS * LAYERS * GROUPS * SEQ)
    assert 0.3 < kept < 0.8, kept  # soft decisions, neither all kept nor all evicted
    borrowed = [15, 79]  # q[..., -1] of query heads 0 and 2 (head_dim 16, [q, q, k, v] per group)
    grad = result["grads"]["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert grad[borrowed].abs().min() > 0


def test_single_process_head_cap_adds_to_the_hinge(single):
    capped, plain = single["global+cap"], single["global"]
    assert capped["cr_loss"].item() > plain["cr_loss"].item() + 1e-4
    torch.testing.assert_close(capped["kept"], plain["kept"])  # the loss, not the forward


def test_single_process_head_balance_adds_to_the_hinge(single):
    balanced, plain = single["global+balance"], single["global"]
    assert balanced["cr_loss"].item() > plain["cr_loss"].item() + 1e-4
    torch.testing.assert_close(balanced["kept"], plain["kept"])


def _assert_same_step(got, want):
    assert got["lm"].item() == pytest.approx(want["lm"].item(), abs=1e-5)
    assert got["cr_loss"].item() == pytest.approx(want["cr_loss"].item(), abs=1e-6)
    assert want["cr_loss"].item() > 0.03
    torch.testing.assert_close(got["kept"], want["kept"], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got["kept_per_sequence"], want["kept_per_sequence"],
                               rtol=1e-5, atol=1e-4)
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize("method,prior", [("dmc", "global"), ("dmc", "local"),
                                          ("dmc", "global+cap"), ("dmc", "global+balance"),
                                          ("dms", "global"),
                                          ("dms", "local"), ("dms_adapter", "global")])
@pytest.mark.parametrize("flags", [("--tp", "2"), ("--pp", "2")], ids=["tp2", "pp2"])
def test_two_process_layout_matches_single_process(single, layouts, flags, prior, method):
    """``dms_adapter``: decision_proj is column-parallel over KV heads under TP=2."""
    got, want = layouts(flags), single
    if method != "dmc":
        got, want = got[method], want[method]
    _assert_same_step(got[prior], want[prior])
