"""benchmarks/retrofit_quality.py: the experiment file is checked (bad keys fail naming the key),
and --quick runs the whole pipeline end to end (slow: about 10 minutes on 2 cores)."""
import json
from pathlib import Path

import pytest
import yaml

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_experiment_files_load_and_merge():
    bench = load_benchmark("retrofit_quality")
    main = ROOT / "configs" / "experiments" / "retrofit_quality.yaml"
    full = bench.load_experiment([main], quick=False)
    assert full["dmc_crs"] == [2, 4, 8] and full["gqa_factors"] == [2, 4]
    assert len(full["policies"]) == 9 and full["policy_crs"] == [2, 4, 8]
    e = full["eval"]
    assert len(e["needle_lengths"]) >= 3 and len(e["needle_depths"]) == 5
    assert e["needles_per_cell"] * len(e["needle_lengths"]) * 5 >= 196  # +-7 points at p = 0.5
    # the up-training continues on the base's last stage's data
    assert full["retrofit"]["data"] == full["base"]["stages"][-1]["data"]
    quick = bench.load_experiment([main], quick=True)
    assert quick["eval"]["seq_len"] < full["eval"]["seq_len"] and quick["model_overrides"]
    assert quick["eval"]["prefill_fraction"] == full["eval"]["prefill_fraction"]


ABLATIONS = sorted(p for p in (ROOT / "configs" / "experiments").glob("*.yaml")
                   if p.name != "retrofit_quality.yaml")


@pytest.mark.parametrize("path", ABLATIONS, ids=[p.stem for p in ABLATIONS])
def test_ablation_files_merge_over_the_main_one(path):
    bench = load_benchmark("retrofit_quality")
    main = ROOT / "configs" / "experiments" / "retrofit_quality.yaml"
    full = bench.load_experiment([main], quick=False)
    ablation = bench.load_experiment([main, path], quick=False)
    assert ablation["name"] == path.stem and ablation["data"] == full["data"]
    assert ablation["eval"] == full["eval"]
    if "base" not in yaml.safe_load(path.read_text()):
        assert ablation["base"] == full["base"]


@pytest.mark.parametrize("change,message", [
    ({"extra": 1}, "unknown key extra in the top level"),
    ({"eval": {"seq_len": 8}}, "eval lacks"),
    ({"dmc_crs": [0.5]}, "dmc_crs: expected a list of numbers >= 1"),
    ({"policies": ["h2o", "nope"]}, "--policies: unknown nope"),
    ({"variants": [{"name": "x", "cr": 2}]}, "variant x lacks overrides"),
    ({"variants": [{"name": "x", "cr": 0.5, "overrides": []}]},
     "variant x: cr must be a number >= 1, got 0.5"),
    ({"variants": [{"name": "dmc4", "cr": 4, "overrides": []}]},
     "variants: the name 'dmc4' is given to two runs"),
    ({"variants": [{"name": "x", "cr": 4, "overrides": []}] * 2},
     "variants: the name 'x' is given to two runs"),
    ({"base": {"stages": [{"data": {"vocab": 1}, "overrides": []}]}},
     r"unknown key vocab in base.stages\[0\].data"),
    ({"base": {"overrides": []}}, "unknown key overrides in base"),
    ({"base": {"stages": [{"data": {"seed": 7}, "overrides": []}]}},
     r"unknown key seed in base.stages\[0\].data; .* choose the tokenizer"),
    ({"retrofit": {"overrides": [], "data": {"vocab_size": 7}}},
     r"unknown key vocab_size in retrofit.data; .* choose the tokenizer"),
    ({"retrofit": {"overrides": [], "lr": 1}}, "unknown key lr in retrofit"),
    ({"gqa_factors": [1.5]}, r"gqa_factors: expected whole numbers"),
    ({"retrofit": {"overrides": [], "data": ["needle"]}}, "retrofit.data: expected a mapping"),
    ({"retrofit": {"overrides": [], "data": {"retrieval_loss": "some"}}},
     "retrofit.data.retrieval_loss: 'some' not accepted; choose from all, queries"),
])
def test_bad_experiment_files_name_the_key(tmp_path, change, message):
    bench = load_benchmark("retrofit_quality")
    main = ROOT / "configs" / "experiments" / "retrofit_quality.yaml"
    full = yaml.safe_load(main.read_text())
    if "eval" in change:
        full["eval"] = change["eval"]
        change = {}
    path = write(tmp_path, "exp.yaml", {**full, **change})
    with pytest.raises(ValueError, match=message):
        bench.load_experiment([path], quick=False)
    assert bench.main(["--config", str(path), "--output", str(tmp_path / "out")]) == 2


