"""Run logging: one-line progress bar, JSONL metrics, optional wandb, CR heatmaps (Fig. 6)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm


class RunLogger:
    """Writes ``metrics.jsonl`` in the run folder and shows a progress bar on rank 0."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, cfg, enabled: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.bar = None
        self.wandb = None
        if not enabled:
            return
        self.total_steps = total_steps
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


def save_cr_heatmap(cr: np.ndarray, path: Path, title: str) -> Path:
    """PNG heatmap of measured CR, ``cr [layers, kv_heads]`` (the paper's Fig. 6)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, heads = cr.shape
    fig, ax = plt.subplots(figsize=(max(4, heads * 0.35 + 2), max(3, layers * 0.3 + 1.5)))
    image = ax.imshow(cr, aspect="auto", cmap="viridis", origin="lower")
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="compression ratio")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
