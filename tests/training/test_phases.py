import pytest

from dmc.cli import main
from dmc.training.config import ConfigError, load_config
from dmc.training.phases import PhasePlan


def test_phase_ranges_follow_the_schedule():
    cfg = load_config([], ["schedule.zero_out_steps=2", "schedule.retrofit_steps=5",
                           "schedule.solidify_steps=3", "schedule.pretrain_steps=4"])
    plan = PhasePlan(cfg, "retrofit")
    assert plan.ranges == {"zero_out": (0, 2), "retrofit": (2, 7), "solidify": (7, 10)}
    assert [plan.phase_of(s) for s in (0, 2, 6, 7, 9)] == ["zero_out", "retrofit", "retrofit",
                                                          "solidify", "solidify"]
    assert plan.target_cr(1) == 1.0 and plan.target_cr(6) == cfg.dmc.target_cr
    assert PhasePlan(cfg, "pretrain").total_steps == 4


@pytest.mark.parametrize("kind, overrides, field", [
    ("pretrain", [], "schedule.pretrain_steps is 0"),
    ("retrofit", ["schedule.zero_out_steps=0", "schedule.retrofit_steps=0",
                  "schedule.solidify_steps=0"], "schedule.zero_out_steps \\+ retrofit_steps"),
])
def test_a_run_without_steps_is_refused(kind, overrides, field):
    with pytest.raises(ConfigError, match=f"the {kind} run has no steps: {field}"):
        PhasePlan(load_config([], overrides), kind)


def test_the_cli_refuses_it_before_creating_the_run(tmp_path, capsys):
    """``dmc pretrain`` without ``schedule.pretrain_steps`` (default 0) used to finish at once
    with an empty run folder."""
    run_dir = tmp_path / "run"
    assert main(["pretrain", f"run_dir={run_dir}", f"data.path={tmp_path}"]) == 2
    assert "schedule.pretrain_steps is 0; set it >= 1" in capsys.readouterr().err
    assert not run_dir.exists()


def test_zero_out_scale_and_retrofit_target_cr_follow_the_linear_references():
    """Eq. 12: zero-out step t scales by 1 - t/Z; retrofit step s reaches 1 + (CR-1)(s-Z+1)/R."""
    z, r, s, cr = 4, 5, 2, 3.0
    cfg = load_config([], [f"schedule.zero_out_steps={z}", f"schedule.retrofit_steps={r}",
                           f"schedule.solidify_steps={s}", f"dmc.target_cr={cr}"])
    plan = PhasePlan(cfg, "retrofit")
    for t in range(z):
        step = plan.at(t)
        assert (step.phase, step.mode, step.target_cr) == ("zero_out", "zero_out", 1.0)
        assert step.zero_out_scale == pytest.approx(1.0 - t / z, abs=1e-12), t
    for t in range(z, z + r + s):
        want = 1.0 + (cr - 1.0) * min(t - z + 1, r) / r  # float64, the last retrofit step: CR
        step = plan.at(t)
        assert step.mode == "train" and step.zero_out_scale == 0.0
        assert step.target_cr == pytest.approx(want, abs=1e-12), t
    assert plan.at(z + r - 1).target_cr == cr and plan.at(z).target_cr < cr
