"""Summary of a scripts/gpu_check.sh results folder: every step's exit status and time, the GPU
test counts (from the JUnit file, or, for a run stopped by its time limit, from the verbose
log's progress lines), and the headline figures of the benchmarks against the issue's H100 goals.

    python scripts/gpu_check_summary.py RESULTS_DIR

Writes RESULTS_DIR/summary.txt and summary.json and prints the text; exits 1 when a step failed
or was skipped (``DMC_CHECK_DEADLINE`` left no time for it: its exit is ``"skipped"``), 2 when
RESULTS_DIR holds no steps.tsv.
"""
from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

GOALS = {  # issue 13, on an H100
    "decode DMC 4x / vanilla": ">= 3.7",
    "paged kernel fraction of copy bandwidth": ">= 0.80",
    "train step DMC / vanilla time": "<= 1.15",
    "train step DMC / vanilla peak memory": "<= 1.10",
}


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def test_counts(path: Path) -> dict | None:
    """Totals of a JUnit XML file: tests, failures, errors, skipped (xfail counts as skipped)."""
    if not path.is_file():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return {key: sum(int(s.get(key, 0)) for s in suites)
            for key in ("tests", "failures", "errors", "skipped")}


OUTCOME = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def log_counts(path: Path) -> dict | None:
    """What ``pytest -v``'s log says of the tests that finished, for a run stopped before it
    wrote its JUnit file (its step's time limit): the same totals, ``partial``, and the ids of
    the tests that failed or errored."""
    if not path.is_file():
        return None
    outcomes, failed = {}, []
    for line in path.read_text(errors="replace").splitlines():
        match, test = OUTCOME.search(line), re.search(r"\S+::\S+", line)
        if match is None or test is None or line.startswith(("FAILED ", "ERROR ")):
            continue  # the short summary repeats the failures; only the progress lines count
        outcomes[test.group()] = match.group(1)
        if match.group(1) in ("FAILED", "ERROR"):
            failed.append(test.group())
    if not outcomes:
        return None
    values = list(outcomes.values())
    return {"tests": len(values), "failures": values.count("FAILED"),
            "errors": values.count("ERROR"),
            "skipped": values.count("SKIPPED") + values.count("XFAIL"), "partial": True,
            "failed": failed}


def summarise(results: Path) -> dict:
    steps = {}  # the newest record of each step (steps.tsv grows over calls)
    for line in (results / "steps.tsv").read_text().splitlines():
        name, status, seconds = line.split("\t")
        steps[name] = {"step": name, "exit": status if status == "skipped" else int(status),
                       "seconds": int(seconds)}
    counts = (test_counts(results / "gpu_tests.xml")
              or log_counts(results / "gpu_tests.log"))
    summary = {"steps": list(steps.values()), "gpu_tests": counts,
               "environment": (results / "environment.txt").read_text().strip().splitlines()
               if (results / "environment.txt").is_file() else [], "figures": {}, "goals": GOALS}
    for key, name in (("decode", "decode_throughput"), ("decode_model", "decode_model"),
                      ("decode_tuned", "decode_tuned")):
        decode = read_json(results / f"{name}.json")
        if decode:
            summary["figures"][key] = [
                {"mode": row["mode"], "error": row["error"]} if "error" in row else
                {**{k: row[k] for k in ("mode", "measured_cr", "batch", "tokens_per_s",
                                        "speedup_vs_vanilla")},
                 "median_host_seconds": row.get("median_host_seconds")}
                for row in decode["rows"]]
    tuning = read_json(results / "kernel_tuning.json")
    if tuning:
        summary["figures"]["kernel_tuning"] = tuning
    kernel = read_json(results / "paged_kernel.json")
    if kernel:
        summary["figures"]["paged_kernel"] = [
            {"path": path, **{k: row[k] for k in ("kernel_GBps", "copy_GBps", "fraction_of_copy")}}
            for path, row in kernel["paths"].items() if not path.startswith("sweep")]
    write = read_json(results / "write_kernel.json")
    if write:
        summary["figures"]["write_kernel"] = [
            {"path": path, "us_per_call": seconds * 1e6, "programs": write["programs"]}
            for path, seconds in write["seconds"].items()]
    train = read_json(results / "train_step.json")
    if train:
        summary["figures"]["train_step"] = [
            {"attention": name, "time_vs_vanilla": row.get("time_vs_vanilla"),
             "memory_vs_vanilla": row.get("memory_vs_vanilla"),
             "saved_vs_vanilla": row.get("saved_vs_vanilla"), "error": row.get("error"),
             **{key: row.get(key) for key in ("step_s", "host_s", "kernel_s", "launches",
                                              "idle_s", "syncs")}}
            for name, row in train["results"].items()]
    return summary


