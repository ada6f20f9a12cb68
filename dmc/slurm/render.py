"""sbatch scripts and the submission script of a planned sweep.

Each job's script is ``slurm/retrofit.sbatch`` with the job's ``#SBATCH`` header, its settings
(``DMC_ROOT``, container, interpreter, setup lines) and its dmc command line (``set -- ...``)
put in front of the template's body, so a requeued job re-runs the same self-contained script.
"""
from __future__ import annotations

import shlex
from pathlib import Path

from dmc.slurm.plan import Job
from dmc.slurm.spec import SlurmSpec

TEMPLATE = Path(__file__).resolve().parents[2] / "slurm" / "retrofit.sbatch"
BODY_START = "set -uo pipefail"
# The submission record of a run folder: one "<job name> <job id>" line per job queued, written
# by `dmc sweep --submit` and by submit.sh as each job is queued; its presence means submitted.
JOB_IDS = "job_ids.txt"


def submitted_message(root: Path) -> str:
    """The refusal of ``dmc sweep`` and ``submit.sh`` for a folder holding :data:`JOB_IDS`."""
    return (f"{root} holds a submitted sweep ({root / JOB_IDS} lists the job ids queued); pass "
            f"another --out or remove the folder")


def template_body(template: Path = TEMPLATE) -> str:
    """The template from its ``set -uo pipefail`` line on (header and usage notes dropped)."""
    if not template.is_file():
        raise FileNotFoundError(f"{template}: the sbatch template is missing (dmc sweep runs "
                                f"from a checkout of the repository)")
    lines = template.read_text().splitlines()
    if BODY_START not in lines:
        raise ValueError(f"{template}: no '{BODY_START}' line marks the start of the body")
    return "\n".join(lines[lines.index(BODY_START):]) + "\n"


def sbatch_header(job: Job, slurm: SlurmSpec, sweep: str, log_dir: Path) -> list[str]:
    options = [
        f"--job-name=dmc-{sweep}-{job.name}",
        f"--nodes={job.nodes}",
        f"--ntasks-per-node={job.gpus_per_node}",
        f"--gpus-per-node={job.gpus_per_node}",
        f"--cpus-per-task={slurm.cpus_per_task}",
        f"--time={job.time}",
        "--signal=USR1@180",
        "--requeue",
        "--open-mode=append",
        f"--output={log_dir}/%x-%j.out",
    ]
    for key in ("partition", "account", "qos"):
        if getattr(slurm, key):
            options.append(f"--{key}={getattr(slurm, key)}")
    options += slurm.extra_sbatch
    return [f"#SBATCH {opt}" for opt in options]


def render_job(job: Job, slurm: SlurmSpec, sweep: str, root: Path, workdir: Path) -> str:
    """The complete sbatch script of ``job``."""
    settings = [f"export DMC_ROOT={shlex.quote(str(workdir))}"]
    for var, value in (("DMC_PYTHON", slurm.python),
                       ("DMC_CONTAINER_IMAGE", slurm.container_image),
                       ("DMC_CONTAINER_MOUNTS", slurm.container_mounts)):
        if value:
            settings.append(f"export {var}={shlex.quote(value)}")
    lines = ["#!/bin/bash", *sbatch_header(job, slurm, sweep, root / "logs"),
             f"# Rendered by `dmc sweep` from slurm/retrofit.sbatch: job {job.name} of sweep "
             f"{sweep}; waits for: {', '.join(job.after) or 'nothing'}.",
             *settings, *slurm.setup, f"set -- {shlex.join(job.argv)}", ""]
    return "\n".join(lines) + template_body()


def job_variable(index: int) -> str:
    return f"job_{index}"


def render_submit(jobs: list[Job], scripts: dict[str, Path], sweep: str, root: Path) -> str:
    """A bash script doing what ``dmc sweep --submit`` does: refuses a folder holding
    :data:`JOB_IDS`, submits in dependency order (``--dependency=afterok:<ids>``) and appends
    each ``<job name> <job id>`` line to :data:`JOB_IDS` (and prints it) as the job is queued."""
    index = {job.name: i for i, job in enumerate(jobs)}
    record = shlex.quote(str(root / JOB_IDS))
    lines = ["#!/bin/bash", f"# Submits sweep {sweep} (same as `dmc sweep FILE --submit`).",
             "set -euo pipefail",
             f"if [ -e {record} ]; then",
             f"  echo {shlex.quote('submit.sh: error: ' + submitted_message(root))} >&2",
             "  exit 2",
             "fi"]
    for i, job in enumerate(jobs):
        dep = ""
        if job.after:
            ids = ":".join(f"${{{job_variable(index[a])}%%;*}}" for a in job.after)
            dep = f"--dependency=afterok:{ids} "
        lines.append(f"{job_variable(i)}=$(sbatch --parsable {dep}"
                     f"{shlex.quote(str(scripts[job.name]))})")
        lines.append(f"echo {shlex.quote(job.name)} \"${{{job_variable(i)}%%;*}}\" "
                     f"| tee -a {record}")
    return "\n".join(lines) + "\n"
