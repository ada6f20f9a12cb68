"""``dmc bench`` runs the repository's benchmark scripts with their own arguments."""
import json

import pytest

from dmc.cli import main
from dmc.eval.bench import available


def test_bench_runs_a_benchmark_and_writes_json(tmp_path, capsys):
    out = tmp_path / "train_step.json"
    code = main(["bench", "train_step", "--layers", "1", "--hidden", "32", "--heads", "2",
                 "--ffn", "64", "--vocab", "64", "--seq", "32", "--batch", "1", "--steps", "1",
                 "--warmup", "0", "--window", "4", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"vanilla", "dmc-dense"}  # FlexAttention: CUDA only
    assert result["results"]["dmc-dense"]["time_vs_vanilla"] > 0
    assert "x vanilla time" in capsys.readouterr().out


def test_unknown_benchmark_lists_the_valid_ones(capsys):
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "decode_throughput" in err and "paged_kernel" in err


@pytest.mark.parametrize("name", available())
def test_every_benchmark_loads_and_prints_its_help(name, capsys):
    """Each benchmark imports under ``dmc bench`` and answers ``--help`` (exit 0): a module
    that fails at import (a dataclass once did, its module not registered) is caught here."""
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("returned,code", [("{'rows': []}", 0), ("None", 0), ("0", 0), ("1", 1)])
def test_a_benchmark_returning_its_results_exits_0(tmp_path, monkeypatch, returned, code):
    """serving and policy_cost return their report (a dict): a successful run, exit 0; an int
    is the exit code."""
    (tmp_path / "reporting.py").write_text(f"def main(argv):\n    return {returned}\n")
    monkeypatch.setenv("DMC_BENCHMARKS", str(tmp_path))
    assert main(["bench", "reporting", "--out", str(tmp_path / "r.json")]) == code
