"""Simulator plots: each epoch drawn over its own [start, end), labelled, every series visible."""
from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg

from coral.sim.plots import cost_goodput_figure, epoch_steps, instance_counts, instances_figure

ROWS = [
    {"t_start_s": 0.0, "t_end_s": 360.0, "cost_usd_per_h": 30.0, "goodput_tok_per_s": 1500.0,
     "instances": {"a/prefill/r/x": {"active": 2}, "a/decode/r/x": {"active": 1}, "b/prefill/r/y": {"active": 1}}},
    {"t_start_s": 360.0, "t_end_s": 720.0, "cost_usd_per_h": 36.0, "goodput_tok_per_s": 1400.0,
     "instances": {"a/prefill/r/x": {"active": 2, "draining": 1}, "a/decode/r/x": {"active": 1},
                   "b/prefill/r/y": {"active": 1}, "b/decode/r/y": {"starting": 1}}},
]


def test_epoch_steps_start_at_zero_and_cover_every_epoch():
    xs, ys = epoch_steps(ROWS, [30.0, 36.0])
    # drawn with where="post": 30 over [0, 360), 36 over [360, 720)
    assert ([0.0, 360.0, 720.0], [30.0, 36.0, 36.0]) == (xs, ys)
    assert ([], []) == epoch_steps([], [])


def test_instance_counts_per_model_phase_and_epoch():
    assert {"a/decode": [1, 1], "a/prefill": [2, 3], "b/decode": [0, 1], "b/prefill": [1, 1]} == instance_counts(ROWS)


def test_cost_goodput_has_title_legend_and_starts_at_zero():
    fig = cost_goodput_figure(ROWS)
    ax = fig.axes[0]
    assert "cost and goodput per epoch" == ax.get_title()
    assert ["cost ($/h)", "goodput (tok/s in SLO)"] == [t.get_text() for t in ax.get_legend().get_texts()]
    assert (0.0, 720.0) == ax.get_xlim()
    line = ax.get_lines()[0]
    assert [0.0, 360.0, 720.0] == list(line.get_xdata())


def test_instances_are_stacked_integers_with_every_series_in_the_legend():
    fig = instances_figure(ROWS)
    FigureCanvasAgg(fig).draw()
    ax = fig.axes[0]
    labels = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {"a/prefill", "a/decode", "b/prefill", "b/decode"} == labels
    # one bar per (series, epoch), each starting at its epoch's start
    assert 8 == len(ax.patches)
    assert {0.0, 360.0} == {p.get_x() for p in ax.patches}
    ticks = [t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    # stacked: the top of epoch 2 is its total, 6 instances
    assert 6.0 == max(p.get_y() + p.get_height() for p in ax.patches if p.get_x() == 360.0)
    assert (0.0, 720.0) == ax.get_xlim()