@pytest.mark.slow
def test_quick_runs_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DMC_CACHE", str(tmp_path / "cache"))
    bench = load_benchmark("retrofit_quality")
    assert bench.main(["--quick", "--output", str(tmp_path / "out"),
                       "--out", str(tmp_path / "r.json")]) == 0
    out = tmp_path / "out" / "table1-quick"
    summary = json.loads((out / "results.json").read_text())
    assert summary == json.loads((tmp_path / "r.json").read_text())
    rows = summary["results"]
    labels = [r["label"] for r in rows]
    assert labels[:2] == ["control", "base"] and labels.count("DMC") == 3
    assert labels.count("GQA") == 2 and len(rows) == 2 + 3 + 2 + 9 * 3
    assert all(r["memory_cr"] > 0 and "needle_ci" in r for r in rows)
    assert (out / "compare" / "compare.png").is_file() and (out / "table.md").is_file()
    assert (out / "dmc_checkpoints.png").is_file() and summary["checkpoints"]
    assert summary["timings_s"]["total"] < 900
    assert "| control | 1x |" in capsys.readouterr().out
    # a second run reuses the cached data and base and the finished training runs
    assert bench.main(["--quick", "--output", str(tmp_path / "out")]) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["timings_s"]["base"] < 5 and again["timings_s"]["train"] < 30
    assert [r["perplexity"] for r in again["results"]] == [r["perplexity"] for r in rows]


