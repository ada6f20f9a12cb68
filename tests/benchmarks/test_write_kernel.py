"""benchmarks/write_kernel.py: the Triton write as a decode step launches it (through the
interpreter: its decisions read from the key, one in CR appending), the CPU paths' rows and
JSON, bad flags exiting 2."""
import json

import pytest
import torch

from conftest import load_benchmark

bench = load_benchmark("write_kernel")
SMALL = ["--batch", "6", "--kv-heads", "4", "--head-dim", "16", "--length", "20", "--window",
         "3", "--iters", "1", "--dtype", "float32"]


def test_the_deferred_write_appends_one_decision_in_cr():
    """The write the Triton rows time, through the interpreter: a head grows where its key's
    channel says append, and stays where it merges."""
    from dmc.inference.kernels.dmc_write import dmc_write

    args = bench.parse_args(SMALL + ["--cr", "2"])
    call_args, lengths = bench.deferred_write(args, torch.device("cpu"))
    dmc_write(**call_args)
    dmc_write(**call_args)
    appends = bench.decisions(args, torch.device("cpu")) <= 0.5
    assert 0 < int(appends.sum()) < appends.numel()
    torch.testing.assert_close(lengths[:, 0], 20 + 2 * appends.int())


def test_the_delayed_write_takes_each_leaving_token_through_algorithm1():
    """Delayed merging's write at the benchmark's layout, through the interpreter: every ring
    is full, so each head's leaving token appends where its stored decision says so (one in
    CR), and the step's token takes its ring row with the decision read from its key."""
    from dmc.inference.kernels.delayed_write import delayed_write

    args = bench.parse_args(SMALL + ["--cr", "2", "--merge-delay", "3"])
    call_args, lengths = bench.delayed_write_args(args, torch.device("cpu"))
    row = int(call_args["positions"][0]) % 4  # token p - 4's row, token p's after the write
    leaving = call_args["ring_alpha"][:, 0, :, row].clone()
    delayed_write(**call_args)
    assert 0 < int((leaving <= 0.5).sum()) < leaving.numel()
    torch.testing.assert_close(lengths[:, 0], 20 + (leaving <= 0.5).int())
    assert torch.equal(call_args["ring_alpha"][:, 0, :, row],
                       (call_args["k"][..., -1] > 0).float())
    assert bench.delayed_seconds(args, torch.device("cpu"), 1) > 0


def test_the_triton_rows_time_each_warp_count():
    args = bench.parse_args(SMALL + ["--warps", "1,4"])
    rows = bench.triton_rows(args, torch.device("cpu"))
    assert list(rows) == [1, 4] and all(seconds > 0 for seconds in rows.values())
    assert list(bench.row_names(rows, 4)) == ["triton w1", "triton w4 (in use)"]


def test_open_slots_hold_what_the_decisions_leave_or_fill_the_ring():
    """Without ``--full-rings`` a head's open slot holds a geometric count of tokens with mean
    CR (a quarter of the write's ring rows read at CR 4); with it, the whole window."""
    gen = torch.Generator().manual_seed(0)
    args = bench.parse_args(SMALL + ["--batch", "4000", "--cr", "4"])
    counts = bench.open_tokens(args, gen)
    assert counts.shape == (4000, 1, 4) and int(counts.min()) == 1
    assert abs(counts.double().mean().item() - 4) < 0.1
    assert abs((counts == 1).double().mean().item() - 0.25) < 0.02
    assert bool((bench.open_tokens(bench.parse_args(SMALL + ["--cr", "1"]), gen) == 1).all())
    full = bench.open_tokens(bench.parse_args(SMALL + ["--full-rings"]), gen)
    assert bool((full == 3).all())


def test_a_kernel_time_is_the_mean_of_its_device_spans():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, us, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [event("_dmc_write_kernel", 8.0), event("_dmc_write_kernel", 12.0),
              event("_dmc_write_kernel", 500.0, DeviceType.CPU),  # its launch on the host
              event("fill_kernel", 3.0)]
    assert bench.mean_kernel_seconds(events, "_dmc_write_kernel") == pytest.approx(10e-6)
    with pytest.raises(ValueError, match="no kernel named like 'other'"):
        bench.mean_kernel_seconds(events, "other")


@pytest.mark.parametrize("seconds, chosen", [({1: 2.0e-5, 4: 2.03e-5}, 4),  # within 2%: kept
                                             ({1: 1.0e-5, 4: 2.0e-5, 8: 3e-5}, 1)])
def test_write_tuning_writes_the_fastest_warps_keeping_the_decode_rows(tmp_path, seconds,
                                                                       chosen):
    from dmc.inference.kernels.tuning import DecodeTuning, KernelTuning, read_tuning, write_tuning

    path = tmp_path / "tuning.json"
    decode = (DecodeTuning(64, 4, 3, 1152), DecodeTuning(128, 8, 2))
    write_tuning(path, KernelTuning("GPU X", decode, source={"paged_decode": "a sweep"}))
    args = bench.parse_args(SMALL)
    args.write_tuning = str(path)  # the flag itself needs CUDA
    bench.write_tuning_file(args, seconds, "GPU X")
    tuning = read_tuning(path)
    assert tuning.write_warps == chosen and tuning.decode == decode
    assert tuning.source["paged_decode"] == "a sweep"
    written = tuning.source["dmc_write"]
    assert written.startswith("benchmarks/write_kernel.py on GPU X")
    assert f"1 warps {seconds[1] * 1e6:.1f} us, 4 warps {seconds[4] * 1e6:.1f} us" in written


def test_a_cpu_run_writes_its_rows(tmp_path, capsys):
    out = tmp_path / "write.json"
    assert bench.main(SMALL + ["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "pytorch" in result["seconds"] and result["programs"] == 24
    assert "ns a head" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--warps", "3"], "--warps: accepted comma separated powers of two"),
    (["--warps", "a"], "--warps: accepted comma separated powers of two"),
    (["--head-dim", "15"], "--head-dim: accepted even values >= 2"),
    (["--window", "0"], "--window: accepted values >= 1"),
    (["--cr", "0.5"], "--cr: accepted finite values >= 1"),
    (["--cr", "inf"], "--cr: accepted finite values >= 1"),
    (["--merge-delay", "-1"], "--merge-delay: accepted values >= 0"),
    (["--write-tuning", "t.json"], "--write-tuning: needs a CUDA device"),
])
def test_bad_flags_exit_2_naming_them(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(SMALL + flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
