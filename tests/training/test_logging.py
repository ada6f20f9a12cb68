"""CR heatmaps: logarithmic colour scale from 1x, cell labels on small grids."""
import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.colors import LogNorm

from dmc.training.logging import ANNOTATE_MAX, cr_heatmap_figure, save_cr_heatmap


def test_one_extreme_layer_does_not_flatten_the_others(tmp_path):
    cr = np.array([[1.5, 2.0, 3.0], [120.0, 110.0, 90.0], [1.0, 4.0, 2.5]])
    fig = cr_heatmap_figure(cr, "t")
    ax = fig.axes[0]
    norm = ax.images[0].norm
    assert isinstance(norm, LogNorm) and norm.vmin == 1.0 and norm.vmax == 120.0
    # 2x sits at log(2) / log(120) of the scale (0.14), not at 1 / 119 as on a linear one
    assert norm(2.0) == pytest.approx(np.log(2) / np.log(120))
    labels = sorted(float(t.get_text()) for t in ax.texts)
    assert labels == sorted(cr.ravel().tolist())
    plt.close(fig)
    assert save_cr_heatmap(cr, tmp_path / "cr.png", "t").stat().st_size > 1000


def test_large_grids_are_not_annotated():
    fig = cr_heatmap_figure(np.full((ANNOTATE_MAX + 1, 4), 2.0), "t")
    assert len(fig.axes[0].texts) == 0 and fig.axes[0].images[0].norm.vmin == 1.0
    plt.close(fig)
