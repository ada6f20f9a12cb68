"""scripts/gpu_check.sh's usage errors and the summary it ends with (the whole kit runs in
about 4 minutes on 2 CPU cores: see README, performance)."""
import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = ROOT / "scripts" / "gpu_check_summary.py"


def test_kit_usage_errors_exit_2(tmp_path):
    kit = str(ROOT / "scripts" / "gpu_check.sh")
    done = subprocess.run(["bash", kit], capture_output=True, text=True)
    assert done.returncode == 2 and "RESULTS_DIR" in done.stderr
    done = subprocess.run(["bash", kit, str(tmp_path)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "DMC_CHECK_STEPS": "gpu_tests bench"})
    assert done.returncode == 2 and "DMC_CHECK_STEPS" in done.stderr and "train_step" in done.stderr
    for setting, value, accepted in (("DMC_CHECK_DEADLINE", "9m", "whole number of seconds"),
                                     ("DMC_CHECK_MIN_STEP", "-5", "whole number of seconds"),
                                     ("DMC_CHECK_ARCHIVE", str(tmp_path / "r.zip"), ".tgz"),
                                     ("DMC_CHECK_ARCHIVE", str(tmp_path / "r.tgz"), "inside"),
                                     ("DMC_TEST_PATHS", "tests/nowhere", "tests/inference"),
                                     ("DMC_TEST_PATHS", "/etc", "paths below it")):
        done = subprocess.run(["bash", kit, str(tmp_path)], capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin", setting: value})
        assert done.returncode == 2 and setting in done.stderr and accepted in done.stderr


def test_deadline_skips_steps_and_the_archive_keeps_the_results(tmp_path):
    """A deadline already spent when the steps begin: each selected step is recorded as skipped
    (a failure in the summary), and the archive holds the folder as the script left it."""
    results, archive = tmp_path / "r", tmp_path / "out" / "r.tgz"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "DMC_WHEELS": str(tmp_path),
           "DMC_CHECK_STEPS": "paged_kernel train_step", "DMC_CHECK_DEADLINE": "1",
           "DMC_CHECK_ARCHIVE": str(archive)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(results)],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 1, done.stderr
    assert (results / "steps.tsv").read_text().splitlines() == [
        "train_step\tskipped\t0", "paged_kernel\tskipped\t0"]
    assert not (results / "paged_kernel.log").exists()
    assert "paged_kernel       skipped (no time left before DMC_CHECK_DEADLINE)" in done.stdout
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"r/steps.tsv", "r/environment.txt", "r/summary.txt", "r/summary.json"} <= names
    assert not list(archive.parent.glob("*.partial"))


