"""benchmarks/train_step.py: the activations kept alone (no timed steps), by call site, in a
chosen dtype; bad flags exit 2 naming them."""
import gc
import json
from types import SimpleNamespace

import pytest
import torch

from conftest import load_benchmark

bench = load_benchmark("train_step")
TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--vocab", "64",
        "--seq", "32", "--batch", "1", "--window", "4"]


def test_kept_only_by_site_in_bf16(tmp_path, capsys):
    out = tmp_path / "kept.json"
    assert bench.main(TINY + ["--dtype", "bfloat16", "--kept-only", "--by-site", "3",
                              "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    for row in rows.values():
        assert row["step_s"] is None and row["time_vs_vanilla"] is None
        assert 0 < sum(row["saved_by_site"].values()) <= row["saved_bytes"]
        assert len(row["saved_by_site"]) == 3
    assert any("bfloat16" in site for site in rows["dmc-dense"]["saved_by_site"])
    assert any(site.startswith(("dense_attention.py", "accumulate.py"))
               for site in rows["dmc-dense"]["saved_by_site"])
    assert rows["dmc-dense"]["saved_vs_vanilla"] > 1.0
    assert "call sites whose saved storages weigh most" in capsys.readouterr().out


def test_a_delayed_merging_row_attends_over_the_raw_keys_too(tmp_path):
    """``--merge-delays 0,4``: the DMC row again with delayed merging, whose attention keeps the
    raw keys beside the accumulated ones for its backward (more than plain DMC keeps)."""
    out = tmp_path / "delayed.json"
    assert bench.main(TINY + ["--kept-only", "--merge-delays", "0,4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert list(rows) == ["vanilla", "dmc-dense", "dmc-dense+delay4"]
    assert rows["dmc-dense+delay4"]["saved_bytes"] > rows["dmc-dense"]["saved_bytes"]


def test_timed_steps_and_the_busiest_ops(tmp_path, capsys):
    out = tmp_path / "timed.json"
    assert bench.main(TINY + ["--steps", "1", "--warmup", "0", "--profile", "4",
                              "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert set(rows) == {"vanilla", "dmc-dense"}
    for row in rows.values():
        assert row["step_s"] > 0 and len(row["busiest_ops"]) == 4
        assert 0 < row["host_s"] <= row["step_s"]
        assert row["kernel_s"] is None and row["launches"] is None and row["gaps"] == []  # CPU
        assert row["syncs"] is None
        times = [op["ms"] for op in row["busiest_ops"]]
        assert times == sorted(times, reverse=True) and times[0] > 0
        assert all(op["name"] and op["calls"] >= 1 for op in row["busiest_ops"])
        assert "ops" not in row
    excess = rows["dmc-dense"]["excess_over_vanilla"]  # where the DMC step's extra time goes
    assert "excess_over_vanilla" not in rows["vanilla"] and 0 < len(excess) <= 4
    assert [op["ms"] for op in excess] == sorted((op["ms"] for op in excess), reverse=True)
    assert excess[-1]["ms"] > 0
    out = capsys.readouterr().out
    assert "ops of one step with the most self time" in out
    assert "ops whose self time exceeds vanilla's most" in out


def test_copy_sites_name_the_functions_that_copy(tmp_path, capsys):
    """--copy-sites alone: no busiest_ops, the data-movement ops by call site, the DMC row's
    among them in dmc's own modules (the window sums' shifts of the PyTorch path) and in the
    backward, named by the autograd node that ran them."""
    out = tmp_path / "sites.json"
    assert bench.main(TINY + ["--steps", "1", "--warmup", "0", "--copy-sites", "40",
                              "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    for row in rows.values():
        assert "busiest_ops" not in row and 0 < len(row["copy_sites"]) <= 40
        assert all(op["name"] in bench.COPY_OPS and op["site"] and op["calls"] >= 1
                   for op in row["copy_sites"])
        times = [op["ms"] for op in row["copy_sites"]]
        assert times == sorted(times, reverse=True)
    assert any(op["site"].startswith("accumulate.py") for op in rows["dmc-dense"]["copy_sites"])
    assert not any(op["site"].startswith("accumulate.py") for op in rows["vanilla"]["copy_sites"])
    assert any(op["site"].startswith("backward of ") and op["site"].endswith("Backward0")
               for op in rows["dmc-dense"]["copy_sites"])  # the backward's, by autograd node
    assert "pairs that copy or fill memory with the most self time" in capsys.readouterr().out


def test_a_failing_dmc_row_leaves_the_others(tmp_path, monkeypatch, capsys):
    """A DMC row whose step raises (a kernel that does not compile on that GPU) is recorded
    with its error; vanilla is still measured, the JSON written, the exit code 1."""
    measure = bench.measure

    def failing(model, runtime, mode, *args):
        if mode == "train":
            raise RuntimeError("no kernel here")
        return measure(model, runtime, mode, *args)

    monkeypatch.setattr(bench, "measure", failing)
    out = tmp_path / "failed.json"
    assert bench.main(TINY + ["--steps", "1", "--warmup", "0", "--out", str(out)]) == 1
    rows = json.loads(out.read_text())["results"]
    assert rows["dmc-dense"] == {"error": "RuntimeError: no kernel here"}
    assert rows["vanilla"]["step_s"] > 0 and rows["vanilla"]["time_vs_vanilla"] == 1.0
    assert "dmc-dense            failed: RuntimeError: no kernel here" in capsys.readouterr().out


def test_the_json_holds_every_row_measured_before_a_stop(tmp_path, monkeypatch):
    """A run stopped between rows (the kit's time limit) leaves the JSON of the rows it
    measured."""
    measure_row = bench.measure_row

    def stopping(args, model, runtime, mode, name, *rest):
        if name != "vanilla":
            raise KeyboardInterrupt  # not an Exception: not recorded as a failed row
        return measure_row(args, model, runtime, mode, name, *rest)

    monkeypatch.setattr(bench, "measure_row", stopping)
    out = tmp_path / "stopped.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(TINY + ["--steps", "1", "--warmup", "0", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert list(rows) == ["vanilla"] and rows["vanilla"]["time_vs_vanilla"] == 1.0


def test_the_kits_rows():
    """The GPU kit's default rows: each attention backend with the fused sums, then the
    PyTorch sums once, with the last backend."""
    names = [row[1] for row in bench.row_plan(["dense", "flex-transposed", "flex"],
                                              ["triton", "torch"])]
    assert names == ["vanilla", "dmc-dense", "dmc-flex-transposed", "dmc-flex",
                     "dmc-flex+torch-sums"]
    assert bench.row_plan(["flex"], ["triton", "torch"])[-1] == ("train", "dmc-flex+torch-sums",
                                                                 "flex", "torch", False, 0)
    twins = bench.row_plan(["flex-channel"], ["triton"], "both")
    assert [row[1] for row in twins] == ["vanilla", "dmc-flex-channel",
                                         "dmc-flex-channel+compiled"]
    assert [row[4] for row in twins] == [False, False, True]
    assert [row[4] for row in bench.row_plan(["dense"], ["torch"], "on")] == [False, True]
    delayed = bench.row_plan(["flex-channel"], ["triton"], "both", (0, 16))
    assert [row[1] for row in delayed] == [
        "vanilla", "dmc-flex-channel", "dmc-flex-channel+compiled", "dmc-flex-channel+delay16",
        "dmc-flex-channel+compiled+delay16"]
    assert [row[5] for row in delayed] == [0, 0, 0, 16, 16]


@pytest.mark.parametrize("flags,named", [(["--by-site", "-1"], "--by-site"),
                                         (["--profile", "-2"], "--profile"),
                                         (["--copy-sites", "-1"], "--copy-sites"),
                                         (["--dtype", "half"], "--dtype"),
                                         (["--accumulate", "cuda"], "--accumulate"),
                                         (["--merge-delays", "0,x"], "--merge-delays"),
                                         (["--merge-delays", "-1"], "--merge-delays"),
                                         (["--backends", "flash"], "--backends"),
                                         (["--heads", "0"], "--heads: must be >= 1, got 0"),
                                         (["--layers", "0"], "--layers: must be >= 1, got 0"),
                                         (["--steps", "0"], "--steps: must be >= 1, got 0"),
                                         (["--seq", "0"], "--seq: must be >= 1, got 0"),
                                         (["--batch", "0"], "--batch: must be >= 1, got 0"),
                                         (["--vocab", "0"], "--vocab: must be >= 1, got 0"),
                                         (["--hidden", "-4"], "--hidden: must be >= 1"),
                                         (["--ffn", "0"], "--ffn: must be >= 1, got 0"),
                                         (["--window", "0"], "--window: must be >= 1, got 0"),
                                         (["--warmup", "-1"], "--warmup: must be >= 0, got -1"),
                                         (["--groups", "3"],
                                          "--groups: accepted divisors of --heads (2), got 3"),
                                         (["--groups", "0"], "--groups: accepted divisors"),
                                         (["--heads", "3"],
                                          "--hidden: accepted multiples of --heads (3), got 32"),
                                         (["--merge-delays", "0,40"],
                                          "--merge-delays: accepted integers >= 0 and < --seq - 1"
                                          " = 31 (comma separated"),
                                         pytest.param(["--backends", "flex-transposed"],
                                                      "--backends", marks=pytest.mark.skipif(
                                                          torch.cuda.is_available(),
                                                          reason="CPU only")),
                                         pytest.param(["--accumulate", "triton"], "--accumulate",
                                                      marks=pytest.mark.skipif(
                                                          torch.cuda.is_available(),
                                                          reason="CPU only"))])
def test_bad_flags_exit_2_naming_them(flags, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(TINY + flags)
    assert exit_info.value.code == 2 and named in capsys.readouterr().err


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python's gc tracks, parameters excluded
    (and the fake tensors an earlier test's torch.compile may leave, which hold no memory)."""
    storages = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and not isinstance(obj, torch.nn.Parameter):
            storage = obj.untyped_storage()
            try:
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # "Cannot access data pointer of Tensor (e.g. FakeTensor)"
                continue
    return sum(storages.values())


@pytest.mark.parametrize("mode", ["vanilla", "train"])
def test_counting_the_kept_activations_keeps_none_of_them(mode):
    """The forward that counts what autograd keeps frees it afterwards (its pack hook once
    returned the tensor itself: outputs saved by their own node then formed cycles that nothing
    freed, and on the GPU every later row's peak memory carried them)."""
    from dmc.megatron.model import build_gpt_model, llama_transformer_config
    from dmc.megatron.parallel import initialize_parallel
    from dmc.megatron.runtime import DMCConfig, DMCRuntime

    initialize_parallel(1, 1, seed=0)
    runtime = DMCRuntime(DMCConfig(window=4))
    model = build_gpt_model(llama_transformer_config(1, 32, 2, 64), 64, 32, dmc=runtime)
    tokens = torch.randint(0, 64, (1, 32))
    positions = torch.arange(32).expand(1, 32)
    before = _live_tensor_bytes()
    saved = bench.saved_activation_bytes(model, runtime, mode, tokens, positions)
    assert saved > 0
    assert _live_tensor_bytes() - before < saved / 10


def test_excess_over_vanilla_is_the_difference_per_op():
    dmc = [{"name": "mm", "ms": 5.0, "calls": 4}, {"name": "cat", "ms": 3.0, "calls": 9},
           {"name": "flex", "ms": 2.0, "calls": 2}, {"name": "add", "ms": 1.0, "calls": 3}]
    vanilla = [{"name": "mm", "ms": 4.5, "calls": 4}, {"name": "cat", "ms": 1.0, "calls": 4},
               {"name": "add", "ms": 1.5, "calls": 3}, {"name": "sdpa", "ms": 2.0, "calls": 1}]
    assert bench.excess_ops(dmc, vanilla, 2) == [
        {"name": "cat", "ms": 2.0, "calls": 9, "vanilla_calls": 4},
        {"name": "flex", "ms": 2.0, "calls": 2, "vanilla_calls": 0}]
    assert [op["name"] for op in bench.excess_ops(dmc, vanilla, 5)] == ["cat", "flex", "mm"]


def test_one_entry_a_name_the_longest():
    """The profiler lists a Triton kernel's launch and the kernel, or a region's host and
    device spans, under one name: the longer is kept, once."""
    averages = [SimpleNamespace(key="Optimizer.step", count=1, self_device_time_total=15000.0),
                SimpleNamespace(key="mm", count=4, self_device_time_total=9000.0),
                SimpleNamespace(key="Optimizer.step", count=1, self_device_time_total=0.0),
                SimpleNamespace(key="flex", count=2, self_device_time_total=3000.0),
                SimpleNamespace(key="flex", count=2, self_device_time_total=3000.0)]
    assert bench.one_per_name(averages, "self_device_time_total") == [
        {"name": "Optimizer.step", "ms": 15.0, "calls": 1}, {"name": "mm", "ms": 9.0, "calls": 4},
        {"name": "flex", "ms": 3.0, "calls": 2}]


def test_sync_sites_count_the_lines_that_wait_for_the_device(monkeypatch):
    """The warnings of torch.cuda.set_sync_debug_mode("warn") grouped by the line that made
    them (other warnings ignored); the mode set back to default after the step, even when it
    fails."""
    import warnings

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step():
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation")  # this line, twice
        warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("something else")

    sites = bench.sync_sites(step)
    assert list(sites.values()) == [2, 1] and modes == ["warn", "default"]
    assert all(site.startswith("test_train_step.py:") for site in sites)

    def failing():
        raise RuntimeError("a kernel failed")

    with pytest.raises(RuntimeError):
        bench.sync_sites(failing)
    assert modes[-1] == "default"
