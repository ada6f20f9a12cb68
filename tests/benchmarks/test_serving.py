"""benchmarks/serving.py: a tiny run end to end (the JSON it writes, the table it prints) and
batched chunked prefill generating the same tokens as one prefill at a time."""
import json

import pytest

from conftest import load_benchmark

bench = load_benchmark("serving")

TINY = ["--requests", "5", "--min-prompt", "3", "--max-prompt", "21", "--gen-len", "3",
        "--layers", "2", "--hidden", "64", "--heads", "4", "--groups", "2", "--ffn", "96",
        "--vocab", "64", "--max-batch", "3", "--chunk-size", "8", "--page-size", "4",
        "--repeats", "1", "--threads", "1"]
FIGURES = {"end_to_end_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_max_s",
           "tokens_per_s", "preemptions"}


def test_tiny_run_writes_every_figure(parallel_1x1, tmp_path, capsys):
    out = tmp_path / "serving.json"
    report = bench.main(TINY + ["--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert set(report) == {"config", "median", "one_at_a_time_over_batched", "runs"}
    assert len(report["config"]["prompt_lengths"]) == 5
    assert all(3 <= n <= 21 for n in report["config"]["prompt_lengths"])
    for name in ("batched", "one-at-a-time"):
        assert set(report["median"][name]) == FIGURES
        assert len(report["runs"][name]) == 1
        assert report["median"][name]["end_to_end_s"] > 0
        assert report["median"][name]["tokens_per_s"] > 0
    assert set(report["one_at_a_time_over_batched"]) == {
        "end_to_end_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s"}
    assert "ratio 1-at-a-time/batched" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["dmc", "vanilla"])
def test_batched_and_one_at_a_time_generate_the_same_tokens(parallel_1x1, one_thread, mode):
    args = bench.parse_args(TINY + ["--mode", mode, "--requests", "8"])
    model = bench.build_model(args)
    prompts = bench.make_prompts(args, args.requests, args.seed + 1)
    _, batched = bench.serve(model, args, True, prompts)
    _, single = bench.serve(model, args, False, prompts)
    assert [r.tokens for r in batched] == [r.tokens for r in single]
    assert all(len(r.tokens) == args.gen_len for r in batched)
