"""benchmarks/serving.py: a tiny run end to end (the JSON it writes, the table it prints) for
both comparisons; batched chunked prefill generating the same tokens as one prefill at a time;
overlapped steps going on as requests of mixed budgets end."""
import json

import pytest

from conftest import load_benchmark

bench = load_benchmark("serving")

TINY = ["--requests", "5", "--min-prompt", "3", "--max-prompt", "21", "--gen-len", "3",
        "--layers", "2", "--hidden", "64", "--heads", "4", "--groups", "2", "--ffn", "96",
        "--vocab", "64", "--max-batch", "3", "--chunk-size", "8", "--page-size", "4",
        "--repeats", "1", "--threads", "1"]
FIGURES = {"end_to_end_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_max_s",
           "itl_p50_s", "itl_p99_s", "tpot_mean_s", "tokens_per_s", "preemptions",
           "continued_fraction"}


@pytest.mark.parametrize("compare,engines", [("prefill", ("batched", "one-at-a-time")),
                                             ("overlap", ("graphs", "graphs+overlap"))])
def test_tiny_run_writes_every_figure(parallel_1x1, tmp_path, capsys, compare, engines):
    out = tmp_path / "serving.json"
    report = bench.main(TINY + ["--compare", compare, "--min-gen", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert set(report) == {"config", "median", "ratio", "ratios", "runs"}
    assert len(report["config"]["prompt_lengths"]) == 5
    assert all(3 <= n <= 21 for n in report["config"]["prompt_lengths"])
    assert all(2 <= n <= 3 for n in report["config"]["new_token_budgets"])
    for name in engines:
        assert set(report["median"][name]) == FIGURES
        assert len(report["runs"][name]) == 1
        assert report["median"][name]["end_to_end_s"] > 0
        assert report["median"][name]["tokens_per_s"] > 0
        figures = report["median"][name]
        assert 0 <= figures["itl_p50_s"] <= figures["itl_p99_s"] <= figures["end_to_end_s"]
        assert 0 < figures["tpot_mean_s"] < figures["end_to_end_s"]
    assert set(report["ratios"]) == {"end_to_end_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s",
                                     "itl_p50_s", "itl_p99_s", "tpot_mean_s"}
    assert report["ratio"] == f"{engines[1]} / {engines[0]}"
    assert f"ratio {engines[1]} / {engines[0]}" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["dmc", "vanilla"])
def test_batched_and_one_at_a_time_generate_the_same_tokens(parallel_1x1, one_thread, mode):
    args = bench.parse_args(TINY + ["--mode", mode, "--requests", "8"])
    model = bench.build_model(args)
    prompts = bench.make_prompts(args, args.requests, args.seed + 1)
    params = bench.make_params(args, args.requests, args.seed + 3)
    engines = bench.COMPARISONS["prefill"].values()
    (_, batched), (_, single) = (bench.serve(model, args, e, prompts, params) for e in engines)
    assert [r.tokens for r in batched] == [r.tokens for r in single]
    assert all(len(r.tokens) == args.gen_len for r in batched)


def test_overlap_goes_on_as_requests_of_mixed_budgets_end(parallel_1x1, one_thread):
    """The overlapped engine gives the same tokens, and continues most of its decode steps
    although the requests end at different steps (the engine without overlap continues
    none)."""
    args = bench.parse_args(TINY + ["--requests", "8", "--min-gen", "4", "--gen-len", "16"])
    model = bench.build_model(args)
    prompts = bench.make_prompts(args, args.requests, args.seed + 1)
    params = bench.make_params(args, args.requests, args.seed + 3)
    assert len({p.max_new_tokens for p in params}) > 3
    engines = bench.COMPARISONS["overlap"].values()
    (plain, plain_results), (overlap, results) = (bench.serve(model, args, e, prompts, params)
                                                  for e in engines)
    assert [r.tokens for r in results] == [r.tokens for r in plain_results]
    assert plain["continued_fraction"] == 0 and overlap["continued_fraction"] > 0.5
