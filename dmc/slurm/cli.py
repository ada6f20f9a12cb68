"""``dmc sweep FILE.yaml [--dry-run | --submit]``: a CR / GQA sweep as chains of SLURM jobs.

Writes ``<output>/<name>/`` with ``jobs/<job>.sbatch``, ``submit.sh``, ``logs/`` and
``manifest.json`` (points with their training budgets, jobs, commands, dependencies, output
paths and, after ``--submit``, the job ids). ``--dry-run`` (the default) writes everything but
submits nothing; ``--submit`` calls ``sbatch --parsable [--dependency=afterok:IDS]`` job by job
in dependency order. ``--submit`` and ``submit.sh`` record each queued job in ``job_ids.txt``
and refuse a folder that has one, so no folder is submitted twice.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import time
from pathlib import Path

from dmc.slurm.plan import plan_sweep
from dmc.slurm.render import JOB_IDS, render_job, render_submit, submitted_message
from dmc.slurm.spec import load_sweep


def write_sweep(sweep_file: Path, out: Path | None) -> tuple[dict, Path]:
    """Plans and renders the sweep; returns the manifest (without job ids) and its folder."""
    spec = load_sweep(sweep_file)
    root = (Path(out) if out else Path(spec.output) / spec.name).resolve()
    manifest_path = root / "manifest.json"
    if (root / JOB_IDS).exists() or (manifest_path.is_file() and any(  # or by an older dmc
            j.get("job_id") for j in json.loads(manifest_path.read_text())["jobs"])):
        raise ValueError(submitted_message(root))
    jobs, points = plan_sweep(spec, root)
    for sub in ("jobs", "logs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    scripts = {}
    for job in jobs:
        scripts[job.name] = root / "jobs" / f"{job.name}.sbatch"
        scripts[job.name].write_text(render_job(job, spec.slurm, spec.name, root, Path.cwd()))
    (root / "submit.sh").write_text(render_submit(jobs, scripts, spec.name, root))
    shutil.copyfile(sweep_file, root / "sweep.yaml")
    manifest = {
        "sweep": spec.name, "sweep_file": str(Path(sweep_file).resolve()), "root": str(root),
        "workdir": str(Path.cwd()), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "submitted": False,
        "points": [dataclasses.asdict(p) for p in points],
        "jobs": [dict(dataclasses.asdict(job), script=str(scripts[job.name]), job_id=None)
                 for job in jobs],
    }
    manifest_path.write_text(json.dumps(manifest, indent=1))
    return manifest, root


def submit(manifest: dict, path: Path, sbatch: str = "sbatch") -> dict:
    """Submits every job in order with ``sbatch --parsable``; appends each job id to the
    folder's ``job_ids.txt`` (as ``submit.sh`` does) and fills it in the manifest at ``path``
    as the job is queued, so that a failure part way leaves the ids of the jobs already queued
    (and :func:`write_sweep` and ``submit.sh`` refuse to submit the folder again)."""
    if (path.parent / JOB_IDS).exists():
        raise ValueError(submitted_message(path.parent))
    ids = {}
    for job in manifest["jobs"]:
        cmd = [sbatch, "--parsable"]
        if job["after"]:
            cmd.append("--dependency=afterok:" + ":".join(ids[a] for a in job["after"]))
        cmd.append(job["script"])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            queued = ", ".join(f"{name} ({jid})" for name, jid in ids.items()) or "none"
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): "
                               f"{proc.stderr.strip() or proc.stdout.strip()}; queued before it: "
                               f"{queued} (recorded in {path}; cancel them or submit the rest "
                               f"by hand)")
        ids[job["name"]] = proc.stdout.strip().split(";")[0]
        with open(path.parent / JOB_IDS, "a") as record:
            record.write(f"{job['name']} {ids[job['name']]}\n")
        job["job_id"] = ids[job["name"]]
        job["submit_command"] = cmd
        path.write_text(json.dumps(manifest, indent=1))
    manifest["submitted"] = True
    path.write_text(json.dumps(manifest, indent=1))
    return manifest


def _print_plan(manifest: dict) -> None:
    print(f"sweep {manifest['sweep']}: {len(manifest['points'])} points, "
          f"{len(manifest['jobs'])} jobs in {manifest['root']}")
    for job in manifest["jobs"]:
        after = f" after {', '.join(job['after'])}" if job["after"] else ""
        jid = f" [{job['job_id']}]" if job["job_id"] else ""
        print(f"  {job['name']}{jid}: {job['nodes']}x{job['gpus_per_node']} GPUs, "
              f"{job['time']}{after}")
        print(f"    dmc {' '.join(job['argv'])}")


def run_sweep(args: argparse.Namespace) -> int:
    manifest, root = write_sweep(Path(args.file), args.out)
    if args.submit:
        if shutil.which("sbatch") is None:
            raise RuntimeError("--submit needs sbatch on PATH (a SLURM login node); the "
                               f"rendered jobs are in {root}, --dry-run only renders them")
        manifest = submit(manifest, root / "manifest.json")
    if args.json:
        print(json.dumps(manifest))
    else:
        _print_plan(manifest)
        print(f"manifest: {root / 'manifest.json'}" +
              ("" if args.submit else f"; submit with `dmc sweep {args.file} --submit` or "
                                      f"`bash {root / 'submit.sh'}`"))
    return 0


def register(sub) -> None:
    parser = sub.add_parser("sweep", help="render / submit a CR and GQA sweep as SLURM jobs")
    parser.add_argument("file", metavar="SWEEP.yaml", help="e.g. configs/sweeps/llama2-7b-cr.yaml")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true",
                      help="render the scripts and manifest, submit nothing (default)")
    mode.add_argument("--submit", action="store_true", help="submit the job chains with sbatch")
    parser.add_argument("--out", metavar="DIR",
                        help="run folder (default: <output>/<name> from the sweep file)")
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")
    parser.set_defaults(handler=run_sweep)
