"""scripts/gpu_check.sh's usage errors and the summary it ends with (the whole kit runs in
about 4 minutes on 2 CPU cores: see README, performance)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = ROOT / "scripts" / "gpu_check_summary.py"


def test_kit_without_a_results_folder_exits_2():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "RESULTS_DIR" in done.stderr


def test_summary_of_a_results_folder(tmp_path):
    (tmp_path / "steps.tsv").write_text("gpu_tests\t0\t60\ndecode_throughput\t1\t5\n")
    (tmp_path / "environment.txt").write_text("device: no CUDA\n")
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="2"/></testsuites>')
    rows = [{"mode": "vanilla", "measured_cr": 1.0, "batch": 6, "tokens_per_s": 100.0,
             "speedup_vs_vanilla": 1.0},
            {"mode": "dmc 4x", "measured_cr": 4.1, "batch": 19, "tokens_per_s": 300.0,
             "speedup_vs_vanilla": 3.0}]
    (tmp_path / "decode_throughput.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "train_step.json").write_text(json.dumps(
        {"results": {"vanilla": {"step_s": 1.0}, "dmc": {"step_s": 1.2}}, "ratio": 0.83}))
    done = subprocess.run([sys.executable, str(SUMMARY), str(tmp_path)], capture_output=True,
                          text=True)
    assert done.returncode == 1  # a step failed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gpu_tests"] == {"tests": 4, "failures": 1, "errors": 0, "skipped": 2}
    assert summary["figures"]["decode"][1]["speedup_vs_vanilla"] == 3.0
    assert abs(summary["figures"]["train_step"]["dmc_over_vanilla_time"] - 1.2) < 1e-9
    assert "x3.00 vanilla" in (tmp_path / "summary.txt").read_text()
    assert subprocess.run([sys.executable, str(SUMMARY), str(tmp_path / "none")],
                          capture_output=True).returncode == 2
