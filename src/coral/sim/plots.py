"""PNG plots of a simulation run (matplotlib, Agg canvas; no global pyplot state)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

if TYPE_CHECKING:
    from coral.sim.result import SimResult


def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})


def write_plots(result: SimResult, folder: Path) -> list[Path]:
    """Write latency CDFs per model, cost and goodput per epoch, and instances per epoch.

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

    rows = result.summary(timing=False)["per_epoch"]
    t = [r["t_end_s"] for r in rows]
    fig = Figure(figsize=(8, 4))
    ax1 = fig.subplots()
    ax1.step(t, [r["cost_usd_per_h"] or 0.0 for r in rows], where="pre", color="tab:blue", label="cost $/h")
    ax1.set_xlabel("time (s)")
    ax1.set_ylabel("cost ($/h)", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.step(t, [r["goodput_tok_per_s"] or 0.0 for r in rows], where="pre", color="tab:green")
    ax2.set_ylabel("goodput (tok/s)", color="tab:green")
    paths.append(folder / "cost_goodput.png")
    _save(fig, paths[-1])

    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    groups = sorted({key.split("/")[0] + "/" + key.split("/")[1] for r in rows for key in r["instances"]})
    for g in groups:
        ax.step(t, [sum(n for key, st in r["instances"].items() if key.startswith(g + "/") for n in st.values())
                    for r in rows], where="post", label=g)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("instances (any state)")
    ax.legend(fontsize=7)
    paths.append(folder / "instances.png")
    _save(fig, paths[-1])
    return paths