def test_summary_of_a_results_folder(tmp_path):
    (tmp_path / "steps.tsv").write_text(  # gpu_tests failed, then passed on a second call
        "gpu_tests\t1\t60\ndecode_throughput\t1\t5\ngpu_tests\t0\t61\n"
        "train_step\tskipped\t0\n")
    (tmp_path / "environment.txt").write_text("device: no CUDA\n")
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="2"/></testsuites>')
    rows = [{"mode": "vanilla", "measured_cr": 1.0, "batch": 6, "tokens_per_s": 100.0,
             "speedup_vs_vanilla": 1.0},
            {"mode": "dmc 4x", "measured_cr": 4.1, "batch": 19, "tokens_per_s": 300.0,
             "speedup_vs_vanilla": 3.0, "median_host_seconds": 0.0025},
            {"mode": "dmc 4x overlap", "probe_cr": 4.1, "batch": 19,
             "error": "RuntimeError: a fault"}]
    (tmp_path / "decode_throughput.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "decode_tuned.json").write_text(json.dumps({"rows": [
        rows[0], dict(rows[1], tokens_per_s=330.0, speedup_vs_vanilla=3.3)]}))
    (tmp_path / "kernel_tuning.json").write_text(json.dumps({
        "device": "NVIDIA H100 80GB HBM3", "source": {},
        "paged_decode": [{"max_heads": 1152, "block_n": 64, "num_warps": 4, "num_stages": 3},
                         {"max_heads": None, "block_n": 128, "num_warps": 4, "num_stages": 3}],
        "dmc_write": {"num_warps": 2}}))
    (tmp_path / "paged_kernel.json").write_text(json.dumps({"paths": {
        "compiled": {"kernel_GBps": 9.5, "copy_GBps": 20.0, "fraction_of_copy": 0.475},
        "pytorch": {"kernel_GBps": 4.0, "copy_GBps": 20.0, "fraction_of_copy": 0.2}}}))
    (tmp_path / "write_kernel.json").write_text(json.dumps({"programs": 2192, "seconds": {
        "triton w1": 8e-6, "triton w4 (default)": 2.56e-5}}))
    (tmp_path / "train_step.json").write_text(json.dumps({"results": {
        "vanilla": {"step_s": 1.0, "time_vs_vanilla": 1.0, "memory_vs_vanilla": 1.0},
        "dmc-dense": {"step_s": 1.2, "time_vs_vanilla": 1.2, "memory_vs_vanilla": 1.5,
                      "saved_vs_vanilla": 1.25},
        "dmc-flex": {"step_s": 1.1, "time_vs_vanilla": 1.1, "memory_vs_vanilla": None},
        "dmc-flex-channel": {"step_s": 1.3, "time_vs_vanilla": 1.3, "memory_vs_vanilla": 1.0,
                             "host_s": 0.4, "kernel_s": 0.9, "launches": 900, "idle_s": 0.35,
                             "syncs": {"cross_entropy.py:34": 2, "attention.py:90": 1}},
        "dmc-flex+torch-sums": {"error": "CompilationError: out of resources"}}}))
    done = subprocess.run([sys.executable, str(SUMMARY), str(tmp_path)], capture_output=True,
                          text=True)
    assert done.returncode == 1  # a step failed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == [{"step": "gpu_tests", "exit": 0, "seconds": 61},
                                {"step": "decode_throughput", "exit": 1, "seconds": 5},
                                {"step": "train_step", "exit": "skipped", "seconds": 0}]
    assert summary["gpu_tests"] == {"tests": 4, "failures": 1, "errors": 0, "skipped": 2}
    assert summary["figures"]["decode"][1]["speedup_vs_vanilla"] == 3.0
    assert [t["attention"] for t in summary["figures"]["train_step"]] == [
        "vanilla", "dmc-dense", "dmc-flex", "dmc-flex-channel", "dmc-flex+torch-sums"]
    text = (tmp_path / "summary.txt").read_text()
    assert "x3.00 vanilla  host 2.50 ms/step" in text and "x1.00 vanilla\n" in text
    assert "decode dmc 4x overlap   failed: RuntimeError: a fault" in text
    assert "decode (tuned) dmc 4x           CR  4.10  batch   19       330.0 tok/s  x3.30" in text
    assert ("kernel tuning written (kernel_tuning.json): paged decode (64, 4, 3) up to 1152 "
            "heads, (128, 4, 3) beyond; DMC write 2 warps") in text
    assert "train_step         skipped (no time left before DMC_CHECK_DEADLINE)" in text
    assert "paged kernel (compiled): 9.5 GB/s, 0.475 of copy" in text
    assert ("train step dmc-dense: x1.200 vanilla time, x1.500 vanilla peak memory, x1.250 "
            "vanilla activations kept") in text
    assert "train step dmc-flex: x1.100 vanilla time\n" in text
    assert ("train step dmc-flex-channel: x1.300 vanilla time, x1.000 vanilla peak memory; "
            "1.300 s a step, the host issued it in 0.400 s, 900 kernels 0.900 s, device idle "
            "0.350 s, 3 waits for the device\n") in text
    assert "train step vanilla" not in text  # no host time measured: no line
    assert "train step dmc-flex+torch-sums: failed: CompilationError: out of resources" in text
    assert [k["path"] for k in summary["figures"]["paged_kernel"]] == ["compiled", "pytorch"]
    assert "DMC write (triton w4 (default)): 25.6 us a layer, 2192 heads" in text
    assert summary["figures"]["write_kernel"][0] == {"path": "triton w1", "us_per_call": 8.0,
                                                     "programs": 2192}
    assert subprocess.run([sys.executable, str(SUMMARY), str(tmp_path / "none")],
                          capture_output=True).returncode == 2


def test_summary_of_gpu_tests_stopped_by_their_time_limit(tmp_path):
    """No JUnit file (pytest killed at its step's limit): the counts come from the verbose
    log's progress lines (xdist's and plain ones), marked partial, with the failed tests."""
    (tmp_path / "steps.tsv").write_text("gpu_tests\t124\t180\n")
    (tmp_path / "gpu_tests.log").write_text(
        "[gw0] [ 10%] PASSED tests/inference/test_kernels_gpu.py::test_a[1]\n"
        "[gw1] [ 20%] FAILED tests/ops/test_mask_gpu.py::test_b\n"
        "tests/inference/test_page_faults.py::test_c SKIPPED (needs CUDA) [ 30%]\n"
        "[gw0] [ 40%] ERROR tests/megatron/test_attention_gpu.py::test_d\n"
        "FAILED tests/ops/test_mask_gpu.py::test_b - AssertionError\n")
    done = subprocess.run([sys.executable, str(SUMMARY), str(tmp_path)], capture_output=True,
                          text=True)
    assert done.returncode == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gpu_tests"] == {
        "tests": 4, "failures": 1, "errors": 1, "skipped": 1, "partial": True,
        "failed": ["tests/ops/test_mask_gpu.py::test_b",
                   "tests/megatron/test_attention_gpu.py::test_d"]}
    text = (tmp_path / "summary.txt").read_text()
    assert "gpu tests (stopped before the end; from the log): 4 finished, 1 failed" in text
    assert "  failed: tests/ops/test_mask_gpu.py::test_b\n" in text