def decode_lines(rows: list[dict], label: str) -> list[str]:
    """One line per decode mode: CR, batch, tokens/s, ratio to vanilla, host time a step."""
    lines = []
    for row in rows:
        if "error" in row:
            lines.append(f"{label} {row['mode']:<16} failed: {row['error'][:200]}")
            continue
        speedup, host = row["speedup_vs_vanilla"], row.get("median_host_seconds")
        lines.append(f"{label} {row['mode']:<16} CR {row['measured_cr']:5.2f}  batch "
                     f"{row['batch']:>4}  {row['tokens_per_s']:10.1f} tok/s  "
                     + ("" if speedup is None else f"x{speedup:.2f} vanilla")
                     + ("" if host is None else f"  host {host * 1e3:.2f} ms/step"))
    return lines


def as_text(summary: dict) -> str:
    lines = ["gpu_check summary", *("  " + line for line in summary["environment"]), "", "steps:"]
    lines += [f"  {s['step']:<18} skipped (no time left before DMC_CHECK_DEADLINE)"
              if s["exit"] == "skipped" else f"  {s['step']:<18} exit {s['exit']:<3} "
              f"{s['seconds']:>6} s" for s in summary["steps"]]
    counts = summary["gpu_tests"]
    if counts and counts.get("partial"):
        lines.append(f"gpu tests (stopped before the end; from the log): {counts['tests']} "
                     f"finished, {counts['failures']} failed, {counts['errors']} errors, "
                     f"{counts['skipped']} skipped or xfailed")
        lines += [f"  failed: {test}" for test in counts["failed"]]
    elif counts:
        lines.append(f"gpu tests: {counts['tests']} collected, {counts['failures']} failed, "
                     f"{counts['errors']} errors, {counts['skipped']} skipped or xfailed")
    figures = summary["figures"]
    for key, label in (("decode", "decode"), ("decode_model", "decode (trained model)"),
                       ("decode_tuned", "decode (tuned)")):
        lines += decode_lines(figures.get(key, []), label)
    tuning = figures.get("kernel_tuning")
    if tuning:
        rows = ", ".join(f"({r['block_n']}, {r['num_warps']}, {r['num_stages']}) "
                         + ("beyond" if r["max_heads"] is None and len(tuning["paged_decode"]) > 1
                            else "for any heads" if r["max_heads"] is None
                            else f"up to {r['max_heads']} heads")
                         for r in tuning["paged_decode"])
        lines.append(f"kernel tuning written (kernel_tuning.json): paged decode {rows}; DMC "
                     f"write {tuning['dmc_write']['num_warps']} warps")
    for k in figures.get("paged_kernel", []):
        lines.append(f"paged kernel ({k['path']}): {k['kernel_GBps']:.1f} GB/s, "
                     f"{k['fraction_of_copy']:.3f} of copy ({k['copy_GBps']:.1f} GB/s)")
    for w in figures.get("write_kernel", []):
        lines.append(f"DMC write ({w['path']}): {w['us_per_call']:.1f} us a layer, "
                     f"{w['programs']} heads")
    for t in figures.get("train_step", []):
        if t.get("error"):
            lines.append(f"train step {t['attention']}: failed: {t['error'][:200]}")
            continue
        memory, saved = t["memory_vs_vanilla"], t.get("saved_vs_vanilla")
        times = ("" if t.get("host_s") is None else
                 f"; {t['step_s']:.3f} s a step, the host issued it in {t['host_s']:.3f} s"
                 + ("" if t.get("kernel_s") is None else
                    f", {t['launches']} kernels {t['kernel_s']:.3f} s, device idle "
                    f"{t['idle_s']:.3f} s")
                 + ("" if t.get("syncs") is None else
                    f", {sum(t['syncs'].values())} waits for the device"))
        if t["attention"] == "vanilla":
            if times:
                lines.append(f"train step vanilla{times}")
            continue
        lines.append(f"train step {t['attention']}: x{t['time_vs_vanilla']:.3f} vanilla time"
                     + ("" if memory is None else f", x{memory:.3f} vanilla peak memory")
                     + ("" if saved is None else f", x{saved:.3f} vanilla activations kept")
                     + times)
    lines.append("goals (H100): " + "; ".join(f"{k} {v}" for k, v in summary["goals"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not (Path(argv[0]) / "steps.tsv").is_file():
        print("usage: python scripts/gpu_check_summary.py RESULTS_DIR (a folder written by "
              "scripts/gpu_check.sh, with steps.tsv)", file=sys.stderr)
        return 2
    results = Path(argv[0])
    summary = summarise(results)
    text = as_text(summary)
    (results / "summary.txt").write_text(text + "\n")
    (results / "summary.json").write_text(json.dumps(summary, indent=2))
    print(text)
    return 1 if any(s["exit"] for s in summary["steps"]) else 0


if __name__ == "__main__":
    sys.exit(main())
