"""`dmc eval compare`: one table for the control, DMC, GQA and a KV policy; numbers equal direct
evaluate_perplexity / evaluate_needle calls on the same engines; the control against itself has
KL 0, top-1 agreement 1 and compression 1."""
import json

import pytest
import torch

from dmc.baselines import convert_to_gqa
from dmc.cli import main
from dmc.data.needle import make_needle_examples
from dmc.eval import evaluate_perplexity
from dmc.eval.needle import evaluate_needle
from dmc.inference import Engine, save_inference_state
from dmc.inference.loading import load_model
from tiny_models import VOCAB, build_tiny

pytestmark = pytest.mark.usefixtures("one_thread")
SEQ, PREFILL, NEEDLE_LENGTHS = 48, 24, (40, 48)
CONFIG = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 96,
          "vocab_size": VOCAB, "max_seq_length": 160}


@pytest.fixture(scope="module")
def setup(parallel_1x1, tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    vanilla, _ = build_tiny(4, seed=1)
    save_inference_state(root / "vanilla.pt", vanilla, dict(CONFIG, num_query_groups=4))
    dmc, _ = build_tiny(4, window=3, c=-1.0, seed=1)
    save_inference_state(root / "dmc.pt", dmc, dict(CONFIG, num_query_groups=4),
                         {"window": 3, "c": -1.0})
    convert_to_gqa(root / "vanilla.pt", 2, root / "gqa")
    stream = torch.randint(0, VOCAB, (2000,), generator=torch.Generator().manual_seed(0))
    torch.save(stream, root / "tokens.pt")
    return root


def run(root, *extra):
    return main(["eval", "compare", "--control", str(root / "vanilla.pt"), "--data",
                 str(root / "tokens.pt"), "--seq-len", str(SEQ), "--num-sequences", "3",
                 "--needle-lengths", ",".join(map(str, NEEDLE_LENGTHS)), "--needle-depths",
                 "0.2,0.8", "--needles-per-cell", "2", "--batch-size", "2",
                 "--prefill-fraction", "0.5", "--output", str(root / "out"), *extra])


def test_table_json_png_and_numbers(setup, capsys):
    root = setup
    assert run(root, "--dmc", str(root / "dmc.pt"), "--gqa", str(root / "gqa"),
               "--policies", "h2o", "--crs", "2", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads((root / "out" / "compare.json").read_text())
    assert (root / "out" / "compare.png").stat().st_size > 5000
    assert (root / "out" / "compare.md").read_text().startswith("| method | CR |")
    rows = {r["label"]: r for r in report["results"]}
    assert list(rows) == ["control", "DMC", "GQA", "H2O"]
    control = rows["control"]
    assert (control["kl"], control["top1_agreement"]) == (0.0, 1.0)
    assert control["slots_cr"] == control["memory_cr"] == 1.0
    assert rows["GQA"]["nominal_cr"] == 2.0 and rows["GQA"]["slots_cr"] == 2.0
    assert rows["GQA"]["memory_cr"] == pytest.approx(2.0)  # half the heads: pages and tables
    assert rows["DMC"]["slots_cr"] > 1.2
    assert rows["DMC"]["memory_cr"] < rows["DMC"]["slots_cr"]  # the merge state costs bytes
    assert rows["H2O"]["nominal_cr"] == 2.0
    assert rows["H2O"]["slots_cr"] == pytest.approx(2.0, abs=0.15)
    for label in ("DMC", "GQA", "H2O"):
        assert rows[label]["kl"] > 0 and rows[label]["top1_agreement"] < 1, label
    assert report["settings"]["prefill_tokens"] == PREFILL
    assert rows["DMC"]["needle"]["examples"] == 2 * 2 * len(NEEDLE_LENGTHS)
    assert list(rows["DMC"]["needle"]["per_length"]) == [str(n) for n in NEEDLE_LENGTHS]
    table = report["table"].splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]][0] == "control"
    gqa_line = next(line for line in table if line.startswith("| GQA |"))
    assert f"{rows['GQA']['perplexity']:.2f} [" in gqa_line

    stream = torch.load(root / "tokens.pt").tolist()
    sequences = [stream[i * SEQ:(i + 1) * SEQ] for i in range(3)]
    needles = [ex for n in NEEDLE_LENGTHS for ex in make_needle_examples(
        stream[:len(stream) // n * n], n, 4, depths=(0.2, 0.8), seed=n)]
    from dmc.policies import get_policy

    def engine(path, batch, **kw):
        return Engine(load_model(root / path).model, max_batch=batch, max_seq_len=SEQ, **kw)

    engines = {
        "control": lambda b: engine("vanilla.pt", b, dmc=None),
        "DMC": lambda b: engine("dmc.pt", b),
        "GQA": lambda b: engine("gqa", b, dmc=None),
        "H2O": lambda b: engine("vanilla.pt", b, dmc=None,
                                policy=get_policy("h2o", compression_ratio=2.0)),
    }
    reference = evaluate_perplexity(engines["control"](1), sequences, prefill_tokens=PREFILL,
                                    keep_logprobs=True)["logprobs"]
    for label, make in engines.items():  # one sequence at a time: batching changes nothing
        direct = evaluate_perplexity(make(1), sequences, prefill_tokens=PREFILL,
                                     reference=reference)
        for key in ("perplexity", "kl", "top1_agreement"):  # float32 sums in another order
            assert rows[label][key] == pytest.approx(direct[key], rel=1e-6, abs=1e-7), label
        needle = evaluate_needle(make(1), needles)
        assert rows[label]["needle"]["answer_nll"] == pytest.approx(needle["answer_nll"],
                                                                    rel=1e-6), label
        assert rows[label]["needle_accuracy"] == needle["accuracy"]


def test_workers_give_the_same_rows(setup, capsys):
    """Rows scored by two worker processes equal those scored in this one (a row's evaluation
    is independent of the others; float32 sums may differ in the last bits)."""
    rows = {}
    for workers in ("1", "2"):
        assert run(setup, "--dmc", str(setup / "dmc.pt"), "--gqa", str(setup / "gqa"),
                   "--policies", "h2o", "--crs", "2", "--workers", workers, "--json") == 0
        rows[workers] = json.loads(capsys.readouterr().out)["results"]
    assert [r["label"] for r in rows["2"]] == ["control", "DMC", "GQA", "H2O"]
    for one, two in zip(rows["1"], rows["2"]):
        assert one["needle"] == two["needle"] and one["slots_cr"] == two["slots_cr"]
        for key in ("perplexity", "kl", "top1_agreement", "memory_cr"):
            assert two[key] == pytest.approx(one[key], rel=1e-6, abs=1e-7), (one["label"], key)


def test_a_repeated_checkpoint_flag_adds_rows():
    import argparse

    from dmc.eval.compare import add_compare_arguments

    parser = add_compare_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--control", "c", "--data", "d", "--dmc", "a", "b", "--dmc", "e",
                              "--gqa", "g", "--gqa", "h"])
    assert args.dmc == ["a", "b", "e"] and args.gqa == ["g", "h"]


def test_dmc_checkpoints_are_labelled_by_their_method(setup):
    """A DMS model given with --dmc is a DMS row (a vanilla one: test_bad_flags_...)."""
    import argparse

    from dmc.eval.compare import methods_from_args

    root = setup
    dmc, _ = build_tiny(4, window=3, c=-1.0, seed=1)
    save_inference_state(root / "dms.pt", dmc, dict(CONFIG, num_query_groups=4),
                         {"method": "dms", "dms_window": 4, "c": 0.0})
    args = argparse.Namespace(control=str(root / "vanilla.pt"), base=None, gqa=[], crs="2",
                              policies="none", dmc=[str(root / "dmc.pt"), str(root / "dms.pt")])
    assert [m.label for m in methods_from_args(args)] == ["control", "DMC", "DMS"]


@pytest.mark.parametrize("flags,message", [
    (["--policies", "h2o,nope"], "--policies: unknown nope; accepted: h2o, tova"),
    (["--policies", "snapkv@later"],
     "--policies: snapkv@later: schedule must be one of ['prefill', 'streaming'], got 'later'"),
    (["--crs", "2,0.5"], "--crs: expected comma-separated distinct numbers in [1, inf)"),
    (["--crs", "2,2"], "--crs: expected comma-separated distinct numbers in [1, inf)"),
    (["--needle-lengths", "40,40"],
     "--needle-lengths: expected comma-separated distinct numbers in [32, inf)"),
    (["--data", "ROWS"], "its rows hold 30 tokens, --seq-len=48; pass --seq-len 30"),
    (["--prefill-fraction", "0"], r"--prefill-fraction: expected 0 < f < 1"),
    (["--needle-depths", "0.5,2"],
     "--needle-depths: expected comma-separated distinct numbers in [0, 1]"),
    (["--dmc", "VANILLA"], "is not a DMC model"),
    (["--workers", "0"], "--workers: must be >= 1, got 0"),
    (["--crs", "2,inf"], "--crs: expected comma-separated distinct numbers in [1, inf)"),
    (["--needles-per-cell", "400"], "--needle-lengths 40 / --needles-per-cell 400 over --data"),
    (["--base", "BF16"], "its weights, and so its cache, are bfloat16, the control's float32"),
    (["--base", "DMC"], "dmc.pt is a DMC model"),
])
def test_bad_flags_name_the_flag(setup, capsys, flags, message):
    torch.save(torch.zeros(4, 30, dtype=torch.long), setup / "rows.pt")
    if not (setup / "bf16.pt").exists():  # the control's weights in another precision
        vanilla, _ = build_tiny(4, seed=1)
        save_inference_state(setup / "bf16.pt", vanilla.to(torch.bfloat16),
                             dict(CONFIG, num_query_groups=4, params_dtype="bfloat16"))
    paths = {"VANILLA": setup / "vanilla.pt", "ROWS": setup / "rows.pt", "BF16": setup / "bf16.pt",
             "DMC": setup / "dmc.pt"}
    flags = [str(paths[f]) if f in paths else f for f in flags]
    assert run(setup, "--policies", "none", *flags) == 2  # a later --policies wins
    assert message in capsys.readouterr().err


def test_a_policy_that_keeps_every_page_is_reported_at_1x():
    """OmniKV at --crs 2,4 holds every page: its rows sit at 1x with the share of tokens it
    attends to in the name, never in the 2x / 4x columns."""
    from dmc.eval.compare import Method, _row_labels, format_table, nominal_cr

    assert nominal_cr(Method("policy", "OMNIKV", policy="omnikv", cr=4.0), None, 4, 1.0) == 1.0
    assert nominal_cr(Method("policy", "H2O", policy="h2o", cr=4.0), None, 4, 3.9) == 4.0
    results = [{"method": kind, "label": label, "requested_cr": cr, "nominal_cr": nominal,
                "perplexity": 10.0, "perplexity_ci": [9.0, 11.0], "kl": 0.1,
                "top1_agreement": 0.9, "slots_cr": slots, "memory_cr": slots}
               for kind, label, cr, nominal, slots in [("control", "control", None, 1.0, 1.0),
                                                       ("policy", "OMNIKV", 2.0, 1.0, 1.0),
                                                       ("policy", "OMNIKV", 4.0, 1.0, 1.0),
                                                       ("policy", "H2O", 2.0, 2.0, 2.0)]]
    _row_labels(results)
    lines = format_table(results).splitlines()[2:]
    cells = [[c.strip() for c in line.split("|")[1:3]] for line in lines]
    assert cells == [["control", "1x"], ["OMNIKV (attends 1/2)", "1x"],
                     ["OMNIKV (attends 1/4)", "1x"], ["H2O", "2x"]]


def test_steps_to_cr_column_only_when_a_row_has_it():
    from dmc.eval.compare_report import format_table

    base = {"requested_cr": None, "perplexity": 10.0, "perplexity_ci": [9.0, 11.0], "kl": 0.1,
            "top1_agreement": 0.9, "slots_cr": 1.0, "memory_cr": 1.0}
    rows = [{**base, "method": "control", "label": "control", "nominal_cr": 1.0},
            {**base, "method": "dmc", "label": "DMC", "nominal_cr": 4.0, "steps_to_cr": 212},
            {**base, "method": "dmc", "label": "DMS", "nominal_cr": 8.0, "steps_to_cr": None}]
    table = format_table(rows).splitlines()
    assert table[0].endswith("| steps to CR |")
    assert [line.split("|")[-2].strip() for line in table[2:]] == ["-", "212", "never"]
    assert "steps to CR" not in format_table(rows[:1])


def test_policies_are_spelled_with_their_schedule():
    """--policies NAME (the paper's schedule) or NAME@SCHEDULE; each row records its schedule."""
    from dmc.eval.compare import Method, _row_labels, nominal_cr, parse_policies, schedule_of

    assert parse_policies("SnapKV, snapkv@streaming,h2o@prefill/4") == [
        "snapkv", "snapkv@streaming", "h2o@prefill/4"]
    rows = [Method("policy", spec.upper(), policy=spec, cr=4.0)
            for spec in ("snapkv", "snapkv@streaming", "d2o", "omnikv@prefill")]
    assert [schedule_of(m) for m in rows] == ["prefill", "streaming", "prefill/1", "prefill"]
    assert [nominal_cr(m, None, 4, 3.0) for m in rows] == [4.0, 4.0, 4.0, 1.0]
    assert schedule_of(Method("control", "control", "x")) is None
    results = [{"method": "policy", "label": m.label, "requested_cr": 4.0, "schedule": schedule,
                "nominal_cr": nominal_cr(m, None, 4, 3.0)}
               for m, schedule in zip(rows, ["prefill", "streaming", "prefill/1", "prefill"])]
    _row_labels(results)
    assert [r["row"] for r in results] == ["SNAPKV (prefill)", "SNAPKV@STREAMING",
                                           "D2O (prefill/1)", "OMNIKV@PREFILL (attends 1/4)"]


def test_nominal_cr_of_gqa_is_the_kv_head_ratio_and_of_dmc_its_target():
    """GQA is reported at control KV heads / its KV heads; DMC at its checkpoint's target_cr,
    or, with none recorded, the measured CR rounded to the nearest 0.5."""
    from types import SimpleNamespace

    from dmc.eval.compare import Method, nominal_cr

    def loaded(kv_heads, **state):
        return SimpleNamespace(model_config=SimpleNamespace(kv_heads=kv_heads), state=state)

    gqa = Method("gqa", "GQA", "x")
    assert nominal_cr(gqa, loaded(1), 8, 7.9) == 8.0
    assert nominal_cr(gqa, loaded(2), 8, 3.9) == 4.0
    dmc = Method("dmc", "DMC", "x")
    assert nominal_cr(dmc, loaded(8, target_cr=4), 8, 3.3) == 4.0
    for measured, nominal in [(3.3, 3.5), (3.2, 3.0), (6.8, 7.0), (1.74, 1.5)]:
        assert nominal_cr(dmc, loaded(8), 8, measured) == nominal


def test_prefill_tokens_leave_at_least_one_decoded_prediction():
    """round(fraction * seq_len), at least 1 and at most seq_len - 2, so that
    evaluate_perplexity's 1 <= prefill_tokens < seq_len - 1 holds."""
    from dmc.eval.compare import prefill_tokens

    assert prefill_tokens(100, 0.999) == 98
    assert prefill_tokens(100, 0.5) == 50
    assert prefill_tokens(100, 0.001) == 1
    for seq_len in range(3, 40):
        for fraction in (0.01, 0.3, 0.9, 0.99):
            assert 1 <= prefill_tokens(seq_len, fraction) < seq_len - 1


REPORT_ROW = {"method": "dmc", "label": "DMC", "requested_cr": None, "nominal_cr": 4.0,
              "perplexity": 10.0, "perplexity_ci": [9.0, 11.0], "kl": 0.1,
              "top1_agreement": 0.9, "slots_cr": 4.0, "memory_cr": 3.5}


def _cells(line):
    return [cell.strip() for cell in line.split("|")[1:-1]]


def test_table_cells_sit_under_their_headers():
    """Each cell of format_table's row under its own header (slots CR and memory CR differ)."""
    from dmc.eval.compare_report import format_table

    row = dict(REPORT_ROW, needle_accuracy=0.625, needle_ci=[0.3, 0.85])
    lines = format_table([row]).splitlines()
    assert lines[1] == "|" + "---|" * 8
    assert dict(zip(_cells(lines[0]), _cells(lines[2]))) == {
        "method": "DMC", "CR": "4x", "ppl [95% CI]": "10.00 [9.00, 11.00]",
        "KL vs control": "0.1000", "top-1 agree": "90.0%", "needle % [95% CI]": "62.5 [30.0, 85.0]",
        "slots CR": "4.00x", "memory CR": "3.50x"}


def test_needle_table_gives_percent_per_length():
    """format_needle_table: accuracy and its Wilson interval in whole percent, per length."""
    from dmc.eval.compare_report import format_needle_table

    row = dict(REPORT_ROW, needle={"per_length": {
        "40": {"accuracy": 0.75, "accuracy_ci": [0.3, 0.95]},
        "48": {"accuracy": 0.2, "accuracy_ci": [0.02, 0.47]}}})
    lines = format_needle_table([row]).splitlines()
    assert _cells(lines[0]) == ["method", "CR", "40 tokens", "48 tokens"]
    assert _cells(lines[2]) == ["DMC", "4x", "75 [30, 95]", "20 [2, 47]"]
    assert format_needle_table([REPORT_ROW]) == ""


def test_a_label_at_two_crs_gets_no_number_and_a_repeat_at_one_cr_does():
    """Row names: one policy at 2x and 4x keeps its label in both rows; a second result with
    the same label and CR is "#2"."""
    from dmc.eval.compare_report import _row_labels

    rows = [dict(REPORT_ROW, method="policy", label="H2O", requested_cr=cr, nominal_cr=cr)
            for cr in (2.0, 4.0, 2.0)]
    _row_labels(rows)
    assert [r["row"] for r in rows] == ["H2O", "H2O", "H2O #2"]
