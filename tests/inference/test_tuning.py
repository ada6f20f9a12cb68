"""dmc.inference.kernels.tuning: the per-GPU launch settings of the Triton kernels (rows by head
length, the file format and its errors, the shipped files, ``DMC_KERNEL_TUNING``), and the
kernels taking them when no setting is given (through the interpreter, the device "triton
interpreter")."""
import json
import re

import pytest
import torch

from dmc.inference.kernels import paged_decode_reference
from dmc.inference.kernels.tuning import (
    ENV,
    INTERPRETER,
    SHIPPED,
    DecodeTuning,
    KernelTuning,
    pick_fastest,
    read_tuning,
    shipped_tunings,
    tuning_for,
    update_tuning,
    write_tuning,
)
from test_kernels import TOLERANCE, random_paged_kv

ROWS = (DecodeTuning(16, 2, 2, 100), DecodeTuning(32, 4, 3, 1000), DecodeTuning(64, 8, 4))


def test_a_launch_takes_the_first_row_for_as_many_heads_and_the_last_beyond():
    tuning = KernelTuning("GPU X", ROWS)
    assert [tuning.decode_for(n).block_n for n in (1, 100, 101, 1000, 1001, 10**6)] == [
        16, 16, 32, 32, 64, 64]
    bounded = KernelTuning("GPU X", ROWS[:2])
    assert bounded.decode_for(5000) == ROWS[1]  # beyond every bound: the last row


def test_a_file_round_trips(tmp_path):
    tuning = KernelTuning("GPU X", ROWS, write_warps=2,
                          source={"paged_decode": "a sweep", "dmc_write": "a timing"})
    write_tuning(tmp_path / "t.json", tuning)
    assert read_tuning(tmp_path / "t.json") == tuning
    partial = tmp_path / "partial.json"  # sections left out: the defaults
    partial.write_text(json.dumps({"device": "GPU X"}))
    assert read_tuning(partial) == KernelTuning("GPU X")


GOOD = {"device": "GPU X", "paged_decode": [{"max_heads": None, "block_n": 64, "num_warps": 4,
                                              "num_stages": 3}], "dmc_write": {"num_warps": 4}}


def _row(**change):
    return dict(GOOD["paged_decode"][0], **change)


@pytest.mark.parametrize("change, field", [
    ({"device": None}, "device"),
    ({"colour": 1}, "keys"),
    ({"paged_decode": [_row(block_n=48)]}, "paged_decode.block_n"),
    ({"paged_decode": [_row(block_n=8)]}, "paged_decode.block_n"),
    ({"paged_decode": [_row(num_warps=3)]}, "paged_decode.num_warps"),
    ({"paged_decode": [_row(num_stages=0)]}, "paged_decode.num_stages"),
    ({"paged_decode": [_row(max_heads=0)]}, "paged_decode.max_heads"),
    ({"paged_decode": [_row(slots=4)]}, "paged_decode[] keys"),
    ({"paged_decode": []}, "paged_decode"),
    ({"paged_decode": [_row(max_heads=None), _row(max_heads=500)]},
     "paged_decode[].max_heads"),
    ({"paged_decode": [_row(max_heads=900), _row(max_heads=500)]},
     "paged_decode[].max_heads"),
    ({"dmc_write": {"num_warps": 5}}, "dmc_write.num_warps"),
    ({"dmc_write": {"warps": 4}}, "dmc_write"),
    ({"source": {"paged_kernel": "x"}}, "source"),
])
def test_a_bad_file_names_the_field_and_what_it_accepts(tmp_path, change, field):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(dict(GOOD, **change)))
    with pytest.raises(ValueError, match=re.escape(f"{field}: accepted")) as error:
        read_tuning(path)
    assert str(path) in str(error.value)


def test_the_shipped_files_are_valid_and_one_per_gpu():
    files = sorted(SHIPPED.glob("*.json"))
    assert files, "no shipped tuning file"
    tunings = [read_tuning(path) for path in files]
    assert len({t.device for t in tunings}) == len(files) == len(shipped_tunings())
    for path, tuning in zip(files, tunings):  # named after the GPU, each section sourced
        assert path.stem == re.sub(r"[^a-z0-9]+", "-", tuning.device.lower())
        assert tuning.source.get("paged_decode"), path


