"""PNG plots of a simulation run (matplotlib, Agg canvas; no global pyplot state)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator


class PlottedRun(Protocol):
    """What the plots read of a run (`coral.sim.result.SimResult` is one): per-request latencies
    and model indices, the model names and the summary's per-epoch rows. A protocol rather than
    an import, so that `result` (which writes the plots) and this module form no cycle."""

    @property
    def models(self) -> tuple[str, ...]: ...
    @property
    def model(self) -> np.ndarray: ...
    @property
    def ttft_s(self) -> np.ndarray: ...
    @property
    def tpot_s(self) -> np.ndarray: ...
    @property
    def e2e_s(self) -> np.ndarray: ...
    def summary(self, *, timing: bool = True) -> dict[str, Any]: ...


def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})


def epoch_steps(rows: Sequence[Mapping[str, Any]], values: Sequence[float]) -> tuple[list[float], list[float]]:
    """x, y of a step line holding each epoch's value over its own [start, end).

    `plt.step(x, y, where="post")` draws `y[k]` from `x[k]` to `x[k+1]`: the x are the epochs'
    starts plus the last end, and the last value is repeated so the final epoch is drawn too.
    """
    if not rows:
        return [], []
    xs = [float(r["t_start_s"]) for r in rows] + [float(rows[-1]["t_end_s"])]
    ys = [float(v) for v in values]
    return xs, ys + ys[-1:]


def _group(key: str) -> str:
    """`model/phase` of an instance key `model/phase/region/...`."""
    parts = key.split("/")
    return "/".join(parts[:2])


def instance_counts(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[int]]:
    """Instances (any lifecycle state) per `model/phase`, one count per epoch."""
    groups = sorted({_group(key) for r in rows for key in r["instances"]})
    return {g: [sum(n for key, st in r["instances"].items() if _group(key) == g for n in st.values()) for r in rows]
            for g in groups}


def _mark_notices(ax: Any, notices_s: Sequence[float]) -> list[Any]:
    """A thin red line at every spot preemption notice; the legend handle (none without notices)."""
    lines = [ax.axvline(t, color="tab:red", linewidth=0.8, linestyle=":", alpha=0.8) for t in notices_s]
    if lines:
        lines[0].set_label("spot preemption notice")
    return lines[:1]


def cost_goodput_figure(rows: Sequence[Mapping[str, Any]], notices_s: Sequence[float] = ()) -> Figure:
    """Cost ($/h, left axis) and goodput (tok/s, right axis) per epoch, each over [start, end),
    with a mark at every spot preemption notice."""
    fig = Figure(figsize=(8, 4))
    ax1 = fig.subplots()
    xs, cost = epoch_steps(rows, [r["cost_usd_per_h"] or 0.0 for r in rows])
    (l1,) = ax1.step(xs, cost, where="post", color="tab:blue", label="cost ($/h)")
    ax1.set_xlabel("time (s)")
    ax1.set_ylabel("cost ($/h)", color="tab:blue")
    ax1.set_ylim(bottom=0)
    ax2 = ax1.twinx()
    xs, good = epoch_steps(rows, [r["goodput_tok_per_s"] or 0.0 for r in rows])
    (l2,) = ax2.step(xs, good, where="post", color="tab:green", label="goodput (tok/s in SLO)")
    ax2.set_ylabel("goodput (tok/s)", color="tab:green")
    ax2.set_ylim(bottom=0)
    if xs:
        ax1.set_xlim(xs[0], xs[-1])
    ax1.set_title("cost and goodput per epoch")
    ax1.legend(handles=[l1, l2, *_mark_notices(ax1, notices_s)], loc="lower right", fontsize=8)
    return fig


def instances_figure(rows: Sequence[Mapping[str, Any]], notices_s: Sequence[float] = ()) -> Figure:
    """Instances per model and phase in each epoch, stacked, so no series hides another, with a
    mark at every spot preemption notice."""
    fig = Figure(figsize=(9, 4))
    ax = fig.subplots()
    counts = instance_counts(rows)
    starts = [float(r["t_start_s"]) for r in rows]
    widths = [float(r["t_end_s"]) - float(r["t_start_s"]) for r in rows]
    bottom = [0] * len(rows)
    cmap = matplotlib.colormaps["tab20"]
    handles = []
    for i, (g, ns) in enumerate(counts.items()):
        color = cmap(i % 20)
        ax.bar(starts, ns, width=widths, bottom=bottom, align="edge", color=color, edgecolor="white", linewidth=0.5)
        handles.append(Patch(color=color, label=g))
        bottom = [b + n for b, n in zip(bottom, ns, strict=True)]
    if rows:
        ax.set_xlim(starts[0], float(rows[-1]["t_end_s"]))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("time (s)")
    ax.set_ylabel("instances (any state), stacked")
    ax.set_title("serving instances per model and phase in each epoch")
    ax.legend(handles=handles[::-1] + _mark_notices(ax, notices_s), fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1))
    return fig


def write_plots(result: PlottedRun, folder: Path) -> list[Path]:
    """Write latency CDFs per model, cost and goodput per epoch, and instances per epoch (the
    last two mark every spot preemption notice).

    Args:
        result: the run.
        folder: created if missing.

    Returns:
        The files written.
    """
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    fig = Figure(figsize=(12, 4))
    axes = fig.subplots(1, 3)
    for what, ax, values in (("TTFT", axes[0], result.ttft_s), ("TPOT", axes[1], result.tpot_s),
                             ("end-to-end", axes[2], result.e2e_s)):
        for m, name in enumerate(result.models):
            x = np.sort(values[(result.model == m) & ~np.isnan(values)])
            if x.size:
                ax.plot(x, np.arange(1, x.size + 1) / x.size, label=name)
        ax.set_xlabel(f"{what} (s)")
        ax.set_ylabel("CDF")
        ax.set_xscale("symlog", linthresh=1e-3)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    paths.append(folder / "latency_cdf.png")
    _save(fig, paths[-1])

    summary = result.summary(timing=False)
    rows = summary["per_epoch"]
    notices = [e["t_s"] for e in summary["spot"]["events"]] if "spot" in summary else []
    paths.append(folder / "cost_goodput.png")
    _save(cost_goodput_figure(rows, notices), paths[-1])
    paths.append(folder / "instances.png")
    _save(instances_figure(rows, notices), paths[-1])
    return paths
