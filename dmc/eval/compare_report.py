"""The report of ``dmc eval compare`` (:mod:`dmc.eval.compare`): a markdown table of quality and
compression per method and CR, the needle table per context length, a plot of quality against the
memory CR, and the files ``compare.json``, ``compare.md``, ``compare.png``; the table and plot of a
DMC run's intermediate checkpoints (the paper's Fig. 4) for ``benchmarks/retrofit_quality.py``."""
from __future__ import annotations

import json
from pathlib import Path


def _ci(low: float, high: float, scale: float = 1.0, digits: int = 1) -> str:
    return f"[{low * scale:.{digits}f}, {high * scale:.{digits}f}]"


def summary_line(r: dict) -> str:
    text = (f"ppl {r['perplexity']:.2f} {_ci(*r['perplexity_ci'], digits=2)}, KL {r['kl']:.4f}, "
            f"top-1 {r['top1_agreement']:.1%}, slots CR {r['slots_cr']:.2f}, memory CR "
            f"{r['memory_cr']:.2f}")
    if "needle_accuracy" in r:
        text += f", needle {r['needle_accuracy']:.1%} {_ci(*r['needle_ci'], 100)}"
    return text


def _row_labels(results: list[dict]) -> None:
    """A policy reported at another CR than it was asked for (OmniKV, at 1x) names the share of
    tokens it attends to, one that evicts its schedule (``prefill``: its memory CR falls below
    its row's as it decodes); a second result with the same label and CR gets ``#2``, ..."""
    seen: dict[tuple, int] = {}
    for r in results:
        label = r["label"]
        if r["method"] == "policy" and r["nominal_cr"] != r["requested_cr"]:
            label += f" (attends 1/{r['requested_cr']:g})"
        elif r["method"] == "policy" and r.get("schedule") and "@" not in label:
            label += f" ({r['schedule']})"
        key = (label, round(r["nominal_cr"], 2))
        seen[key] = seen.get(key, 0) + 1
        r["row"] = label if seen[key] == 1 else f"{label} #{seen[key]}"


