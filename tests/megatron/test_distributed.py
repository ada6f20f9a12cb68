"""TP=2 and PP=2 (two gloo processes) reproduce the single-process DMC training step."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("dist_worker.py")
ROOT = WORKER.parents[2]


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _run(tmp_path, nproc, *flags):
    out = tmp_path / f"result_{nproc}_{'_'.join(flags) or 'single'}.pt"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = [sys.executable, str(WORKER), "--out", str(out), *flags]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", _free_port(), str(WORKER), "--out", str(out), *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), 1)


@pytest.mark.distributed
@pytest.mark.parametrize("flags", [("--tp", "2"), ("--pp", "2")], ids=["tp2", "pp2"])
def test_two_process_layout_matches_single_process(single, tmp_path, flags):
    got = _run(tmp_path, 2, *flags)
    assert got["lm"].item() == pytest.approx(single["lm"].item(), abs=1e-5)
    assert got["cr_loss"].item() == pytest.approx(single["cr_loss"].item(), abs=1e-5)
    assert single["cr_loss"].item() > 0.05
    torch.testing.assert_close(got["kept"], single["kept"], rtol=1e-5, atol=1e-4)
    assert set(got["grads"]) == set(single["grads"])
    for name, grad in single["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-5, msg=name)
