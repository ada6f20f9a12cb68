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
    (["--compare-cr", "0.5"], "--cr / --compare-cr: accepted values >= 1"),
])
def test_bad_layout_flags_exit_2_naming_them(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(SMALL + flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