def format_table(results: list[dict]) -> str:
    """A markdown table, rows sorted by nominal CR (the control first); a ``steps to CR``
    column when rows carry ``steps_to_cr`` (trained runs: the step at which they first held
    95% of their CR, None: never)."""
    has_needle = any("needle_accuracy" in r for r in results)
    head = ["method", "CR", "ppl [95% CI]", "KL vs control", "top-1 agree"]
    head += ["needle % [95% CI]"] if has_needle else []
    head += ["slots CR", "memory CR"]
    has_steps = any("steps_to_cr" in r for r in results)
    head += ["steps to CR"] if has_steps else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = sorted(range(len(results)),
                   key=lambda i: (results[i]["nominal_cr"], results[i]["method"] != "control", i))
    for i in order:
        r = results[i]
        cells = [r.get("row", r["label"]), f"{r['nominal_cr']:g}x",
                 f"{r['perplexity']:.2f} {_ci(*r['perplexity_ci'], digits=2)}",
                 f"{r['kl']:.4f}", f"{r['top1_agreement']:.1%}"]
        if has_needle:
            cells.append(f"{100 * r['needle_accuracy']:.1f} {_ci(*r['needle_ci'], 100)}"
                         if "needle_accuracy" in r else "-")
        cells += [f"{r['slots_cr']:.2f}x", f"{r['memory_cr']:.2f}x"]
        if has_steps:
            steps = r.get("steps_to_cr", "-")
            cells.append("never" if steps is None else str(steps))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_needle_table(results: list[dict]) -> str:
    """Needle exact match per context length (markdown), with 95% Wilson intervals."""
    rows = [r for r in results if "needle" in r]
    if not rows:
        return ""
    lengths = list(rows[0]["needle"]["per_length"])
    head = ["method", "CR"] + [f"{length} tokens" for length in lengths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (r["nominal_cr"], r["method"] != "control")):
        cells = [r.get("row", r["label"]), f"{r['nominal_cr']:g}x"]
        for length in lengths:
            cell = r["needle"]["per_length"][length]
            cells.append(f"{100 * cell['accuracy']:.0f} {_ci(*cell['accuracy_ci'], 100, 0)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """Decoded-token perplexity, KL and needle accuracy against the memory CR, a line per
    method (the control as a horizontal reference)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("perplexity", "decoded-token perplexity (lower is better)"),
              ("kl", "KL vs control (lower is better)")]
    if any("needle_accuracy" in r for r in results):
        panels.append(("needle_accuracy", "needle exact match (higher is better)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), squeeze=False)
    lines = [label for label in dict.fromkeys(r["label"] for r in results)
             if label not in ("control", "base")]
    palette = plt.get_cmap("tab20" if len(lines) > 10 else "tab10")  # one colour per method
    for label in dict.fromkeys(r["label"] for r in results):
        group = sorted((r for r in results if r["label"] == label), key=lambda r: r["memory_cr"])
        xs = [r["memory_cr"] for r in group]
        for ax, (key, _) in zip(axes[0], panels):
            ys = [r.get(key, float("nan")) for r in group]
            if label in ("control", "base"):
                ax.axhline(ys[0], linestyle="--", linewidth=1, label=label,
                           color="black" if label == "control" else "grey")
            else:
                i = lines.index(label)
                ax.plot(xs, ys, marker="osD^v<>"[i % 7], label=label, color=palette(i % palette.N))
    for ax, (key, title) in zip(axes[0], panels):
        ax.set(xlabel="memory CR (control bytes / method bytes)", title=title)
        ax.set_xscale("log", base=2)
        if key == "kl":
            ax.set_yscale("symlog", linthresh=1e-3)
    axes[0, 0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)



def write_report(results: list[dict], out: Path, settings: dict) -> dict:
    """``compare.json``, ``compare.md`` and ``compare.png`` in ``out``; returns the report."""
    _row_labels(results)
    out.mkdir(parents=True, exist_ok=True)
    report = {"settings": settings, "table": format_table(results),
              "needle_table": format_needle_table(results), "results": results}
    (out / "compare.json").write_text(json.dumps(report, indent=1))
    (out / "compare.md").write_text(report["table"] + "\n\n" + report["needle_table"] + "\n")
    plot(results, out / "compare.png")
    return report


def plot_checkpoints(path_results: list[dict], final: dict | None, path: Path) -> None:
    """Decoded-token perplexity and needle accuracy of the DMC run's checkpoints against their
    measured CR (the paper's Fig. 4), the final (solidified) model marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(path_results, key=lambda r: r["slots_cr"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "perplexity", "decoded-token perplexity"),
                           (axes[1], "needle_accuracy", "needle exact match")):
        ax.plot([r["slots_cr"] for r in rows], [r.get(key, float("nan")) for r in rows],
                marker="o", label="during retrofit (cr_X checkpoints)")
        if final is not None:
            ax.scatter([final["slots_cr"]], [final.get(key, float("nan"))], marker="*", s=150,
                       color="red", label="after solidify", zorder=3)
        ax.set(xlabel="measured CR (slots)", title=title)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def checkpoint_table(rows: list[dict]) -> str:
    """Markdown table of the DMC run's intermediate checkpoints (``cr_X``), by target CR."""
    lines = ["| checkpoint | target CR | slots CR | memory CR | ppl [95% CI] | KL | "
             "needle % [95% CI] |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["nominal_cr"]):
        needle = (f"{100 * r['needle_accuracy']:.1f} {_ci(*r['needle_ci'], 100)}"
                  if "needle_accuracy" in r else "-")
        lines.append(f"| {Path(r['path']).name} | {r['nominal_cr']:g}x | {r['slots_cr']:.2f}x | "
                     f"{r['memory_cr']:.2f}x | {r['perplexity']:.2f} "
                     f"{_ci(*r['perplexity_ci'], digits=2)} | {r['kl']:.4f} | {needle} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
