"""Rows of ``dmc eval compare`` evaluated by several worker processes (``--workers N``).

A row's evaluation is a stream of small engine steps, bound by per-step work rather than by
arithmetic, so on a CPU two processes of one thread each score more rows per minute than one
process of two threads (measured on the 2-core machine, H2O and TOVA at 4x on the benchmark's
control: one process, 2 threads, the control and both rows in 143 s, 48 s a row; two processes,
1 thread each, the control and one row each, 123 s for the four rows, 31 s a row; every number
identical, a row's evaluation being deterministic and independent of the others).
The control runs first in the caller (every other row is measured
against its log-probabilities); each worker then receives the evaluation data, the control's
reference and its path once, loads the checkpoints it is handed, and returns one result per row,
in the order of the rows.
"""
from __future__ import annotations

import multiprocessing

import torch

_WORKER: dict = {}  # per worker process: data, reference, control path, engine settings


def load_for(method, control_path: str, control=None):
    """The loaded model that evaluates ``method``: the control (given, or loaded from
    ``control_path``) for the control and the policies, else ``method.path``; a ValueError when
    a checkpoint is not the kind its row says."""
    from dmc.inference.loading import load_model

    if method.kind in ("control", "policy"):
        return control if control is not None else load_model(control_path)
    loaded = load_model(method.path)
    if method.kind == "dmc" and loaded.dmc_config is None:
        raise ValueError(f"--dmc {method.path} is not a DMC model (no dmc_config)")
    if method.kind in ("gqa", "base") and loaded.dmc_config is not None:
        raise ValueError(f"--{method.kind} {method.path} is a DMC model")
    return loaded


def _init_worker(data, reference, control_path: str, settings: dict, threads: int) -> None:
    torch.set_num_threads(threads)
    _WORKER.update(data=data, reference=reference, control_path=control_path,
                   settings=settings, control=None)


def _evaluate(method) -> dict:
    from dmc.eval.compare import evaluate_method
    from dmc.inference.loading import load_model

    if method.kind in ("control", "policy") and _WORKER["control"] is None:
        _WORKER["control"] = load_model(_WORKER["control_path"])
    loaded = load_for(method, _WORKER["control_path"], _WORKER["control"])
    return evaluate_method(method, loaded, _WORKER["data"], _WORKER["reference"],
                           **_WORKER["settings"])


def evaluate_in_workers(methods: list, data, reference: dict, control_path: str,
                        settings: dict, workers: int, log=print) -> list[dict]:
    """One result per row of ``methods`` (none of them the control), evaluated by ``workers``
    spawned processes sharing this process's threads; ``settings``: the keyword arguments of
    :func:`dmc.eval.compare.evaluate_method` (batch, chunk and page size). ``log`` gets each
    row's label and summary line as its result arrives, in order."""
    from dmc.eval.compare_report import summary_line

    threads = max(1, torch.get_num_threads() // workers)
    context = multiprocessing.get_context("spawn")
    results = []
    with context.Pool(workers, initializer=_init_worker,
                      initargs=(data, reference, control_path, settings, threads)) as pool:
        for method, result in zip(methods, pool.imap(_evaluate, methods)):
            log(f"== {method.label}" + (f" {method.cr:g}x" if method.cr else f" {method.path}"))
            log("   " + summary_line(result))
            results.append(result)
    return results