def test_the_interpreter_gets_the_defaults_or_the_file_the_environment_names(tmp_path,
                                                                             monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert tuning_for(torch.device("cpu")) == KernelTuning(INTERPRETER)
    path = tmp_path / "mine.json"
    write_tuning(path, KernelTuning(INTERPRETER, ROWS, write_warps=2))
    monkeypatch.setenv(ENV, str(path))
    assert tuning_for(torch.device("cpu")).decode == ROWS
    other = tmp_path / "other.json"
    write_tuning(other, KernelTuning("NVIDIA H100 80GB HBM3"))
    monkeypatch.setenv(ENV, str(other))
    with pytest.raises(ValueError, match="is for 'NVIDIA H100 80GB HBM3', this device is "
                                         "'triton interpreter'"):
        tuning_for(torch.device("cpu"))


def test_update_keeps_the_other_section_and_refuses_another_gpus_file(tmp_path):
    path = tmp_path / "t.json"
    update_tuning(path, "GPU X", "dmc_write", "timed", write_warps=8)  # a new file
    update_tuning(path, "GPU X", "paged_decode", "swept", decode=ROWS)
    assert read_tuning(path) == KernelTuning("GPU X", ROWS, 8, {"dmc_write": "timed",
                                                                 "paged_decode": "swept"})
    with pytest.raises(ValueError, match="is for 'GPU X', this device is 'GPU Y'"):
        update_tuning(path, "GPU Y", "dmc_write", "timed", write_warps=2)


def test_pick_fastest_keeps_the_default_within_the_margin():
    assert pick_fastest({"a": 1.0, "b": 1.015}, default="b") == "b"
    assert pick_fastest({"a": 1.0, "b": 1.03}, default="b") == "a"
    assert pick_fastest({"a": 1.0, "c": 0.9}, default="b") == "c"  # default not timed


class LaunchRecorder:
    """Stands in for a Triton kernel: records each launch's keyword settings, then runs it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_paged_decode_launches_with_the_row_for_its_heads(tmp_path, monkeypatch):
    """3 sequences x 2 KV heads take the first row (up to 6 heads), 4 x 2 the second."""
    import dmc.inference.kernels.paged_decode as module

    path = tmp_path / "t.json"
    write_tuning(path, KernelTuning(INTERPRETER, (DecodeTuning(16, 2, 2, 6),
                                                  DecodeTuning(32, 8, 3))))
    monkeypatch.setenv(ENV, str(path))
    recorder = LaunchRecorder(module._decode_split_kernel)
    monkeypatch.setattr(module, "_decode_split_kernel", recorder)
    gen = torch.Generator().manual_seed(0)
    for batch in (3, 4):
        lengths = torch.randint(1, 90, (batch, 2), generator=gen)
        paged = random_paged_kv(lengths, 32, 16, torch.float32, gen)
        q = torch.randn(batch, 4, 32, generator=gen)
        out = module.paged_decode(q, *paged, 0.2, num_splits=1)
        torch.testing.assert_close(out, paged_decode_reference(q, *paged, 0.2),
                                   **TOLERANCE[torch.float32])
    assert [(k["BLOCK_N"], k["num_warps"], k["num_stages"]) for k in recorder.launches] == [
        (16, 2, 2), (32, 8, 3)]
    module.paged_decode(q, *paged, 0.2, num_splits=1, block_n=64)  # a setting given wins
    assert (recorder.launches[-1]["BLOCK_N"], recorder.launches[-1]["num_warps"]) == (64, 8)


def test_the_dmc_write_launches_with_the_files_warps(tmp_path, monkeypatch):
    from conftest import load_benchmark

    import dmc.inference.kernels.dmc_write as module

    path = tmp_path / "t.json"
    write_tuning(path, KernelTuning(INTERPRETER, write_warps=2))
    monkeypatch.setenv(ENV, str(path))
    recorder = LaunchRecorder(module._dmc_write_kernel)
    monkeypatch.setattr(module, "_dmc_write_kernel", recorder)
    bench = load_benchmark("write_kernel")
    args = bench.parse_args(["--batch", "2", "--kv-heads", "2", "--head-dim", "16", "--length",
                             "20", "--window", "3", "--iters", "1", "--dtype", "float32"])
    call_args, _ = bench.deferred_write(args, torch.device("cpu"))
    module.dmc_write(**call_args)
    module.dmc_write(**call_args, num_warps=8)
    assert [k["num_warps"] for k in recorder.launches] == [2, 8]