def test_decode_modes_replace_the_presets(tmp_path):
    """DMC_DECODE_MODES picks the decode step's modes (here on the CPU preset)."""
    results = tmp_path / "r"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "DMC_WHEELS": str(tmp_path),
           "DMC_CHECK_STEPS": "decode_throughput", "DMC_DECODE_MODES": "vanilla,dmc:2"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(results)],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((results / "decode_throughput.json").read_text())["rows"]
    assert [row["mode"] for row in rows] == ["vanilla", "dmc 2x"]


def test_a_trained_checkpoint_gets_its_decode_step(tmp_path, parallel_1x1):
    """DMC_CHECK_MODEL: the decode benchmark of vanilla against the checkpoint's own decisions
    (here a tiny model on the CPU preset, DMC_MODEL_ARGS shortening it), in the summary; a
    path that does not exist is a usage error."""
    from dmc.inference import save_inference_state
    from tiny_models import build_tiny

    model, runtime = build_tiny(2, 3, max_seq=64)
    config = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                  num_query_groups=2, vocab_size=96, max_seq_length=64)
    save_inference_state(tmp_path / "model.pt", model, config, runtime.config)
    results, kit = tmp_path / "r", str(ROOT / "scripts" / "gpu_check.sh")
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "DMC_WHEELS": str(tmp_path),
           "DMC_CHECK_STEPS": "decode_model", "DMC_CHECK_MODEL": str(tmp_path / "model.pt"),
           "DMC_MODEL_ARGS": "--prompt-len 20 --gen-len 8 --steady 4 --budget-mib 0.2"}
    done = subprocess.run(["bash", kit, str(results)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((results / "decode_model.json").read_text())["rows"]
    assert [row["mode"] for row in rows] == ["vanilla", "model"]
    assert rows[1]["measured_cr"] > 1.2
    assert "decode (trained model) model" in (results / "summary.txt").read_text()
    done = subprocess.run(["bash", kit, str(results)], capture_output=True, text=True,
                          env=dict(env, DMC_CHECK_MODEL=str(tmp_path / "none.pt")))
    assert done.returncode == 2 and "DMC_CHECK_MODEL" in done.stderr


def test_test_paths_and_train_rows_narrow_the_steps(tmp_path):
    """DMC_TEST_PATHS collects the GPU tests of the paths named only; DMC_TRAIN_BACKENDS,
    DMC_TRAIN_ACCUMULATE, DMC_TRAIN_COMPILE and DMC_TRAIN_DELAYS pick the train step's DMC rows
    (here on the CPU preset)."""
    results = tmp_path / "r"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "DMC_WHEELS": str(tmp_path),
           "DMC_CHECK_STEPS": "gpu_tests train_step",
           "DMC_TEST_PATHS": "tests/ops/test_mask_gpu.py tests/inference/test_kernels_gpu.py",
           "DMC_TRAIN_BACKENDS": "dense", "DMC_TRAIN_ACCUMULATE": "torch",
           "DMC_TRAIN_COMPILE": "on", "DMC_TRAIN_DELAYS": "0,3"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(results)],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    collected = {line.split("::")[0] for line in (results / "gpu_tests.log").read_text()
                 .splitlines() if "::" in line and " SKIPPED" in line}
    assert collected == {"tests/ops/test_mask_gpu.py", "tests/inference/test_kernels_gpu.py"}
    rows = json.loads((results / "train_step.json").read_text())["results"]
    assert list(rows) == ["vanilla", "dmc-dense+compiled", "dmc-dense+compiled+delay3"]


def test_a_step_stopped_early_leaves_no_earlier_calls_results(tmp_path):
    """A results folder reused by a second call: a step killed before it wrote its files must
    not be summarised from the first call's (the JUnit file, a benchmark's JSON)."""
    results = tmp_path / "r"
    results.mkdir()
    (results / "gpu_tests.xml").write_text('<testsuites><testsuite tests="3" failures="0" '
                                          'errors="0" skipped="3"/></testsuites>')
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "DMC_WHEELS": str(tmp_path),
           "DMC_CHECK_STEPS": "gpu_tests", "DMC_TIMEOUT_gpu_tests": "1"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(results)],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 1, done.stderr
    assert not (results / "gpu_tests.xml").exists()
    summary = json.loads((results / "summary.json").read_text())
    assert (summary["gpu_tests"] or {}).get("tests", 0) != 3
