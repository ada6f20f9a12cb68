import pytest

from dmc.cli import main
from dmc.ops import PRIORS
from dmc.training.config import CHOICES, ConfigError, flatten, load_config, parse_override


def test_presets_load_and_merge():
    cfg = load_config(["configs/models/llama2-7b.yaml", "configs/retrofit/cr4.yaml"])
    assert cfg.model.num_layers == 32 and cfg.model.hidden_size == 4096
    assert cfg.dmc.target_cr == 4.0 and cfg.dmc.window == 12 and cfg.dmc.tau == 0.1
    assert cfg.optim.lr == 3e-5 and cfg.optim.adam_eps == 1e-5 and cfg.optim.clip_grad == 1.0
    assert cfg.schedule.zero_out_steps == 250 and cfg.schedule.solidify_steps == 2000
    for name in ("tiny", "llama2-13b", "llama2-70b", "llama3-8b"):
        load_config([f"configs/models/{name}.yaml", "configs/retrofit/cr2.yaml"])
    delayed = load_config(["configs/models/llama2-7b.yaml", "configs/retrofit/cr4.yaml",
                           "configs/retrofit/delay16.yaml"])
    assert delayed.dmc.merge_delay == 16 and delayed.dmc.target_cr == 4.0
    assert delayed.optim == cfg.optim and delayed.schedule == cfg.schedule


def test_a_merge_delay_no_query_would_see_merged_is_refused():
    # at delay seq - 2 the first merged slot (keys 0, 1) would reach position seq, past the end
    assert load_config([], ["data.seq_length=32", "dmc.merge_delay=29"]).dmc.merge_delay == 29
    with pytest.raises(ConfigError, match=r"dmc.merge_delay \(30\) must be < data.seq_length - 2"):
        load_config([], ["data.seq_length=32", "dmc.merge_delay=30"])


def test_overrides_are_typed():
    cfg = load_config([], ["optim.lr=1e-5", "dmc.window=null", "dmc.hard=true", "seed=3"])
    assert cfg.optim.lr == 1e-5 and cfg.dmc.window is None and cfg.dmc.hard is True
    assert parse_override("model.rotary_base=5e5") == ("model.rotary_base", 500000.0)


def test_fidelity_switches_default_to_the_paper():
    cfg = load_config([])
    assert (cfg.dmc.prior, cfg.dmc.hard_loss, cfg.dmc.omega_offset) == ("global", False, 0.0)
    cfg = load_config([], ["dmc.prior=local", "dmc.hard_loss=true", "dmc.omega_offset=0.0078125"])
    assert (cfg.dmc.prior, cfg.dmc.hard_loss, cfg.dmc.omega_offset) == ("local", True, 2**-7)
    assert CHOICES["dmc.prior"] == PRIORS
    assert cfg.dmc.head_cr_cap is None
    assert load_config([], ["dmc.head_cr_cap=32"]).dmc.head_cr_cap == 32
    assert cfg.dmc.head_balance_weight == 0.0
    assert load_config([], ["dmc.head_balance_weight=0.5"]).dmc.head_balance_weight == 0.5


