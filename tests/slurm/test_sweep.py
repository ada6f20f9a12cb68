"""dmc sweep: YAML -> job chains -> sbatch scripts (bash -n), fake sbatch submissions and the
manifest, the requeue-on-preemption path of the rendered script, and clear errors."""
import json
import os
import re
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
        assert f"dmc.target_cr={cr}" in retro["argv"]
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
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(FAKE_SBATCH)
    (fake / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
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
    # seed 2's chains wait on seed 2's own zero_out
    after = {j["name"]: j["after"] for j in manifest["jobs"]}
    assert after["tiny-cr3-s2-retrofit"] == ["tiny-s2-zero_out"]
    with pytest.raises(ValueError, match="holds a submitted sweep"):
        write_sweep(Path("configs/sweeps/tiny.yaml"), out)
    # submit.sh does the same submissions
    (tmp_path / "calls").unlink()
    (tmp_path / "count").unlink()
    subprocess.run(["bash", str(out / "submit.sh")], check=True, capture_output=True)
    assert (tmp_path / "calls").read_text().splitlines() == calls


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