def test_a_stage_s_retrieval_loss_reaches_data_prepare(tmp_path, monkeypatch):
    bench = load_benchmark("retrofit_quality")
    monkeypatch.setenv("DMC_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(bench, "run_dmc", lambda args, log: calls.append(args))
    main = bench.load_experiment([ROOT / "configs" / "experiments" / "retrofit_quality.yaml"],
                                 quick=False)["data"]
    plain, queries = (bench.ensure_data(d, print)
                      for d in (main, {**main, "retrieval_loss": "queries"}))
    assert plain != queries  # another folder
    assert [a[a.index("--retrieval-loss") + 1] for a in calls] == ["all", "queries"]


def test_runs_train_on_the_retrofit_data_and_score_on_the_main_data(tmp_path, monkeypatch):
    bench = load_benchmark("retrofit_quality")
    main = ROOT / "configs" / "experiments" / "retrofit_quality.yaml"
    exp = bench.load_experiment([main], quick=False)
    folders = {}  # data settings -> the folder ensure_data returns for them
    monkeypatch.setattr(bench, "load_experiment", lambda paths, quick: exp)
    monkeypatch.setattr(bench, "ensure_data", lambda d, log: folders.setdefault(
        bench._hash(d), tmp_path / f"data-{bench._hash(d)}"))
    monkeypatch.setattr(bench, "ensure_base", lambda exp, log: tmp_path / "base")
    used = {}

    class Stop(Exception):
        pass

    def train_runs(exp, data, base, out, log):
        used["train"] = data
        return {}

    def evaluate(exp, data, base, finals, out, log):
        used["evaluate"] = data
        raise Stop

    monkeypatch.setattr(bench, "train_runs", train_runs)
    monkeypatch.setattr(bench, "evaluate", evaluate)
    with pytest.raises(Stop):
        bench.run(bench.parse_args(["--output", str(tmp_path / "out")]), log=lambda *a: None)
    last_stage = {**exp["data"], **exp["base"]["stages"][-1]["data"]}
    assert used["train"] == folders[bench._hash(last_stage)]
    assert used["evaluate"] == folders[bench._hash(exp["data"])] != used["train"]


def test_runs_are_keyed_by_content_not_by_place(tmp_path, monkeypatch):
    """A base or data cache moved elsewhere keeps its runs; another base gets new ones."""
    from dmc.megatron.checkpoint import write_manifest

    bench = load_benchmark("retrofit_quality")
    main = ROOT / "configs" / "experiments" / "retrofit_quality.yaml"
    exp = {**bench.load_experiment([main], quick=True), "gqa_factors": []}
    monkeypatch.setattr(bench, "run_dmc", lambda args, log_path: {})  # nothing trains

    def run_folders(place, weights=b"weights"):
        base = tmp_path / place / "cache" / "base-x" / "checkpoints" / "pretrain"
        base.mkdir(parents=True, exist_ok=True)
        (base / "__0_0.distcp").write_bytes(weights)
        (base / "state.json").write_text(json.dumps({"run_dir": str(base.parents[1])}))
        write_manifest(base)
        out = tmp_path / place / "out"
        finals = bench.train_runs(exp, tmp_path / place / "cache" / "data-abc", base, out,
                                  log=lambda *a: None)
        return {name: path.relative_to(out) for name, path in finals.items()}

    first = run_folders("a")
    assert set(first) == {"control", *(f"dmc{cr:g}" for cr in exp["dmc_crs"])}
    assert run_folders("elsewhere") == first
    assert set(run_folders("b", b"other weights").values()).isdisjoint(first.values())


def test_quick_refuses_a_file_with_a_budget_of_its_own():
    """--quick replaces the retrofit budget; a budget ablation would silently run the main one."""
    bench = load_benchmark("retrofit_quality")
    experiments = ROOT / "configs" / "experiments"
    with pytest.raises(ValueError, match="--quick: --config .*budget_x4.yaml sets retrofit"):
        bench.load_experiment([experiments / "retrofit_quality.yaml",
                               experiments / "budget_x4.yaml"], quick=True)
    bench.load_experiment([experiments / "retrofit_quality.yaml",
                           experiments / "uneven_layers.yaml"], quick=True)


@pytest.mark.parametrize("writes_zero_out", [True, False])
def test_plain_dmc_runs_share_only_a_complete_zero_out_phase(tmp_path, monkeypatch,
                                                             writes_zero_out):
    """The later plain DMC runs continue the first one's zero_out folder when it is complete;
    when none is written (a run that continued another's, or no zero-out steps) each trains its
    own."""
    from dmc.megatron.checkpoint import write_manifest

    bench = load_benchmark("retrofit_quality")
    main = ROOT / "configs" / "experiments" / "retrofit_quality.yaml"
    exp = {**bench.load_experiment([main], quick=True), "gqa_factors": [], "dmc_crs": [2, 4, 8]}
    base = tmp_path / "base" / "checkpoints" / "pretrain"
    base.mkdir(parents=True)
    (base / "state.json").write_text("{}")
    write_manifest(base)
    calls = []

    def train(args, log_path):
        calls.append(args)
        run_dir = Path(next(a for a in args if a.startswith("run_dir=")).split("=", 1)[1])
        zero_out = run_dir / "checkpoints" / "zero_out"
        if writes_zero_out and "dmc.enabled=true" in args:
            zero_out.mkdir(parents=True)
            (zero_out / "state.json").write_text("{}")
            write_manifest(zero_out)

    monkeypatch.setattr(bench, "run_dmc", train)
    bench.train_runs(exp, tmp_path / "data-abc", base, tmp_path / "out", log=lambda *a: None)
    shared = [[a for a in args if a.startswith("checkpoint.init_from=")] for args in calls]
    first = next(a for a in calls if "dmc.target_cr=2" in a)
    want = (f"checkpoint.init_from={Path(next(a for a in first if a.startswith('run_dir='))[8:])}"
            f"/checkpoints/zero_out")
    assert shared == ([[], [], [want], [want]] if writes_zero_out else [[]] * 4)
