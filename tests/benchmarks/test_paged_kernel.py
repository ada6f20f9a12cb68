"""benchmarks/paged_kernel.py: the --compare-cr layout (R x the sequences, R x shorter heads,
about the same K/V bytes), its lengths within the spread, the kernel time per byte against the
first layout's, and bad flags exiting 2."""
import json

import pytest
import torch

from conftest import load_benchmark

bench = load_benchmark("paged_kernel")
SMALL = ["--batch", "3", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "32", "--length",
         "256", "--iters", "1", "--dtype", "float32"]


def test_the_compare_layout_holds_as_many_slots_in_shorter_heads():
    first, short = bench.layouts(bench.parse_args(SMALL + ["--compare-cr", "4"]))
    assert (first.batch, first.mean, first.spread, first.suffix) == (3, 256.0, 0.0, "")
    assert (short.batch, short.mean, short.spread, short.suffix) == (12, 64.0, 0.05, " at cr 4")
    ragged = bench.layouts(bench.parse_args(SMALL + ["--cr", "2"]))
    assert [(layout.mean, layout.spread) for layout in ragged] == [(128.0, 0.5)]


@pytest.mark.parametrize("mean, spread", [(64.0, 0.05), (300.0, 0.5), (1.0, 0.9)])
def test_head_lengths_lie_within_the_spread(mean, spread):
    layout = bench.Layout(batch=50, mean=mean, spread=spread)
    lengths = bench.head_lengths(layout, 4, torch.Generator().manual_seed(0))
    assert lengths.shape == (50, 4)
    assert int(lengths.min()) >= max(1, round(mean * (1 - spread)))
    assert int(lengths.max()) <= round(mean * (1 + spread))
    if spread > 0.1:
        assert int(lengths.max()) > int(lengths.min())


def test_short_head_cost_is_the_time_per_byte_ratio():
    results = {"triton": {"kernel_seconds": 2.0, "kv_bytes": 100},
               "triton at cr 4": {"kernel_seconds": 3.0, "kv_bytes": 120},
               "sweep b64 w4 s3": {"kernel_seconds": 1.0, "kv_bytes": 100}}
    assert bench.short_head_cost(results) == {"triton": pytest.approx((3.0 / 120) / (2.0 / 100))}


