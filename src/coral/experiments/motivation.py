"""The paper's motivating figures (Fig. 1): heterogeneous vs homogeneous serving templates."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from coral.atomic import building_dir
from coral.errors import CoralError, unknown
from coral.perf.model import Phase
from coral.scenario import load_scenario
from coral.templates.library import build_library, template_to_dict
from coral.templates.template import Template

PAPER_FIG1A = {"heterogeneous": 526.0, "homogeneous H100": (481.0, 460.0, 476.0)}  # tok/s per USD

PAPER_GAP_NOTE = (
    "**Why the absolute numbers are not the paper's** (ours {ratio:.1f}× theirs): the paper measured "
    "its templates on its own engine and priced them with its own prices. Ours come from the "
    "performance model (the roofline calibrated on Helix's per-layer latencies, H100 efficiencies "
    "from Vidur's GEMM profiles; docs/reference/perf.md) and the built-in catalog's prices, not from a "
    "measured engine, so the absolute tok/s per $/h differs. Heterogeneous and homogeneous "
    "templates are timed by the same model, so their *ratio* is what to compare with the paper.")


def motivation(*, scenario: str = "extended", model: str = "qwen3-235b-a22b", phase: str = "prefill",
               slo_ms: float = 1800.0, region: str | None = None, n_max: int | None = None, jobs: int = 2,
               cache_dir: Path | None = None, out: Path,
               step: Callable[[Any, int, int], None] | None = None) -> dict[str, Any]:
    """Fig. 1(a): the best template by throughput per $ against the best homogeneous templates of
    each H100 shape; Fig. 1(b): the throughput spectrum of homogeneous vs heterogeneous templates.

    The templates are built at exactly `slo_ms` (no queueing headroom), as the paper's figure is.

    Returns:
        The figures' numbers (also written to `out/figure.json` with two PNGs and a Markdown note).

    Raises:
        CoralError: an unknown scenario, model, phase or region.
    """
    ph = Phase(phase) if phase in ("prefill", "decode") else None
    if ph is None:
        raise CoralError(f"phase must be 'prefill' or 'decode', got {phase!r}")
    base = load_scenario(scenario)
    base.model(model)
    data = base.source.model_dump()
    for m in data["models"]:
        if m["name"] == model:
            m["ttft_ms" if ph is Phase.PREFILL else "tpot_ms"] = slo_ms
    planner = {"ttft_headroom": 1.0, "tpot_headroom": 1.0, **({"n_max": n_max} if n_max else {})}
    s = load_scenario(scenario, {"models": data["models"], "planner": planner})
    region = region or s.regions[0]
    if region not in s.regions:
        raise unknown("region", region, s.regions)
    lib = build_library(s, jobs=jobs, cache_dir=cache_dir, models=[model], step=step)
    prices = {c: p for (r, c), p in s.prices.items() if r == region}
    rows: list[tuple[float, float, Template]] = []
    for t in lib.of(model, ph):
        if all(c in prices for c in t.counts):
            cost = t.price_usd_per_h(prices)
            rows.append((t.throughput_tok_per_s / cost, cost, t))
    if not rows:
        raise CoralError(f"no {model} {phase} template at {slo_ms:g} ms can be priced in {region}")
    rows.sort(key=lambda r: -r[0])
    best = rows[0]
    h100: dict[str, tuple[float, float, Template]] = {}
    for per_usd, cost, t in rows:
        if t.is_homogeneous and t.nodes[0].endswith("xH100"):
            h100.setdefault(t.nodes[0], (per_usd, cost, t))
    hetero = [r for r in rows if not r[2].is_homogeneous]
    homo = [r for r in rows if r[2].is_homogeneous]
    result = {
        "scenario": s.name, "model": model, "phase": phase, "slo_ms": slo_ms, "region": region,
        "templates": len(rows), "homogeneous": len(homo), "heterogeneous": len(hetero),
        "best": {**template_to_dict(best[2]), "cost_usd_per_h": best[1], "tok_per_s_per_usd": best[0]},
        "best_heterogeneous": ({**template_to_dict(hetero[0][2]), "cost_usd_per_h": hetero[0][1],
                                "tok_per_s_per_usd": hetero[0][0]} if hetero else None),
        "best_homogeneous_h100": {k: {**template_to_dict(v[2]), "cost_usd_per_h": v[1], "tok_per_s_per_usd": v[0]}
                                  for k, v in sorted(h100.items())},
        "paper": PAPER_FIG1A,
        "derived": sorted(c for r, c in s.derived if r == region),  # shapes the region does not sell
        "spectrum": {"homogeneous": sorted(r[2].throughput_tok_per_s for r in homo),
                     "heterogeneous": sorted(r[2].throughput_tok_per_s for r in hetero)},
    }
    _write(out, result)
    return result


def tok_label(x: float, _pos: Any = None) -> str:
    """`20k`, `1.5M`: short labels, so a log axis over a few decades does not crowd its ticks."""
    for scale, unit in ((1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:g}{unit}"
    return f"{x:g}"


def spectrum_figure(spectrum: dict[str, list[float]]) -> Figure:
    """Fig. 1(b): each template's throughput on a log axis, homogeneous and heterogeneous rows.

    Major ticks at 1-2-5 steps with short labels and no minor labels: matplotlib's default labels
    every minor tick of a short log range (`2×10^4`, `3×10^4`, ...), and they overlap.
    """
    fig = Figure(figsize=(7, 2.8))
    ax = fig.subplots()
    for y, (kind, color) in enumerate((("homogeneous", "tab:gray"), ("heterogeneous", "tab:orange"))):
        xs = spectrum.get(kind, [])
        ax.scatter(xs, [y] * len(xs), s=8, alpha=0.4, color=color, label=f"{kind} ({len(xs)})")
    ax.set_yticks([0, 1], ["homogeneous", "heterogeneous"])
    ax.set_ylim(-0.6, 1.6)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(tok_label))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("template throughput (tok/s, log scale)")
    ax.set_title("throughput spectrum of serving templates")
    ax.grid(axis="x", alpha=0.3)
    return fig


def _write(out: Path, result: dict[str, Any]) -> None:
    # lazy: matplotlib (only when plotting)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib (only when plotting)
    import matplotlib.pyplot as plt

    with building_dir(out) as tmp:
        labels, values, colors = [], [], []
        if result["best_heterogeneous"]:
            b = result["best_heterogeneous"]
            labels.append("best hetero\n" + " +\n".join(b["nodes"]))
            values.append(b["tok_per_s_per_usd"])
            colors.append("tab:orange")
        for name, v in result["best_homogeneous_h100"].items():
            labels.append(f"best homo\n{name}")
            values.append(v["tok_per_s_per_usd"])
            colors.append("tab:gray")
        fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(labels)), 4))
        ax.bar(range(len(values)), values, color=colors)
        ax.set_xticks(range(len(values)), labels, fontsize=7)
        ax.set_ylabel(r"throughput per \$ (tok/s per \$/h)")
        ax.set_title(f"{result['model']} {result['phase']} at {result['slo_ms']:g} ms ({result['region']})")
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
        fig.tight_layout()
        fig.savefig(tmp / "fig1a_per_usd.png", dpi=120)
        plt.close(fig)

        spectrum = spectrum_figure(result["spectrum"])
        FigureCanvasAgg(spectrum)
        spectrum.tight_layout()
        spectrum.savefig(tmp / "fig1b_spectrum.png", dpi=120)

        (tmp / "figure.json").write_text(json.dumps(result, indent=2, default=str))
        best_h = max((v["tok_per_s_per_usd"] for v in result["best_homogeneous_h100"].values()), default=None)
        het = result["best_heterogeneous"]
        lines = [f"# Fig. 1 — {result['model']} {result['phase']} at {result['slo_ms']:g} ms in {result['region']}", "",
                 f"{result['templates']} templates ({result['homogeneous']} homogeneous, {result['heterogeneous']} heterogeneous).", ""]
        if het:
            lines.append(f"Best heterogeneous: {' + '.join(het['nodes'])}, {het['tok_per_s_per_usd']:,.0f} tok/s per $/h "
                         f"(paper: {PAPER_FIG1A['heterogeneous']:g}; see below why these differ).")
        for name, v in result["best_homogeneous_h100"].items():
            lines.append(f"Best homogeneous {name}: {' + '.join(v['nodes'])}, {v['tok_per_s_per_usd']:,.0f} tok/s per $/h.")
        if het and best_h:
            lines.append(f"\nHeterogeneous / best homogeneous H100: {het['tok_per_s_per_usd'] / best_h:.2f}x "
                         f"(paper: {526 / 481:.2f}x).")
        if het:
            lines += ["", PAPER_GAP_NOTE.format(ratio=het["tok_per_s_per_usd"] / PAPER_FIG1A["heterogeneous"])]
        lines += ["", "![Fig. 1(a)](fig1a_per_usd.png)", "", "![Fig. 1(b)](fig1b_spectrum.png)", ""]
        (tmp / "figure.md").write_text("\n".join(lines))
