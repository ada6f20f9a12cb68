"""`dmc eval compare`: one table for vanilla, DMC, GQA and a KV policy; numbers equal direct
evaluate_perplexity / evaluate_needle calls on the same engines."""
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
SEQ, PREFILL = 48, 24
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
    return main(["eval", "compare", "--vanilla", str(root / "vanilla.pt"), "--data",
                 str(root / "tokens.pt"), "--seq-len", str(SEQ), "--num-sequences", "2",
                 "--num-needles", "3", "--prefill-fraction", "0.5", "--output",
                 str(root / "out"), *extra])


def test_table_json_png_and_numbers(setup, capsys):
    root = setup
    assert run(root, "--dmc", str(root / "dmc.pt"), "--gqa", str(root / "gqa"),
               "--policies", "h2o", "--crs", "2", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads((root / "out" / "compare.json").read_text())
    assert (root / "out" / "compare.png").stat().st_size > 5000
    rows = {r["label"]: r for r in report["results"]}
    assert list(rows) == ["vanilla", "DMC", "GQA", "H2O"]
    assert rows["GQA"]["nominal_cr"] == 2.0 and rows["GQA"]["measured_cr"] == 2.0
    assert rows["vanilla"]["measured_cr"] == 1.0
    assert rows["DMC"]["measured_cr"] > 1.2
    assert rows["H2O"]["nominal_cr"] == 2.0
    assert rows["H2O"]["measured_cr"] == pytest.approx(2.0, abs=0.15)
    table = report["table"].splitlines()
    dmc_cr = rows["DMC"]["nominal_cr"]  # an inference file records no target: measured, to 0.5
    assert dmc_cr == round(rows["DMC"]["measured_cr"] * 2) / 2 and dmc_cr != 2.0
    assert table[0].split() == ["method"] + " ".join(
        f"CR {c:g}x" for c in sorted({1.0, 2.0, dmc_cr})).split()
    assert [line.split()[0] for line in table[1:5]] == ["vanilla", "DMC", "GQA", "H2O"]
    assert f"{rows['GQA']['perplexity']:.2f} / " in table[3]

    stream = torch.load(root / "tokens.pt").tolist()
    sequences = [stream[i * SEQ:(i + 1) * SEQ] for i in range(2)]
    needles = make_needle_examples(stream[:len(stream) // SEQ * SEQ], SEQ, 3, seed=0)
    from dmc.policies import get_policy

    engines = {
        "vanilla": lambda: Engine(load_model(root / "vanilla.pt").model, dmc=None,
                                  max_batch=1, max_seq_len=SEQ),
        "DMC": lambda: Engine(load_model(root / "dmc.pt").model, max_batch=1, max_seq_len=SEQ),
        "GQA": lambda: Engine(load_model(root / "gqa").model, dmc=None, max_batch=1,
                              max_seq_len=SEQ),
        "H2O": lambda: Engine(load_model(root / "vanilla.pt").model, dmc=None, max_batch=1,
                              max_seq_len=SEQ, policy=get_policy("h2o", compression_ratio=2.0)),
    }
    for label, make in engines.items():
        direct = evaluate_perplexity(make(), sequences, prefill_tokens=PREFILL)
        assert rows[label]["perplexity"] == pytest.approx(direct["perplexity"], rel=1e-9), label
        needle = evaluate_needle(make(), needles)
        assert rows[label]["needle"]["answer_nll"] == pytest.approx(needle["answer_nll"],
                                                                    rel=1e-9), label
        assert rows[label]["needle_accuracy"] == needle["accuracy"]


@pytest.mark.parametrize("flags,message", [
    (["--policies", "h2o,nope"], "--policies: unknown nope; accepted: h2o, tova"),
    (["--crs", "2,0.5"], "--crs: expected comma-separated numbers >= 1"),
    (["--prefill-fraction", "0"], r"--prefill-fraction: expected 0 < f <= 1"),
    (["--dmc", "VANILLA"], "is not a DMC model"),
])
def test_bad_flags_name_the_flag(setup, capsys, flags, message):
    flags = [str(setup / "vanilla.pt") if f == "VANILLA" else f for f in flags]
    assert run(setup, "--policies", "none", *flags) == 2  # a later --policies wins
    assert message in capsys.readouterr().err