@pytest.mark.parametrize("override,message", [
    ("optim.lrr=1", r"unknown key optim.lrr; accepted keys under optim: .*lr"),
    ("modle.num_layers=2", r"unknown key modle; accepted keys under the top level: .*model"),
    ("precision=fp8", r"precision: 'fp8' is not one of auto, fp32, bf16"),
    ("data.seq_length=abc", r"data.seq_length: expected an integer"),
    ("dmc.target_cr=0.5", r"dmc.target_cr: must be >= 1"),
    ("model.num_query_groups=3", r"model.num_query_groups \(3\) must divide"),
    ("schedule.zero_out_steps=-1", r"schedule.zero_out_steps: must be >= 0"),
    ("dmc.attention_backend=sdpa",
     r"dmc.attention_backend: 'sdpa' is not one of auto, dense, flex, flex-transposed, "
     r"flex-channel"),
    ("dmc.prior=layer", r"dmc.prior: 'layer' is not one of global, local"),
    ("dmc.omega_offset=-0.1", r"dmc.omega_offset: must be >= 0"),
    ("dmc.compile_elementwise=3", r"dmc.compile_elementwise: expected true or false, got 3"),
    ("dmc.head_cr_cap=1", r"dmc.head_cr_cap: must be null or > 1"),
    ("dmc.head_cr_cap=1.5", r"dmc.head_cr_cap: 1.5 is below dmc.target_cr \(2.0\)"),
    ("dmc.head_balance_weight=-1", r"dmc.head_balance_weight: must be >= 0 \(0 = off\)"),
    ("dmc.cr_loss_grad=all", r"dmc.cr_loss_grad: 'all' is not one of model, decisions"),
    ("optim.lr", r"expected KEY=VALUE"),
    ("dmc.target_cr=inf", r"dmc.target_cr: expected a finite number, got inf"),
    ("optim.lr=.nan", r"optim.lr: expected a finite number"),
    ("dmc.c=[1", r"override 'dmc.c=\[1': the value is not a YAML scalar"),
    ("model.rope_scaling_factor=0", r"model.rope_scaling_factor: must be null .* or >= 1, got 0"),
    ("model.rope_scaling_factor=-2", r"model.rope_scaling_factor: must be null .* or >= 1"),
    ("model.init_method_std=-1", r"model.init_method_std: must be > 0, got -1"),
    ("model.init_method_std=0", r"model.init_method_std: must be > 0, got 0"),
    ("optim.adam_eps=-1", r"optim.adam_eps: must be > 0, got -1"),
    ("optim.adam_beta1=1.5", r"optim.adam_beta1: must be in \[0, 1\), got 1.5"),
    ("optim.adam_beta1=-0.1", r"optim.adam_beta1: must be in \[0, 1\), got -0.1"),
    ("optim.adam_beta2=1", r"optim.adam_beta2: must be in \[0, 1\), got 1.0"),
    ("optim.min_lr_ratio=5", r"optim.min_lr_ratio: must be in \[0, 1\], got 5.0"),
    ("optim.min_lr_ratio=-0.5", r"optim.min_lr_ratio: must be in \[0, 1\], got -0.5"),
    ("seed=-1", r"seed: must be in \[0, 4294967296\), got -1"),
    ("seed=4294967296", r"seed: must be in \[0, 4294967296\), got 4294967296"),
])
def test_bad_values_name_the_key_and_accepted_values(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([], [override])


@pytest.mark.parametrize("overrides,message", [
    (["model.max_seq_length=64", "data.seq_length=65"],
     r"data.seq_length \(65\) exceeds model.max_seq_length \(64\)"),
    (["model.num_layers=3", "parallel.pipeline=2"],
     r"parallel.pipeline \(2\) must divide model.num_layers \(3\)"),
    (["data.global_batch_size=6", "data.micro_batch_size=4"],
     r"data.global_batch_size \(6\) must be a multiple of data.micro_batch_size \(4\)"),
], ids=["seq-one-past-max", "layers-not-split-by-pipeline", "global-not-multiple-of-micro"])
def test_inconsistent_sizes_name_both_fields(overrides, message):
    """Sizes that cannot go together are refused naming both fields and their values."""
    with pytest.raises(ConfigError, match=message):
        load_config([], overrides)


@pytest.mark.parametrize("overrides", [
    ["model.max_seq_length=64", "data.seq_length=64"],
    ["model.num_layers=4", "parallel.pipeline=2"],
    ["data.global_batch_size=8", "data.micro_batch_size=4"],
], ids=["seq-equal-to-max", "layers-split-by-pipeline", "global-multiple-of-micro"])
def test_sizes_at_the_bounds_are_accepted(overrides):
    """The consistent neighbours of the refused sizes load as given."""
    cfg = flatten(load_config([], overrides))
    for key, value in map(parse_override, overrides):
        assert cfg[key] == value


def test_cr_loss_grad_decisions_refuses_a_qk_norm():
    assert load_config([], ["dmc.cr_loss_grad=decisions"]).dmc.cr_loss_grad == "decisions"
    with pytest.raises(ConfigError, match="dmc.cr_loss_grad: 'decisions' .* model.qk_layernorm"):
        load_config([], ["dmc.cr_loss_grad=decisions", "model.qk_layernorm=true"])


def test_missing_file():
    with pytest.raises(ConfigError, match="no such file"):
        load_config(["nope.yaml"])


def test_malformed_yaml_exits_2_naming_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layers: [2\n")
    with pytest.raises(ConfigError, match=f"--config {bad}: not valid YAML"):
        load_config([bad])
    assert main(["retrofit", "--config", str(bad), "--dry-run"]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_a_number_key_beside_an_unknown_key_exits_2_naming_it(tmp_path, capsys):
    """YAML keys that are numbers sort with the unknown names (no TypeError)."""
    bad = tmp_path / "keys.yaml"
    bad.write_text("1: 2\nfoo: 3\n")
    with pytest.raises(ConfigError, match="unknown key 1; accepted keys under the top level"):
        load_config([bad])
    assert main(["retrofit", "--config", str(bad), "--dry-run"]) == 2
    assert "unknown key 1" in capsys.readouterr().err


@pytest.mark.parametrize("override", [
    "optim.min_lr_ratio=0", "optim.min_lr_ratio=1", "optim.adam_beta1=0", "optim.adam_beta2=0.999",
    "seed=0", "seed=4294967295", "model.rope_scaling_factor=1", "model.rope_scaling_factor=null",
])
def test_range_bounds_are_accepted(override):
    key, value = parse_override(override)
    assert flatten(load_config([], [override]))[key] == value


def test_non_utf8_config_exits_2_naming_the_file(tmp_path, capsys):
    bad = tmp_path / "bin.yaml"
    bad.write_bytes(b"\xff\xfe model: 1\n")
    with pytest.raises(ConfigError, match=f"--config {bad}: not valid YAML .*utf-8"):
        load_config([bad])
    assert main(["retrofit", "--config", str(bad), "--dry-run"]) == 2
    assert f"--config {bad}: not valid YAML" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["run_dir", "checkpoint.dir", "data.cache_dir"])
@pytest.mark.parametrize("below", ["", "/sub"])
def test_a_file_in_place_of_a_run_folder_exits_2_naming_the_key(tmp_path, capsys, key, below):
    (tmp_path / "file.txt").write_text("not a folder")
    path = f"{tmp_path / 'file.txt'}{below}"
    message = f"{key}: cannot use '{path}': {tmp_path / 'file.txt'} is a file; expected a folder"
    with pytest.raises(ConfigError, match=message):
        load_config([], [f"{key}={path}"])
    assert main(["retrofit", "--dry-run", f"{key}={path}"]) == 2
    assert message in capsys.readouterr().err
    assert load_config([], [f"{key}={tmp_path / 'new' / 'folder'}"])


def test_a_read_only_cache_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("os.access", lambda path, mode: False)
    with pytest.raises(ConfigError, match=f"data.cache_dir: cannot use '{tmp_path}': the folder "
                                          f"is not writable"):
        load_config([], [f"data.cache_dir={tmp_path}"])


def test_cli_dry_run_and_errors(capsys):
    assert main(["retrofit", "--config", "configs/models/tiny.yaml", "--dry-run",
                 "dmc.target_cr=3"]) == 0
    assert "target_cr: 3.0" in capsys.readouterr().out
    assert main(["retrofit", "--dry-run", "dmc.tau=0"]) == 2
    assert "dmc.tau: must be > 0" in capsys.readouterr().err


def test_cli_overrides_may_follow_options(capsys):
    argv = ["pretrain", "--config", "configs/models/tiny.yaml", "seed=5", "--json", "--dry-run",
            "optim.lr=0.002"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert '"seed": 5' in out and '"lr": 0.002' in out
    with pytest.raises(SystemExit):
        main(["pretrain", "--dry-run", "--bogus"])


def test_an_unwritable_run_dir_exits_2_naming_it(tiny_data, capsys):
    from conftest import tiny_overrides

    assert main(["retrofit", *tiny_overrides(tiny_data, "/sys/dmc-run")]) == 2
    assert "cannot use '/sys/dmc-run'" in capsys.readouterr().err


def test_a_file_where_the_run_makes_a_folder_exits_2_naming_it(tiny_data, tmp_path, capsys):
    """A path the config does not name (``<run_dir>/checkpoints``) taken by a file: exit 2."""
    from conftest import tiny_overrides

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("not a folder")
    assert main(["retrofit", *tiny_overrides(tiny_data, str(tmp_path / "run"))]) == 2
    assert f"cannot use '{tmp_path / 'run' / 'checkpoints'}': File exists" in \
        capsys.readouterr().err
