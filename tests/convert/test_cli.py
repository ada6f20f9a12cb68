"""``dmc convert``: the three subcommands through the ``dmc`` console entry, the model YAML that
``dmc retrofit`` loads, one-line errors."""
import json

import pytest

transformers = pytest.importorskip("transformers")

from dmc.cli import main  # noqa: E402
from dmc.training.config import load_config  # noqa: E402
from test_hf_roundtrip import LLAMA3, tiny_hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "parallel_1x1")


def test_convert_cli_and_model_yaml(tmp_path, capsys):
    hf = tiny_hf(groups=2, rope_scaling=LLAMA3)
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "mc"),
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert "tokenizer.json" in summary["tokenizer"]
    cfg = load_config([summary["yaml"]], ["data.path=somewhere"])
    assert (cfg.data.seq_length, cfg.data.global_batch_size) == (  # the paper's batch, at most
        min(4096, cfg.model.max_seq_length), 1024)                 # the model's context long
    assert cfg.model.num_query_groups == 2 and cfg.model.rope_scaling_factor == 8.0
    assert cfg.model.rotary_base == 500000.0 and cfg.checkpoint.load_base == str(
        (tmp_path / "mc").resolve())
    assert main(["convert", "mcore-to-hf", str(tmp_path / "mc"), str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "tokenizer.json").is_file()
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["rope_scaling"]["factor"] == 8.0 and back["num_key_value_heads"] == 2

    assert main(["convert", "mcore-to-hf", str(tmp_path / "mc"), str(tmp_path / "back")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    for flags, message in [(["--max-shard-gb", "0"], "--max-shard-gb must be a number > 0"),
                           (["--cr-max-tokens", "1"], "--cr-max-tokens must be >= 2"),
                           (["--cr-text", str(tmp_path / "none.txt")], "none.txt: no such file")]:
        assert main(["convert", "mcore-to-hf", str(tmp_path / "mc"), str(tmp_path / "x"),
                     *flags]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "x").exists()
    assert main(["convert", "nvidia-dmc", str(tmp_path / "hf"), str(tmp_path / "nv")]) == 2
    assert "latest_checkpointed_iteration.txt" in capsys.readouterr().err
    cfg_json = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg_json["rope_scaling"] = dict(LLAMA3, high_freq_factor=2.0)
    cfg_json.pop("rope_parameters", None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg_json))
    assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "mc3")]) == 2
    assert "high_freq_factor=4.0" in capsys.readouterr().err


def test_readme_export_step_with_a_relative_data_path(tiny_data, tmp_path, monkeypatch, capsys):
    """README step 3 as written (no --tokenizer) on a run whose data.path is relative, converted
    from another directory: the tokenizer is found, tokenizer.json written, AutoTokenizer loads
    it without protobuf and encodes as the SentencePiece model does."""
    import shutil

    import sentencepiece

    from conftest import tiny_overrides
    from dmc.training.config import load_config
    from dmc.training.trainer import Trainer

    shutil.copytree(tiny_data, tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    Trainer(load_config([], tiny_overrides("data", "runs/tiny", **{
        "schedule.zero_out_steps": 1, "schedule.retrofit_steps": 2,
        "schedule.solidify_steps": 1})), "retrofit").run()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    (tmp_path / "held.txt").write_text("To be, or not to be, that is the question.\n" * 3)
    assert main(["convert", "mcore-to-hf", "../runs/tiny", "../hf", "--cr-text",
                 "../held.txt", "--json"]) == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert {"tokenizer.model", "tokenizer.json", "tokenizer_config.json"} <= set(
        summary["tokenizer"])
    assert summary["measured_cr"] >= 1.0
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "data" /
                                                             "tokenizer.model"))
    text = "Whether 'tis nobler  in the mind\tto suffer 1601 slings"
    assert tok(text)["input_ids"] == sp.encode(text)
    assert tok.decode(sp.encode(text)) == text


@pytest.mark.parametrize("command", ["hf-to-mcore", "nvidia-dms"])
@pytest.mark.parametrize("text,message", [
    ("[1, 2]", "config.json: not a JSON object (got a list)"),
    ('{"hidden_size": 64,', "config.json: not valid JSON (Expecting property name"),
    ('"llama"', "config.json: not a JSON object (got a str)"),
])
def test_a_bad_config_json_exits_2_naming_the_file(tmp_path, capsys, command, text, message):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(text)
    assert main(["convert", command, str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    assert f"{tmp_path / 'hf' / message}" in capsys.readouterr().err
