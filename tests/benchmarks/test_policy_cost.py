"""benchmarks/policy_cost.py at the tiny preset: the JSON holds vanilla, every policy and OmniKV
resident, with positive times, and the table it prints."""
import json

import pytest

from dmc.policies import POLICY_NAMES

from conftest import load_benchmark

bench = load_benchmark("policy_cost")

FIELDS = {"mode", "decode_steps", "step_ms", "policy_ms", "overhead", "state_allocated",
          "state_held", "kv", "host", "slots_cr"}


def test_tiny_run_has_every_policy_with_positive_times(parallel_1x1, one_thread, tmp_path,
                                                       capsys):
    out = tmp_path / "cost.json"
    report = bench.main(["--preset", "tiny", "--gen-len", "4", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["vanilla"] + [m for name in POLICY_NAMES
                                        for m in ([name, bench.RESIDENT] if name == "omnikv"
                                                  else [name])]
    for name, row in rows.items():
        assert set(row) == FIELDS, name
        assert row["step_ms"] > 0 and row["policy_ms"] > 0 and row["decode_steps"] >= 1, name
        assert row["overhead"] > 0 and row["kv"] > 0, name
    assert rows["vanilla"]["state_held"] == rows["vanilla"]["state_allocated"] == 0
    assert all(rows[name]["state_allocated"] > 0 for name in POLICY_NAMES)
    assert rows["omnikv"]["host"] > 0 and rows[bench.RESIDENT]["host"] == 0
    assert rows["omnikv"]["kv"] < rows[bench.RESIDENT]["kv"] == rows["vanilla"]["kv"]
    assert rows["h2o"]["slots_cr"] > 2 and rows["vanilla"]["slots_cr"] == 1.0
    assert "| omnikv (resident) |" in capsys.readouterr().out


def test_policies_flag_picks_the_modes():
    args = bench.parse_args(["--preset", "tiny", "--policies", "h2o,snapkv@streaming,omnikv"])
    assert bench.mode_names(args) == ["vanilla", "h2o", "snapkv@streaming", "omnikv",
                                      bench.RESIDENT]


@pytest.mark.parametrize("flags, named", [
    (["--policies", "lru"], "unknown policy 'lru'; valid names"),
    (["--ffn", "0"], "model.ffn_hidden_size: must be > 0"),
    (["--heads", "-1"], "model.num_attention_heads: must be > 0"),
    (["--layers", "0"], "--layers: must be >= 1"),
    (["--cr", "inf"], "--cr: must be a finite number >= 1"),
    (["--gen-len", "2"], "--gen-len: must be >= 3 (the engine step that ends the prefill"),
])
def test_bad_flags_exit_2_naming_them(flags, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--preset", "tiny"] + flags)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