def test_a_cpu_run_times_both_layouts(tmp_path, capsys):
    out = tmp_path / "kernel.json"
    assert bench.main(SMALL + ["--compare-cr", "2", "--out", str(out)]) == 0
    paths = json.loads(out.read_text())["paths"]
    assert {"pytorch", "pytorch at cr 2"} <= set(paths)
    long_heads, short_heads = paths["pytorch"], paths["pytorch at cr 2"]
    assert (long_heads["batch"], short_heads["batch"]) == (3, 6)
    assert long_heads["mean_length"] == 256
    assert abs(short_heads["mean_length"] - 128) <= 128 * 0.05
    assert abs(short_heads["kv_bytes"] / long_heads["kv_bytes"] - 1) <= 0.05
    assert "pytorch: kernel time per K/V byte at cr 2" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--spread", "1"], "--spread: accepted 0 <= spread < 1"),
    (["--compare-spread", "-0.1"], "--compare-spread: accepted 0 <= spread < 1"),
    (["--compare-cr", "0.5"], "--cr / --compare-cr: accepted finite values >= 1"),
    (["--cr", "nan"], "--cr / --compare-cr: accepted finite values >= 1"),
    (["--write-tuning", "t.json"], "--write-tuning: needs --sweep on a CUDA device"),
    (["--sweep", "--write-tuning", "t.json"], "--write-tuning: needs --sweep on a CUDA device"),
    (["--page-size", "0"], "--page-size: accepted values >= 1, got 0"),
    (["--batch", "0"], "--batch: accepted values >= 1, got 0"),
    (["--head-dim", "0"], "--head-dim: accepted values >= 1, got 0"),
    (["--iters", "0"], "--iters: accepted values >= 1, got 0"),
    (["--q-heads", "6", "--kv-heads", "4"], "--q-heads: accepted multiples of --kv-heads (4)"),
    (["--num-splits", "0"], "--num-splits: accepted values >= 1, got 0"),
])
def test_bad_layout_flags_exit_2_naming_them(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(SMALL + flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _swept(tuning, seconds, matches=True, suffix=""):
    block_n, warps, stages = tuning
    return (f"sweep b{block_n} w{warps} s{stages}{suffix}",
            {"tuning": list(tuning), "kernel_seconds": seconds, "matches": matches})


def test_tuning_rows_take_the_fastest_matching_tuning_per_layout():
    """3 x 2 heads, then 12 x 2 (--compare-cr 4): the first row up to sqrt(6 x 24) = 12."""
    args = bench.parse_args(SMALL + ["--compare-cr", "4"])
    runs = bench.layouts(args)
    results = {**dict([_swept((64, 4, 4), 1.0), _swept((128, 4, 3), 1.1),
                       _swept((32, 4, 2), 0.5, matches=False),  # wrong output: never chosen
                       _swept((32, 4, 2), 0.8, suffix=" at cr 4"),
                       _swept((128, 4, 3), 1.2, suffix=" at cr 4")])}
    rows = bench.tuning_rows(args, results, runs)
    assert [(row.launch, row.max_heads) for row in rows] == [((64, 4, 4), 12),
                                                             ((32, 4, 2), None)]
    results["sweep b128 w4 s3"]["kernel_seconds"] = 1.01  # the default within 2%: kept
    results["sweep b32 w4 s2 at cr 4"]["kernel_seconds"] = 1.3  # both layouts the default:
    rows = bench.tuning_rows(args, results, runs)               # one row
    assert [(row.launch, row.max_heads) for row in rows] == [((128, 4, 3), None)]
    for name in list(results):
        if name.startswith("sweep") and name.endswith("at cr 4"):
            results[name]["matches"] = False
    with pytest.raises(ValueError, match="no tuning of the sweep at cr 4 matched"):
        bench.tuning_rows(args, results, runs)


def test_a_sweep_through_the_interpreter_writes_a_tuning_file(tmp_path, monkeypatch):
    """The --write-tuning path of a CUDA run, on the interpreter with two tunings: every
    output matches the triton row's, and the file holds a row per layout unless they agree."""
    from dmc.inference.kernels.paged_decode import paged_decode
    from dmc.inference.kernels.tuning import INTERPRETER, read_tuning

    monkeypatch.setattr(bench, "SWEEP", [(16, 2, 2), (32, 4, 3)])
    args = bench.parse_args(SMALL + ["--length", "64", "--compare-cr", "2"])
    args.write_tuning = str(tmp_path / "tuning.json")
    cpu = torch.device("cpu")

    def kernel(q, k, v, t, lengths, scale, max_length):
        return paged_decode(q, k, v, t, lengths, scale, max_length=max_length)

    results = {}
    for layout in bench.layouts(args):
        results["triton" + layout.suffix] = bench.measure(args, cpu, kernel, bench.time_cpu,
                                                          layout)
        results.update(bench.sweep(args, layout, bench.run_once(args, kernel, layout, cpu),
                                   cpu, bench.time_cpu))
    assert len(results) == 6 and all(row["matches"] for name, row in results.items()
                                     if name.startswith("sweep"))
    bench.write_tuning_file(args, results, INTERPRETER)
    tuning = read_tuning(args.write_tuning)
    assert tuning.device == INTERPRETER and tuning.decode[-1].max_heads is None
    assert {row.launch for row in tuning.decode} <= {(16, 2, 2), (32, 4, 3)}
    if len(tuning.decode) == 2:  # 3 x 2 heads, then 6 x 2: the first row up to sqrt(72)
        assert tuning.decode[0].max_heads == 8
    assert tuning.source["paged_decode"].startswith(
        "benchmarks/paged_kernel.py --sweep --compare-cr 2 on triton interpreter")
