"""Run logging: one-line progress bar, JSONL metrics, optional wandb, CR heatmaps (Fig. 6)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm


class RunLogger:
    """Writes ``metrics.jsonl`` in the run folder and shows a progress bar on rank 0.

    A run resumed at ``start_step`` first drops the records of steps ``>= start_step`` (logged
    after the checkpoint it resumes from, before a kill): they are logged again as the steps
    re-run, so every step appears once."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, cfg, enabled: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.bar = None
        self.wandb = None
        if not enabled:
            return
        self.total_steps = total_steps
        self._drop_records_from(start_step)
        self.interactive = cfg.logging.progress_bar and sys.stderr.isatty()
        self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True,
                        disable=not self.interactive, file=sys.stderr, unit="step")
        if cfg.logging.wandb:
            try:
                import wandb
            except ImportError as err:
                raise RuntimeError(
                    "logging.wandb=true needs the wandb extra: pip install 'dmc[wandb]'"
                ) from err
            self.wandb = wandb.init(project=cfg.logging.wandb_project, dir=str(run_dir),
                                    mode=cfg.logging.wandb_mode, resume="allow",
                                    name=Path(run_dir).name)

    def _drop_records_from(self, step: int) -> None:
        if not self.path.is_file():
            return
        lines = self.path.read_text().splitlines()
        kept = [line for line in lines if _record_step(line) < step]
        if len(kept) < len(lines):
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(self.path)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))},
                           step=record.get("step"))

    def progress(self, step: int, postfix: dict) -> None:
        """Updates the bar; without a terminal, prints a plain line about 20 times a run."""
        if self.bar is None:
            return
        if not self.interactive:
            every = max(1, self.total_steps // 20)
            if step % every == 0 or step == self.total_steps:
                fields = " ".join(f"{k}={v}" for k, v in postfix.items())
                print(f"step {step}/{self.total_steps} {fields}", file=sys.stderr, flush=True)
            return
        self.bar.n = step
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.refresh()

    def write(self, text: str) -> None:
        """A message line on stderr (stdout stays free for --json output)."""
        if self.enabled:
            tqdm.write(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


def _record_step(line: str) -> float:
    """The ``step`` of one metrics line; a line cut short by a kill counts as the last step."""
    try:
        return json.loads(line).get("step", -1)
    except ValueError:
        return float("inf")


ANNOTATE_MAX = 16


def save_cr_heatmap(cr: np.ndarray, path: Path, title: str) -> Path:
    """PNG heatmap of measured CR, ``cr [layers, kv_heads]`` (the paper's Fig. 6); see
    :func:`cr_heatmap_figure`."""
    import matplotlib.pyplot as plt

    fig = cr_heatmap_figure(cr, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def cr_heatmap_figure(cr: np.ndarray, title: str):
    """A matplotlib figure of ``cr [layers, kv_heads]``.

    The colour scale is logarithmic from 1x (the paper's Fig. 6 is linear): one layer at 120x
    would otherwise paint every other layer the same colour. Grids of at most
    ``ANNOTATE_MAX`` x ``ANNOTATE_MAX`` cells also print each cell's CR.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    layers, heads = cr.shape
    cr = np.maximum(cr, 1.0)
    norm = LogNorm(vmin=1.0, vmax=max(float(cr.max()), 1.0 + 1e-6))
    fig, ax = plt.subplots(figsize=(max(4, heads * 0.45 + 2), max(3, layers * 0.35 + 1.5)))
    image = ax.imshow(cr, aspect="auto", cmap="viridis", origin="lower", norm=norm)
    if layers <= ANNOTATE_MAX and heads <= ANNOTATE_MAX:
        _annotate(ax, cr, norm)
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="compression ratio (log scale)")
    fig.tight_layout()
    return fig


def _annotate(ax, cr: np.ndarray, norm) -> None:
    """Writes each cell's CR in it, dark on the light (high) end of viridis, light elsewhere."""
    for layer, row in enumerate(cr):
        for head, value in enumerate(row):
            colour = "black" if norm(value) > 0.6 else "white"
            ax.text(head, layer, f"{value:.3g}", ha="center", va="center", fontsize=7,
                    color=colour)
