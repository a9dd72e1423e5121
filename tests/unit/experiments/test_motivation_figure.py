"""Fig. 1(b): tick labels that do not overlap, whatever the spread of template throughputs."""
from __future__ import annotations

import itertools

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg

from coral.experiments.motivation import PAPER_GAP_NOTE, spectrum_figure, tok_label


def _visible_labels(ax):
    lo, hi = ax.get_xlim()
    labels = [t for t in ax.xaxis.get_majorticklabels() + ax.xaxis.get_minorticklabels() if t.get_text()]
    return [t for t in labels if lo <= t.get_position()[0] <= hi]


def test_spectrum_tick_labels_do_not_overlap():
    rng = np.random.default_rng(0)
    for lo, hi in ((1.5e4, 1.3e5), (2e3, 9e3), (50.0, 4e5)):
        spectrum = {"homogeneous": list(rng.uniform(lo, hi, 40)), "heterogeneous": list(rng.uniform(lo, hi, 300))}
        fig = spectrum_figure(spectrum)
        canvas = FigureCanvasAgg(fig)
        fig.tight_layout()
        canvas.draw()
        ax = fig.axes[0]
        labels = _visible_labels(ax)
        assert len(labels) >= 2, (lo, hi)
        assert not [t for t in ax.xaxis.get_minorticklabels() if t.get_text()]  # minor ticks unlabelled
        boxes = [t.get_window_extent(canvas.get_renderer()) for t in labels]
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b), (lo, hi, [t.get_text() for t in labels])


def test_short_labels():
    assert ["500", "20k", "1.5M"] == [tok_label(500), tok_label(20000), tok_label(1.5e6)]


def test_gap_note_names_the_ratio():
    assert "(ours 3.7× theirs)" in PAPER_GAP_NOTE.format(ratio=1936 / 526)
