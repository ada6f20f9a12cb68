"""dmc sweep: YAML -> job chains -> sbatch scripts (bash -n), fake sbatch submissions and the
manifest, the requeue-on-preemption path of the rendered script, and clear errors."""
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from dmc.cli import main
from dmc.slurm.cli import write_sweep
from dmc.slurm.spec import SweepError, parse_sweep

ROOT = Path(__file__).resolve().parents[2]
FAKE_SBATCH = """#!/bin/bash
# Records its arguments and answers like `sbatch --parsable` on a federated cluster.
n=$(( $(cat "$FAKE_DIR/count" 2>/dev/null || echo 100) + 1 ))
echo "$n" > "$FAKE_DIR/count"
echo "$*" >> "$FAKE_DIR/calls"
echo "$n;cluster"
"""


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)


def _sweep(*argv):
    assert main(["sweep", *argv]) == 0


def _manifest(out):
    return json.loads((out / "manifest.json").read_text())


def _bash_n(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _header(script):
    return [line[len("#SBATCH "):] for line in script.read_text().splitlines()
            if line.startswith("#SBATCH ")]


def test_template_parses():
    _bash_n(ROOT / "slurm/retrofit.sbatch")


def test_llama_dry_run_renders_chains(in_repo, tmp_path, capsys):
    _sweep("configs/sweeps/llama2-7b-cr.yaml", "--dry-run", "--out", str(tmp_path))
    assert "5 points, 11 jobs" in capsys.readouterr().out
    manifest = _manifest(tmp_path)
    jobs = {j["name"]: j for j in manifest["jobs"]}
    assert all(j["job_id"] is None for j in jobs.values()) and not manifest["submitted"]
    for job in jobs.values():
        _bash_n(job["script"])
    _bash_n(tmp_path / "submit.sh")
    zero_out = [n for n in jobs if n.endswith("zero_out")]
    assert zero_out == ["llama2-7b-s1234-zero_out"]  # shared by the three CRs
    shared = jobs[zero_out[0]]["outputs"]["checkpoint"]
    for cr in (2, 3, 4):
        retro = jobs[f"llama2-7b-cr{cr}-s1234-retrofit"]
        solid = jobs[f"llama2-7b-cr{cr}-s1234-solidify"]
        assert retro["after"] == zero_out and solid["after"] == [retro["name"]]
        assert retro["argv"][retro["argv"].index("--phase") + 1] == "retrofit"
        assert f"dmc.target_cr={float(cr)!r}" in retro["argv"]  # the exact value
        assert f"checkpoint.init_from={shared}" in retro["argv"]
        header = _header(Path(retro["script"]))
        for opt in ("--nodes=8", "--ntasks-per-node=8", "--gpus-per-node=8", "--time=24:00:00",
                    "--signal=USR1@180", "--requeue", f"--output={tmp_path}/logs/%x-%j.out",
                    "--exclusive", f"--job-name=dmc-llama2-7b-cr-{retro['name']}"):
            assert opt in header, opt
        text = Path(retro["script"]).read_text()
        assert "set -- retrofit --config configs/models/llama2-7b.yaml" in text
        assert f"export DMC_ROOT={ROOT}" in text and "scontrol requeue" in text
    for factor, groups in ((2, 16), (4, 8)):
        convert = jobs[f"llama2-7b-gqa{factor}-convert"]
        up = jobs[f"llama2-7b-gqa{factor}-s1234-uptrain"]
        assert convert["argv"][:2] == ["baseline", "gqa"] and up["after"] == [convert["name"]]
        assert convert["argv"][convert["argv"].index("--num-query-groups") + 1] == str(groups)
        assert f"--config configs/retrofit/gqa{factor}.yaml" in " ".join(up["argv"])
        assert f"checkpoint.load_base={convert['outputs']['checkpoint']}" in up["argv"]
        assert {"--nodes=1", "--gpus-per-node=1", "--time=01:00:00"} <= set(
            _header(Path(convert["script"])))
    points = {p["name"]: p for p in manifest["points"]}
    assert points["llama2-7b-cr4-s1234"]["result"].endswith(
        "llama2-7b-cr4-s1234/checkpoints/solidify")
    submit = (tmp_path / "submit.sh").read_text()
    assert "--dependency=afterok:${job_0%%;*}" in submit


def test_fake_sbatch_submissions_match_manifest(in_repo, tmp_path, monkeypatch):
    _fake_sbatch(tmp_path, monkeypatch)
    out = tmp_path / "sweep"
    _sweep("configs/sweeps/tiny.yaml", "--submit", "--out", str(out))
    manifest = _manifest(out)
    assert manifest["submitted"] and len(manifest["jobs"]) == 13  # 2 zero_out, 8 CR, 1+2 GQA
    calls = (tmp_path / "calls").read_text().splitlines()
    ids = {j["name"]: j["job_id"] for j in manifest["jobs"]}
    assert sorted(ids.values()) == [str(n) for n in range(101, 114)]
    for job, call in zip(manifest["jobs"], calls):
        dep = (["--dependency=afterok:" + ":".join(ids[a] for a in job["after"])]
               if job["after"] else [])
        assert call.split() == ["--parsable", *dep, job["script"]]
        assert job["submit_command"] == ["sbatch", "--parsable", *dep, job["script"]]
    # seed 2's chains wait on seed 2's own zero_out
    after = {j["name"]: j["after"] for j in manifest["jobs"]}
    assert after["tiny-cr3-s2-retrofit"] == ["tiny-s2-zero_out"]
    with pytest.raises(ValueError, match="holds a submitted sweep"):
        write_sweep(Path("configs/sweeps/tiny.yaml"), out)
    # submit.sh does the same submissions (in a folder not submitted yet)
    (tmp_path / "calls").unlink()
    (tmp_path / "count").unlink()
    other = tmp_path / "other"
    _sweep("configs/sweeps/tiny.yaml", "--dry-run", "--out", str(other))
    subprocess.run(["bash", str(other / "submit.sh")], check=True, capture_output=True)
    assert [c.replace(str(other), str(out)) for c in
            (tmp_path / "calls").read_text().splitlines()] == calls


def test_a_submission_failing_part_way_keeps_the_ids_of_the_queued_jobs(in_repo, tmp_path,
                                                                          monkeypatch, capsys):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(FAKE_SBATCH.replace('echo "$n;cluster"', '[ "$n" -le 102 ] || '
                                                     '{ echo "QOS limit" >&2; exit 1; }\n'
                                                     'echo "$n;cluster"'))
    (fake / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    out = tmp_path / "sweep"
    assert main(["sweep", "configs/sweeps/tiny.yaml", "--submit", "--out", str(out)]) == 2
    assert "queued before it: tiny-s1-zero_out (101)" in capsys.readouterr().err
    manifest = _manifest(out)
    assert [j["job_id"] for j in manifest["jobs"][:3]] == ["101", "102", None]
    assert not manifest["submitted"]
    with pytest.raises(ValueError, match="holds a submitted sweep"):  # never queued twice
        write_sweep(Path("configs/sweeps/tiny.yaml"), out)


def _run_rendered(script, tmp_path, rc):
    """Runs a rendered job script with fake srun/scontrol and a fake interpreter exiting rc."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                                  'SLURM_PROCID=0 SLURM_LOCALID=0 exec "$@"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\nif [ "$1" = show ]; then echo node001; '
                                      f'else echo "$*" >> {tmp_path}/scontrol; fi\n')
    (bin_dir / "python").write_text(f'#!/bin/bash\necho "$RANK $LOCAL_RANK $MASTER_ADDR $*" '
                                    f'> {tmp_path}/ran\nexit {rc}\n')
    for name in ("srun", "scontrol", "python"):
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
               DMC_PYTHON=str(bin_dir / "python"), SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="node[001-002]", SLURM_NTASKS="16", SLURM_JOB_NUM_NODES="2")
    text = script.read_text().replace("export DMC_PYTHON=", "# ")
    runnable = tmp_path / "job.sh"
    runnable.write_text(text)
    return subprocess.run(["bash", str(runnable)], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("rc", [0, 99, 1])
def test_rendered_script_requeues_only_after_preemption(in_repo, tmp_path, rc):
    out = tmp_path / "sweep"
    _sweep("configs/sweeps/tiny.yaml", "--out", str(out))
    script = out / "jobs" / "tiny-cr2-s1-retrofit.sbatch"
    proc = _run_rendered(script, tmp_path, rc)
    assert proc.returncode == (0 if rc == 99 else rc), proc.stdout + proc.stderr
    ran = (tmp_path / "ran").read_text().split()
    assert ran[:3] == ["0", "0", "node001"]
    assert ran[3:7] == ["-m", "dmc.cli", "retrofit", "--config"] and "--phase" in ran
    requeued = (tmp_path / "scontrol").read_text() if (tmp_path / "scontrol").exists() else ""
    assert requeued == ("requeue 4242\n" if rc == 99 else "")


@pytest.mark.parametrize("change, message", [
    ({"target_crs": [2], "colour": 1}, "unknown key colour; accepted keys: name, models"),
    ({"slurm": {"gpus": 8}}, "unknown key slurm.gpus; accepted keys under slurm: nodes"),
    ({"target_crs": ["two"]}, "target_crs: expected a list of numbers"),
    ({"target_crs": [0.5]}, "target_crs: every CR must be >= 1"),
    ({"seeds": [1, 1], "target_crs": [2]}, "seeds: duplicate values"),
    ({"slurm": {"time": "tomorrow"}, "target_crs": [2]}, "slurm.time: expected a SLURM time"),
    ({"target_crs": [], "gqa_factors": []}, "the sweep is empty"),
    *[({"target_crs": [2], "overrides": [f"{key}=x"]},
       f"overrides: {re.escape(key)} is set by the planner for each job")
      for key in ("checkpoint.dir", "checkpoint.init_from", "checkpoint.load_base", "run_dir",
                  "seed", "dmc.target_cr", "dmc.enabled", "model.num_query_groups")],
    ({"target_crs": [2], "recipe": "cr{target_cr}.yaml"},
     r"recipe: unknown placeholder \{target_cr\} .* accepted is \{cr\}"),
    ({"target_crs": [2], "recipe": "cr{cr:.1f}.yaml"}, r"recipe: unknown placeholder \{cr:.1f\}"),
    ({"target_crs": [2], "recipe": "cr{cr.yaml"}, r"recipe: .* accepted is \{cr\}"),
    ({"gqa_factors": [2], "gqa_recipe": "gqa{factor}-{seed}.yaml"},
     r"gqa_recipe: unknown placeholder \{seed\} .* accepted is \{factor\}"),
    ({"target_crs": [2], "seeds": []}, "seeds: list at least one seed"),
    ({"target_crs": [2], "models": [{"preset": "p", "base_checkpoint": "b", "name": "a/b"}]},
     r"models\[0\].name: use letters, digits, '.', '_' and '-' only, got 'a/b'"),
    ({"target_crs": [2], "models": [{"preset": "p", "base_checkpoint": "b", "name": "a b"}]},
     r"models\[0\].name: use letters"),
    ({"target_crs": [2], "slurm": {"time": 86400}}, "slurm.time: .* 86400: quote it"),
    ({"target_crs": [2], "slurm": {"convert_time": 3600}}, "slurm.convert_time: .* quote it"),
])
def test_bad_sweep_files_name_the_field(change, message):
    tree = {"name": "t", "models": [{"preset": "p.yaml", "base_checkpoint": "b"}]}
    tree.update(change)
    with pytest.raises(SweepError, match=message):
        parse_sweep(tree)


def test_a_file_that_is_not_yaml_is_refused(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("name: [t\n")
    assert main(["sweep", str(path)]) == 2
    assert f"{path}: not valid YAML" in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    ({"overrides": ["parallel.tensor=2"]},
     "job tiny-cr2-s1: .*slurm.nodes x slurm.gpus_per_node = 1 GPUs"),
    ({"overrides": ["optim.lrr=1"]}, "unknown key optim.lrr"),
    ({"gqa_factors": [3]}, "gqa_recipe: configs/retrofit/gqa3.yaml"),
    ({"recipe": "configs/retrofit/cr{cr}.yaml", "target_crs": [5]},
     "recipe: configs/retrofit/cr5.yaml"),
])
def test_bad_points_fail_before_rendering(in_repo, tmp_path, capsys, change, message):
    tree = yaml.safe_load((ROOT / "configs/sweeps/tiny.yaml").read_text())
    tree.update(change)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out" / "manifest.json").exists()


def _tiny_variant(tmp_path, change):
    """configs/sweeps/tiny.yaml with ``change`` applied, written to a temporary file."""
    tree = yaml.safe_load((ROOT / "configs/sweeps/tiny.yaml").read_text())
    tree.update(change)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _fake_sbatch(tmp_path, monkeypatch):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(FAKE_SBATCH)
    (fake / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))


def _calls(tmp_path):
    return (tmp_path / "calls").read_text().splitlines()


def test_gqa_uptrains_with_the_schedule_of_the_dmc_point_at_its_factor(in_repo, tmp_path):
    """Equal training budget: GQA 2x gets DMC 2x's steps (cr4.yaml's schedule for every CR),
    not gqa2.yaml's; every point's budget is in the manifest."""
    _sweep("configs/sweeps/llama2-7b-cr.yaml", "--dry-run", "--out", str(tmp_path))
    manifest = _manifest(tmp_path)
    jobs = {j["name"]: j for j in manifest["jobs"]}
    points = {p["name"]: p for p in manifest["points"]}
    schedule = ["schedule.zero_out_steps=250", "schedule.retrofit_steps=6000",
                "schedule.solidify_steps=2000"]
    for factor in (2, 4):
        argv = jobs[f"llama2-7b-gqa{factor}-s1234-uptrain"]["argv"]
        start = argv.index(schedule[0])
        assert argv[start:start + 3] == schedule  # after the recipes, overriding theirs
        assert argv.index(f"configs/retrofit/gqa{factor}.yaml") < start
    tokens = 8250 * 1024 * 4096
    for name in ("cr2", "cr3", "cr4", "gqa2", "gqa4"):
        assert points[f"llama2-7b-{name}-s1234"]["budget"] == {
            "steps": 8250, "global_batch_size": 1024, "seq_length": 4096, "tokens": tokens}


def test_gqa_without_a_dmc_point_at_its_factor_keeps_its_recipe_schedule(in_repo, tmp_path):
    path = _tiny_variant(tmp_path, {"overrides": ["precision=fp32"], "target_crs": [3],
                                    "recipe": "configs/retrofit/cr4.yaml"})
    _sweep(str(path), "--dry-run", "--out", str(tmp_path / "out"))
    manifest = _manifest(tmp_path / "out")
    up = next(j for j in manifest["jobs"] if j["name"] == "tiny-gqa2-s1-uptrain")
    assert not [key for key in up["argv"] if key.startswith("schedule.")]
    budgets = {p["name"]: p["budget"]["steps"] for p in manifest["points"]}
    assert budgets["tiny-gqa2-s1"] == 250 + 2000 + 2000  # configs/retrofit/gqa2.yaml
    assert budgets["tiny-cr3-s1"] == 250 + 6000 + 2000  # configs/retrofit/cr4.yaml


@pytest.mark.parametrize("key, value", [("global_batch_size", 16), ("seq_length", 128)])
def test_gqa_and_dmc_points_on_other_batches_are_refused(in_repo, tmp_path, capsys, key, value):
    recipe = yaml.safe_load((ROOT / "configs/retrofit/gqa2.yaml").read_text())
    recipe["data"] = {key: value}
    (tmp_path / "gqa2.yaml").write_text(yaml.safe_dump(recipe))
    path = _tiny_variant(tmp_path, {"gqa_recipe": str(tmp_path / "gqa{factor}.yaml")})
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (f"tiny-gqa2-s1 ({tmp_path}/gqa2.yaml) and tiny-cr2-s1 (configs/retrofit/cr2.yaml): "
            f"data.{key} is {value} vs") in err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_submit_sh_records_the_job_ids_and_no_folder_is_submitted_twice(in_repo, tmp_path,
                                                                         monkeypatch, capsys):
    _fake_sbatch(tmp_path, monkeypatch)
    out = tmp_path / "sweep"
    _sweep("configs/sweeps/tiny.yaml", "--dry-run", "--out", str(out))
    proc = subprocess.run(["bash", str(out / "submit.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    jobs = [j["name"] for j in _manifest(out)["jobs"]]
    record = [f"{name} {101 + i}" for i, name in enumerate(jobs)]
    assert (out / "job_ids.txt").read_text().splitlines() == record
    assert proc.stdout.splitlines() == record
    message = (f"{out} holds a submitted sweep ({out}/job_ids.txt lists the job ids queued); "
               f"pass another --out or remove the folder")
    again = subprocess.run(["bash", str(out / "submit.sh")], capture_output=True, text=True)
    assert again.returncode == 2 and again.stderr == f"submit.sh: error: {message}\n"
    assert main(["sweep", "configs/sweeps/tiny.yaml", "--submit", "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"dmc sweep: error: {message}\n"
    assert len(_calls(tmp_path)) == len(jobs)  # nothing queued twice
    # and the other way round: submit.sh refuses a folder submitted with --submit
    other = tmp_path / "other"
    _sweep("configs/sweeps/tiny.yaml", "--submit", "--out", str(other))
    assert len((other / "job_ids.txt").read_text().splitlines()) == len(jobs)
    proc = subprocess.run(["bash", str(other / "submit.sh")], capture_output=True, text=True)
    assert proc.returncode == 2 and f"{other} holds a submitted sweep" in proc.stderr
    assert len(_calls(tmp_path)) == 2 * len(jobs)


def test_submit_sh_failing_part_way_records_the_jobs_queued(in_repo, tmp_path, monkeypatch):
    _fake_sbatch(tmp_path, monkeypatch)
    (tmp_path / "bin" / "sbatch").write_text(FAKE_SBATCH.replace(
        'echo "$n;cluster"', '[ "$n" -le 102 ] || exit 1\necho "$n;cluster"'))
    out = tmp_path / "sweep"
    _sweep("configs/sweeps/tiny.yaml", "--dry-run", "--out", str(out))
    proc = subprocess.run(["bash", str(out / "submit.sh")], capture_output=True, text=True)
    assert proc.returncode == 1
    assert (out / "job_ids.txt").read_text().splitlines() == ["tiny-s1-zero_out 101",
                                                              "tiny-cr2-s1-retrofit 102"]
    with pytest.raises(ValueError, match="holds a submitted sweep"):
        write_sweep(Path("configs/sweeps/tiny.yaml"), out)


def test_target_crs_are_passed_exactly_and_names_must_not_collide(in_repo, tmp_path, capsys):
    path = _tiny_variant(tmp_path, {"target_crs": [1.23456789]})
    _sweep(str(path), "--dry-run", "--out", str(tmp_path / "out"))
    manifest = _manifest(tmp_path / "out")
    point = next(p for p in manifest["points"] if p["kind"] == "dmc")
    assert point["name"] == "tiny-cr1.23457-s1" and point["value"] == 1.23456789
    retro = next(j for j in manifest["jobs"] if j["name"] == "tiny-cr1.23457-s1-retrofit")
    assert "dmc.target_cr=1.23456789" in retro["argv"]
    path = _tiny_variant(tmp_path, {"target_crs": [2, 2.0000001]})
    assert main(["sweep", str(path), "--out", str(tmp_path / "out2")]) == 2
    assert "target_crs / models[].name: two sweep points are named tiny-cr2-s1" in (
        capsys.readouterr().err)
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("steps, dmc_phase, gqa_phase", [
    ((20, 200, 0), "retrofit", "uptrain"),
    ((0, 0, 50), "solidify", "solidify"),
    ((20, 200, 50), "solidify", "solidify"),
])
def test_results_are_the_last_phase_with_steps(in_repo, tmp_path, steps, dmc_phase, gqa_phase):
    overrides = [f"schedule.{key}={n}" for key, n in
                 zip(("zero_out_steps", "retrofit_steps", "solidify_steps"), steps)]
    path = _tiny_variant(tmp_path, {"overrides": [*overrides, "precision=fp32"]})
    _sweep(str(path), "--dry-run", "--out", str(tmp_path / "out"))
    points = {p["name"]: p for p in _manifest(tmp_path / "out")["points"]}
    run_dir = tmp_path / "out" / "runs"
    assert points["tiny-cr2-s1"]["result"] == str(run_dir / f"tiny-cr2-s1/checkpoints/{dmc_phase}")
    assert points["tiny-gqa2-s1"]["result"] == str(
        run_dir / f"tiny-gqa2-s1/checkpoints/{gqa_phase}")
    assert points["tiny-gqa2-s1"]["budget"]["steps"] == sum(steps)


def test_an_unquoted_time_in_a_file_says_quote_it(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("name: t\nmodels: [{preset: p.yaml, base_checkpoint: b}]\ntarget_crs: [2]\n"
                    "slurm:\n  time: 24:00:00\n")
    assert main(["sweep", str(path)]) == 2
    assert "slurm.time: expected a SLURM time such as \"24:00:00\", got the number 86400: " \
           "quote it" in capsys.readouterr().err


def test_zero_outs_that_differ_get_numbered_jobs_each_retrofit_its_own(in_repo, tmp_path):
    """cr2.yaml and cr4.yaml anneal for other step counts, so their zero-outs differ: two
    zero_out jobs (the second suffixed -2), each CR's retrofit waiting on and starting from
    its own."""
    path = _tiny_variant(tmp_path, {"recipe": "configs/retrofit/cr{cr}.yaml", "target_crs": [2, 4],
                                    "overrides": ["precision=fp32"], "seeds": [1],
                                    "gqa_factors": []})
    _sweep(str(path), "--dry-run", "--out", str(tmp_path / "out"))
    jobs = {j["name"]: j for j in _manifest(tmp_path / "out")["jobs"]}
    assert [n for n in jobs if "zero_out" in n] == ["tiny-s1-zero_out", "tiny-s1-zero_out-2"]
    runs = tmp_path / "out" / "runs"
    for cr, zero_out in ((2, "tiny-s1-zero_out"), (4, "tiny-s1-zero_out-2")):
        assert jobs[zero_out]["outputs"]["checkpoint"] == str(runs / zero_out / "checkpoints"
                                                                / "zero_out")
        retro = jobs[f"tiny-cr{cr}-s1-retrofit"]
        assert retro["after"] == [zero_out]
        assert f"--config configs/retrofit/cr{cr}.yaml" in " ".join(jobs[zero_out]["argv"])
        assert (f"checkpoint.init_from={jobs[zero_out]['outputs']['checkpoint']}"
                in retro["argv"])


@pytest.mark.parametrize("zero_out_steps", [0, 1])
def test_a_zero_out_job_exactly_when_the_zero_out_phase_has_steps(in_repo, tmp_path,
                                                                   zero_out_steps):
    """One zero-out step still gets its zero_out job (loading the base checkpoint), the
    retrofit continuing from it; without zero-out steps the retrofit loads the base itself."""
    path = _tiny_variant(tmp_path, {"overrides": [f"schedule.zero_out_steps={zero_out_steps}",
                                                  "precision=fp32"],
                                    "gqa_factors": [], "seeds": [1], "target_crs": [2]})
    _sweep(str(path), "--dry-run", "--out", str(tmp_path / "out"))
    jobs = {j["name"]: j for j in _manifest(tmp_path / "out")["jobs"]}
    base = "checkpoint.load_base=runs/tiny-base/checkpoints/pretrain"
    retro = jobs["tiny-cr2-s1-retrofit"]
    checkpoint_keys = [a for a in retro["argv"] if a.startswith("checkpoint.")]
    if zero_out_steps:
        assert list(jobs) == ["tiny-s1-zero_out", "tiny-cr2-s1-retrofit", "tiny-cr2-s1-solidify"]
        zero_out = jobs["tiny-s1-zero_out"]
        assert base in zero_out["argv"] and retro["after"] == ["tiny-s1-zero_out"]
        assert checkpoint_keys == [
            f"checkpoint.init_from={zero_out['outputs']['checkpoint']}"]
    else:
        assert list(jobs) == ["tiny-cr2-s1-retrofit", "tiny-cr2-s1-solidify"]
        assert retro["after"] == [] and checkpoint_keys == [base]


def test_tensor_parallel_jobs_split_the_batch_over_data_parallel_ranks_only(in_repo, tmp_path,
                                                                            capsys):
    """TP 2 on 4 GPUs is 2 data-parallel ranks: a global batch of 6 (3 x 1 x 2) is planned, one
    of 5 is refused naming data.global_batch_size and the step it must be a multiple of (2)."""
    overrides = ["parallel.tensor=2", "data.micro_batch_size=1", "precision=fp32"]
    slurm = {"nodes": 1, "gpus_per_node": 4, "cpus_per_task": 4, "time": "00:30:00"}
    path = _tiny_variant(tmp_path, {"overrides": [*overrides, "data.global_batch_size=6"],
                                    "slurm": slurm, "gqa_factors": []})
    _sweep(str(path), "--dry-run", "--out", str(tmp_path / "ok"))
    assert len(_manifest(tmp_path / "ok")["jobs"]) == 2 + 2 * 2 * 2  # zero_outs, CR chains
    path = _tiny_variant(tmp_path, {"overrides": [*overrides, "data.global_batch_size=5"],
                                    "slurm": slurm, "gqa_factors": []})
    assert main(["sweep", str(path), "--out", str(tmp_path / "bad")]) == 2
    assert ("data.global_batch_size (5) must be a multiple of data.micro_batch_size x "
            "data-parallel size (2) on 4 GPUs") in capsys.readouterr().err
    assert not (tmp_path / "bad" / "manifest.json").exists()


def test_rendered_script_carries_the_slurm_settings(in_repo, tmp_path):
    """cpus_per_task, partition / account / qos, the container exports and the setup lines
    reach the script, the setup lines after the exports and before the dmc command line."""
    slurm = {"nodes": 1, "gpus_per_node": 1, "cpus_per_task": 7, "time": "00:30:00",
             "partition": "p1", "account": "a1", "qos": "q1",
             "container_image": "/images/dmc.sqsh", "container_mounts": "/data:/data",
             "setup": ["module load cuda/12.4", "export NCCL_DEBUG=WARN"]}
    path = _tiny_variant(tmp_path, {"slurm": slurm})
    _sweep(str(path), "--dry-run", "--out", str(tmp_path / "out"))
    job = next(j for j in _manifest(tmp_path / "out")["jobs"]
               if j["name"] == "tiny-cr2-s1-retrofit")
    header = _header(Path(job["script"]))
    for opt in ("--cpus-per-task=7", "--partition=p1", "--account=a1", "--qos=q1",
                "--gpus-per-node=1"):
        assert opt in header, opt
    lines = Path(job["script"]).read_text().splitlines()
    command = next(i for i, line in enumerate(lines) if line.startswith("set -- retrofit "))
    image = lines.index("export DMC_CONTAINER_IMAGE=/images/dmc.sqsh")
    mounts = lines.index("export DMC_CONTAINER_MOUNTS=/data:/data")
    setup = lines.index("module load cuda/12.4")
    assert image < mounts < setup and lines[setup + 1:command + 1] == [
        "export NCCL_DEBUG=WARN", f"set -- {shlex.join(job['argv'])}"]


def test_default_slurm_settings_leave_out_the_optional_lines(in_repo, tmp_path):
    """Without partition / account / qos or a container, no such line is rendered."""
    _sweep("configs/sweeps/tiny.yaml", "--dry-run", "--out", str(tmp_path))
    script = Path(_manifest(tmp_path)["jobs"][0]["script"])
    assert "--cpus-per-task=4" in _header(script)
    assert not [o for o in _header(script) if o.startswith(("--partition", "--account", "--qos"))]
    assert "DMC_CONTAINER" not in script.read_text().split("set -- retrofit")[0]


def test_a_manifest_with_job_ids_and_no_record_is_refused(in_repo, tmp_path, capsys):
    """A folder an older dmc submitted (job ids only in manifest.json, no job_ids.txt) is not
    rendered again."""
    out = tmp_path / "sweep"
    _sweep("configs/sweeps/tiny.yaml", "--dry-run", "--out", str(out))
    manifest = _manifest(out)
    manifest["jobs"][0]["job_id"] = "101"
    (out / "manifest.json").write_text(json.dumps(manifest))
    written = (out / "manifest.json").read_text()
    assert main(["sweep", "configs/sweeps/tiny.yaml", "--dry-run", "--out", str(out)]) == 2
    assert f"{out} holds a submitted sweep" in capsys.readouterr().err
    assert (out / "manifest.json").read_text() == written and not (out / "job_ids.txt").exists()


def test_gqa_conversion_converts_the_base_checkpoint(in_repo, tmp_path):
    """The conversion job's command line: the model's base_checkpoint to groups / factor KV
    heads, written where the up-training loads it."""
    _sweep("configs/sweeps/tiny.yaml", "--dry-run", "--out", str(tmp_path))
    jobs = {j["name"]: j for j in _manifest(tmp_path)["jobs"]}
    convert = jobs["tiny-gqa2-convert"]
    assert convert["argv"] == ["baseline", "gqa", "--checkpoint",
                               "runs/tiny-base/checkpoints/pretrain", "--num-query-groups", "4",
                               "--output", str(tmp_path / "gqa" / "tiny-gqa2")]
    assert (f"checkpoint.load_base={tmp_path / 'gqa' / 'tiny-gqa2'}"
            in jobs["tiny-gqa2-s1-uptrain"]["argv"])


def test_overrides_given_to_a_command_without_them_are_a_usage_error(in_repo, tmp_path, capsys):
    """`dmc sweep FILE foo=1`: argparse's exit 2 naming the argument, nothing rendered."""
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "configs/sweeps/tiny.yaml", "--out", str(tmp_path / "out"), "foo=1"])
    assert exit_info.value.code == 2
    assert "error: unrecognized arguments: foo=1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
