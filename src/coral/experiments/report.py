"""Markdown reports and figures (the paper's Fig. 7–14) for the experiments' results."""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

COLORS = {"coral": "#d62728", "homo": "#1f77b4", "cauchy": "#2ca02c", "template-greedy": "#9467bd",
          "helix (reported)": "#7f7f7f"}


def _plt() -> Any:
    # lazy: matplotlib (only when plotting)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib (only when plotting)
    import matplotlib.pyplot as plt

    return plt


def _fmt(x: Any, spec: str = ",.2f", none: str = "–") -> str:
    if x is None:
        return none
    try:
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)


def _pct(x: Any) -> str:
    return _fmt(x, ".1%")


def _ratio(x: Any) -> str:
    return "–" if x is None else f"{x:.2f}×"


def cell(x: Any) -> str:
    """One Markdown table cell: `|` escaped (a stage list `a:29 | b:6` must stay one cell), no newline."""
    return " ".join(str(x).replace("|", "\\|").split())


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (cells escaped, so each row has as many cells as the header)."""
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        if len(r) != len(header):
            raise ValueError(f"table row has {len(r)} cells for {len(header)} columns: {list(r)!r}")
        lines.append("| " + " | ".join(cell(c) for c in r) + " |")
    return "\n".join(lines)


_SEPARATOR = re.compile(r"^\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")


def _cells(line: str) -> int:
    """Cells of a Markdown table row: unescaped `|` split it (inside code spans too, as GFM does)."""
    body = line.strip()
    bars = len(re.findall(r"(?<!\\)\|", body))
    return bars - body.startswith("|") - (body.endswith("|") and not body.endswith("\\|")) + 1


def table_problems(markdown: str) -> list[str]:
    """Every row of every Markdown table in `markdown` whose cell count differs from its header's
    (a raw `|` in a cell shifts the rest of the row into columns that do not exist)."""
    problems = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines) - 1:
        if lines[i].lstrip().startswith("|") and _SEPARATOR.match(lines[i + 1].strip()):
            want = _cells(lines[i])
            if _cells(lines[i + 1]) != want:
                problems.append(f"line {i + 2}: separator has {_cells(lines[i + 1])} cells, header {want}")
            j = i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                if _cells(lines[j]) != want:
                    problems.append(f"line {j + 1}: {_cells(lines[j])} cells under a {want}-column header: {lines[j]}")
                j += 1
            i = j
        else:
            i += 1
    return problems


# -- figures --------------------------------------------------------------------------------------

def _save(fig: Any, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path.name


def fig_cost_epochs(methods: Mapping[str, Mapping[str, Any]], path: Path, title: str) -> str:
    """Fig. 7(a)/(c): hourly cost per epoch and mean, one bar per method."""
    plt = _plt()
    names = list(methods)
    n_ep = min(len(r["per_epoch"]) for r in methods.values())
    groups = [f"epoch {k + 1}" for k in range(n_ep)] + ["mean"]
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(groups)), 3.6))
    for j, m in enumerate(names):
        vals = [methods[m]["per_epoch"][k]["cost_usd_per_h"] or 0 for k in range(n_ep)] + [methods[m]["cost_usd_per_h"]]
        ax.bar([i + (j - (len(names) - 1) / 2) * width for i in range(len(groups))], vals, width,
               label=m, color=COLORS.get(m))
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("cost ($/h)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def fig_cost_per_model(methods: Mapping[str, Mapping[str, Any]], path: Path, title: str) -> str:
    """Fig. 7(b)/(d): each method's mean hourly cost stacked by model and phase."""
    plt = _plt()
    names = list(methods)
    models = list(next(iter(methods.values()))["per_model"])
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(names)), 3.8))
    cmap = plt.get_cmap("tab20")
    bottoms = [0.0] * len(names)
    for i, model in enumerate(models):
        for k, ph in enumerate(("prefill", "decode")):
            vals = [methods[m]["per_model"][model][f"{ph}_cost_usd_per_h"] for m in names]
            ax.bar(names, vals, bottom=bottoms, color=cmap(2 * i + k), label=f"{model} {ph}",
                   hatch="//" if ph == "decode" else None, edgecolor="white")
            bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    ax.set_ylabel("cost ($/h)")
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=20, labelsize=8)
    ax.legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
    return _save(fig, path)


def fig_goodput_epochs(methods: Mapping[str, Mapping[str, Any]], path: Path, title: str) -> str:
    """Fig. 9/10: goodput over epochs, one line per method."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for m, r in methods.items():
        xs = [k + 1 for k in range(len(r["per_epoch"]))]
        ax.plot(xs, [e["goodput_tok_per_s"] or 0 for e in r["per_epoch"]], marker="o", label=m, color=COLORS.get(m))
    ax.set_xlabel("epoch")
    ax.set_ylabel("goodput (tok/s)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def fig_bars(panels: Sequence[tuple[str, Mapping[str, float | None]]], path: Path, title: str) -> str:
    """Side-by-side bar panels, one bar per method (Fig. 8, 12, 13)."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.4), squeeze=False)
    for ax, (ylabel, vals) in zip(axes[0], panels, strict=True):
        names = list(vals)
        ax.bar(names, [vals[n] or 0 for n in names], color=[COLORS.get(n, "#888888") for n in names])
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def fig_sensitivity(rows: Sequence[Mapping[str, Any]], path: Path, title: str) -> str:
    """Fig. 14: template count, build time and best efficiency / plan cost against n_max, one line per rho."""
    plt = _plt()
    rhos = sorted({r["rho"] for r in rows})
    has_plan = any(r.get("plan_cost_usd_per_h") is not None for r in rows)
    panels: list[tuple[str, Callable[[Mapping[str, Any]], float | None], bool]] = [
        ("templates", lambda r: r["templates"], True), ("build time (s)", lambda r: r["build_s"], True),
        ("best tok/s per $/h, % of grid best (mean over phases)", _relative_best(rows), False)]
    if has_plan:
        panels.append(("Coral plan cost ($/h)", lambda r: r.get("plan_cost_usd_per_h"), False))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.4), squeeze=False)
    for ax, (label, get, log) in zip(axes[0], panels, strict=True):
        for rho in rhos:
            pts = sorted((r["n_max"], get(r)) for r in rows if r["rho"] == rho)
            pts = [(x, y) for x, y in pts if y is not None and (y > 0 or not log)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"rho={rho:g}")
        ax.set_xlabel("n_max")
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return _save(fig, path)


def _relative_best(rows: Sequence[Mapping[str, Any]]) -> Callable[[Mapping[str, Any]], float | None]:
    """Each (model, phase)'s best efficiency as a % of its best over the grid, averaged over phases."""
    top: dict[str, float] = {}
    for r in rows:
        for k, v in r["per_phase"].items():
            if v["best_tok_per_s_per_usd_h"]:
                top[k] = max(top.get(k, 0.0), v["best_tok_per_s_per_usd_h"])

    def get(row: Mapping[str, Any]) -> float | None:
        vals = [100 * v["best_tok_per_s_per_usd_h"] / top[k] for k, v in row["per_phase"].items()
                if v["best_tok_per_s_per_usd_h"] and top.get(k)]
        return sum(vals) / len(vals) if vals else None

    return get


# -- sections -------------------------------------------------------------------------------------

def _methods_table(methods: Mapping[str, Mapping[str, Any]]) -> str:
    rows = [[m, _fmt(r["cost_usd_per_h"]), _fmt(r["plan_cost_usd_per_h"]), _fmt(r["goodput_tok_per_s"], ",.0f"),
             _pct(r["slo_attainment"]), _fmt(r["usd_per_mtok_good"]), _fmt(r["solve_s_mean"], ".3f"),
             _fmt(r.get("throttle"), ".2f"), f"{r['plans'][0]['hetero_instances']}/{r['plans'][0]['instances']}"]
            for m, r in methods.items()]
    return table(["method", "sim $/h (mean)", "plan $/h (mean)", "goodput tok/s", "SLO attainment",
                  "$ per M good tok", "solve s (mean)", "rate factor", "hetero/all instances (epoch 1)"], rows)


def _epochs_table(methods: Mapping[str, Mapping[str, Any]], key: str, spec: str = ",.2f") -> str:
    names = list(methods)
    n_ep = min(len(r["per_epoch"]) for r in methods.values())
    rows = []
    for k in range(n_ep):
        e0 = methods[names[0]]["per_epoch"][k]
        rows.append([f"{k + 1} ({e0['t_start_s']:.0f}–{e0['t_end_s']:.0f} s)"]
                    + [_fmt(methods[m]["per_epoch"][k][key], spec) for m in names])
    return table(["epoch", *names], rows)


def _per_model_table(methods: Mapping[str, Mapping[str, Any]]) -> str:
    names = list(methods)
    models = list(methods[names[0]]["per_model"])
    rows = []
    for model in models:
        pm = {m: methods[m]["per_model"][model] for m in names}
        rows.append([model]
                    + [f"{pm[m]['cost_usd_per_h']:.2f} ({pm[m]['prefill_cost_usd_per_h']:.2f} + "
                       f"{pm[m]['decode_cost_usd_per_h']:.2f})" for m in names]
                    + [f"{_pct(pm[m]['slo_attainment'])} (TTFT {_pct(pm[m]['ttft_slo_attainment'])}, "
                       f"TPOT {_pct(pm[m]['tpot_slo_attainment'])})" for m in names])
    return table(["model", *(f"{m} $/h (prefill + decode)" for m in names), *(f"{m} SLO" for m in names)], rows)


def _target_table(methods: Mapping[str, Mapping[str, Any]]) -> str:
    """Each model's attainment against its target: over the run and in its worst epoch."""
    names = list(methods)
    models = list(methods[names[0]]["per_model"])
    rows = []
    for model in models:
        pm = {m: methods[m]["per_model"][model] for m in names}
        target = pm[names[0]].get("attainment_target")
        rows.append([model, _pct(target)] + [
            f"{_pct(pm[m]['slo_attainment'])} / {_pct(pm[m].get('worst_epoch_attainment'))}"
            + ("" if target is None or (pm[m]["slo_attainment"] or 0) >= target else " (below)") for m in names])
    return table(["model", "target", *(f"{m} run / worst epoch" for m in names)], rows)


def _churn_table(methods: Mapping[str, Mapping[str, Any]]) -> str:
    """Instances started and stopped per epoch, per method (what re-planning costs in start-ups)."""
    names = list(methods)
    n_ep = min(len(r["per_epoch"]) for r in methods.values())
    rows = []
    for k in range(n_ep):
        e0 = methods[names[0]]["per_epoch"][k]
        rows.append([f"{k + 1} ({e0['t_start_s']:.0f}–{e0['t_end_s']:.0f} s)"]
                    + [f"+{methods[m]['per_epoch'][k].get('instances_started') or 0} / "
                       f"−{methods[m]['per_epoch'][k].get('instances_stopped') or 0}" for m in names])
    return table(["epoch", *(f"{m} started / stopped" for m in names)], rows)


def _latency_table(methods: Mapping[str, Mapping[str, Any]]) -> str:
    rows = []
    for m, r in methods.items():
        for model, pm in r["per_model"].items():
            rows.append([m, model, _fmt(pm["rate_per_s"], ".2f"), _fmt(pm["ttft_p50_s"], ".2f"),
                         _fmt(pm["ttft_p99_s"], ".2f"),
                         _fmt(None if pm["tpot_p50_s"] is None else pm["tpot_p50_s"] * 1e3, ".0f"),
                         _fmt(None if pm["tpot_p99_s"] is None else pm["tpot_p99_s"] * 1e3, ".0f"),
                         _pct(pm["prefill_utilization"]), _pct(pm["decode_utilization"])])
    return table(["method", "model", "req/s", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "TPOT p99 ms",
                  "prefill util", "decode util"], rows)


def templates_table(hetero: Sequence[Mapping[str, Any]], limit: int = 15) -> str:
    """The heterogeneous templates a study's plans used (`coral_hetero_templates`), as a Markdown table."""
    if not hetero:
        return "Coral's plans used no heterogeneous template."
    rows = [[t["model"], t["phase"], t["region"], " + ".join(t["nodes"]),
             " | ".join(f"{'+'.join(s['nodes'])}:{s['layers']}" for s in t["stages"]),
             _fmt(t["throughput_tok_per_s"], ",.0f"), _fmt(t["price_usd_per_h"]), t["max_count"],
             ",".join(str(k + 1) for k in t["epochs"])] for t in hetero[:limit]]
    more = f"\n\n({len(hetero) - limit} more in summary.json)" if len(hetero) > limit else ""
    return table(["model", "phase", "region", "nodes", "stages (layers)", "Θ tok/s", "$/h", "max count",
                  "epochs"], rows) + more


def _cheapest_line(what: str, cheapest: Sequence[str]) -> str:
    n = sum(1 for m in cheapest if m == "coral")
    others = [f"{m} in epoch {k + 1}" for k, m in enumerate(cheapest) if m != "coral"]
    verdict = ("Coral is cheapest in every epoch" if n == len(cheapest)
               else f"Coral is cheapest in {n} of {len(cheapest)} epochs ({', '.join(others)})")
    return f"- {what}: {verdict}"


def _cost_ratio_lines(comp: Mapping[str, Any], paper: Mapping[str, float] | None = None) -> str:
    lines = ["Cost ratios are the baseline's $/h over Coral's: above 1× the baseline costs more, below 1× it "
             "is cheaper than Coral." + (" The paper's ratio is in parentheses." if paper else "")]
    for m, r in comp["cost_ratio"].items():
        p = f" (paper: {paper[m]:.2f}×)" if paper and m in paper else ""
        lines.append(f"- {m} / coral: simulated cost {_ratio(r)}, plan cost {_ratio(comp['plan_cost_ratio'][m])}{p}")
    lines.append(_cheapest_line("simulated bill", comp["cheapest_per_epoch"]))
    lines.append(_cheapest_line("plan", comp["cheapest_plan_per_epoch"]))
    return "\n".join(lines)


def _goodput_ratio_lines(comp: Mapping[str, Any], paper: Mapping[str, tuple[float, float]] | None = None) -> str:
    lines = []
    for m, r in comp["goodput_ratio"].items():
        p = f" (paper: {paper[m][0]:.2f}× / {paper[m][1]:.2f}×)" if paper and m in paper else ""
        lines.append(f"- coral / {m} goodput {_ratio(r)}; {m} / coral goodput-normalized cost "
                     f"{_ratio(comp['normalized_cost_ratio'][m])}{p}")
    lines.append(f"- Coral has the highest goodput: **{comp['coral_highest_goodput']}**")
    return "\n".join(lines)


PAPER_COST = {"core": {"homo": 1.62, "cauchy": 1.60, "template-greedy": 1.78},
              "extended": {"homo": 3.14, "cauchy": 2.66, "template-greedy": 1.40}}
PAPER_GOODPUT = {"core": {"homo": (1.66, 1.67), "cauchy": (1.12, 1.73)},
                 "extended": {"homo": (7.64, 8.99), "cauchy": (2.39, 3.27)}}
PAPER_SKEW = {"core": {"large-heavy": {"homo": 1.82, "cauchy": 1.78}, "small-heavy": {"homo": 1.10, "cauchy": 1.10}},
              "extended": {"large-heavy": {"homo": 2.79, "cauchy": 3.47},
                           "small-heavy": {"homo": 2.34, "cauchy": 1.64}}}


def section(name: str, result: Mapping[str, Any], setup: str, fig_dir: Path, prefix: str = "") -> str:
    """The Markdown body of one experiment; figures go to `fig_dir` (linked relative to the report)."""
    rel = f"{prefix}figures/"
    out: list[str] = []
    if name in ("cost", "goodput", "ablation"):
        out = _cost_section(name, result, setup, fig_dir, rel)
    elif name == "skew":
        out = _skew_section(result, setup, fig_dir, rel)
    elif name == "helix":
        out = _helix_section(result, fig_dir, rel)
    elif name == "sensitivity":
        out = _sensitivity_section(result, setup, fig_dir, rel)
    elif name == "spot":
        out = _spot_section(result, setup, fig_dir, rel)
    return "\n\n".join(out)


def _image_link(out: list[str], rel: str) -> Callable[[str, str], None]:
    """A function that appends the Markdown link to figure `file` (in `rel`) to `out`."""
    def img(file: str, alt: str) -> None:
        out.append(f"![{alt}]({rel}{file})")
    return img


def _spot_row(case: str, m: str, r: Mapping[str, Any], ref: float | None) -> list[str]:
    sp = r.get("spot") or {}
    worst = min((pm["slo_attainment"] for pm in r["per_model"].values() if pm["slo_attainment"] is not None),
                default=None)
    worst_epoch = min((pm["worst_epoch_attainment"] for pm in r["per_model"].values()
                       if pm.get("worst_epoch_attainment") is not None), default=None)
    spot_usd = sp.get("cost_usd", {}).get("spot")
    total_usd = sum(sp.get("cost_usd", {}).values()) if sp else None
    return [case, m, _fmt(r["cost_usd_per_h"]),
            _ratio(r["cost_usd_per_h"] / ref if ref else None),
            _pct(spot_usd / total_usd if spot_usd is not None and total_usd else (0.0 if not sp else None)),
            _pct(worst), _pct(worst_epoch), str(sp.get("notices", 0)),
            f"{sp.get('instances_lost', 0)} / {sp.get('nodes_lost', 0)}",
            f"{sp.get('requests_requeued', 0)} / {sp.get('requests_failed', 0)}"]


def _spot_section(result: Mapping[str, Any], setup: str, fig_dir: Path, rel: str) -> list[str]:
    """Spot off, on at the fitted rates and at multiples of them: cost, attainment, preemptions."""
    out: list[str] = []
    img = _image_link(out, rel)
    cases = result["cases"]
    ref = cases["on-demand"]["coral"]["cost_usd_per_h"]
    rows = [_spot_row(case, m, r, ref) for case, methods in cases.items() for m, r in methods.items()]
    out.append("Each case simulates the same traffic; with spot on, preemptions are drawn from the fitted "
               "process of each region (times the case's multiplier); at the cloud's notice the plan is re-made "
               "at once around the pools that are down (until their capacity is back), the noticed instance "
               "serves until its replacement is ready and then drains, and the loss re-queues what is still on "
               "it. *vs on-demand* is sim $/h against on-demand Coral's; *worst model-epoch* the lowest "
               "attainment of any model in any epoch.\n\n"
               + table(["case", "method", "sim $/h", "vs on-demand", "spot share of $", "worst model (run)",
                        "worst model-epoch", "notices", "instances / nodes lost", "requests re-queued / failed"],
                       rows))
    t = result.get("targets", {})
    if "fitted" in t:
        f = t["fitted"]
        out.append(f"Targets at the fitted rates (Coral): sim $/h {_pct(f['cost_share_of_on_demand'])} of on-demand "
                   f"(target ≤ 60 %: {'met' if f['cost_ok'] else 'NOT met'}); every model at its attainment "
                   f"target over the run: {'yes' if f['every_model_at_target'] else 'NO'}; every model ≥ 90 % in "
                   f"every epoch: {'yes' if f['every_epoch_at_90'] else 'NO'}.")
    if "x4" in t:
        x = t["x4"]
        out.append("At 4× the fitted rate: every model ≥ 90 % over the run: "
                   + ("yes" if x["every_model_at_90"] else "NO")
                   + ("; the plan fell back to on-demand" if x["fell_back_to_on_demand"] else "; the plan kept spot")
                   + ".")
    procs = result.get("processes", {})
    if procs:
        out.append("Spot processes at the fitted rates (per region and configuration; V100 traces as the proxy "
                   "for every GPU):\n\n" + table(
                       ["region", "preemptions / node-h", "co-loss share", "mean recovery s", "source"],
                       [[r, _fmt(v["preemption_per_node_h"], ".3f"), _fmt(v["co_loss_share"], ".2f"),
                         _fmt(v["recovery_s"], ",.0f"), v["source"]] for r, v in procs.items()]))
    for case, methods in cases.items():
        out.append(f"### {case}\n\nSLO attainment per model against its target (the whole run / its worst "
                   "epoch):\n\n" + _target_table(methods))
    img(fig_spot(cases, fig_dir / "spot.png", f"{setup}: spot capacity"), "spot cost and attainment")
    return out


def fig_spot(cases: Mapping[str, Mapping[str, Mapping[str, Any]]], path: Path, title: str) -> str:
    """Sim $/h and the worst model's attainment per case (spot off, spot at x rate), one bar per method."""
    plt = _plt()
    names = list(next(iter(cases.values())))
    labels = list(cases)
    width = 0.8 / len(names)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(labels)), 3.6))
    for j, m in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, [cases[c][m]["cost_usd_per_h"] for c in labels], width, label=m, color=COLORS.get(m))
        worst = [min((pm["slo_attainment"] or 0 for pm in cases[c][m]["per_model"].values()), default=0)
                 for c in labels]
        ax2.bar(xs, [100 * w for w in worst], width, label=m, color=COLORS.get(m))
    for a in (ax, ax2):
        a.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
    ax.set_ylabel("sim cost ($/h)")
    ax2.set_ylabel("worst model's SLO attainment (%)")
    ax2.axhline(95, color="k", lw=0.8, ls="--")
    ax2.set_ylim(min(80, ax2.get_ylim()[0]), 100)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _cost_section(name: str, result: Mapping[str, Any], setup: str, fig_dir: Path, rel: str) -> list[str]:
    """The cost, goodput and ablation studies: per availability case, the methods, ratios, epochs and figures."""
    out: list[str] = []
    img = _image_link(out, rel)
    for case, methods in result["cases"].items():
        if name == "ablation":
            out.append(f"### {case} availability")
        out.append(_methods_table(methods))
        comp = result["comparison"][case]
        if "cost_ratio" in comp:
            out.append(_cost_ratio_lines(comp, PAPER_COST.get(setup)))
            out.append("Simulated $/h per epoch (instances paid from start, including initialization and "
                       "draining overlap):\n\n" + _epochs_table(methods, "cost_usd_per_h"))
            out.append("Plan $/h per epoch (the allocator's objective without the init penalty):\n\n"
                       + _epochs_table(methods, "plan_cost_usd_per_h"))
            img(fig_cost_epochs(methods, fig_dir / f"{name}_{case}_cost.png", f"{setup}: hourly cost ({case})"),
                "cost per epoch")
        if "goodput_ratio" in comp:
            out.append(_goodput_ratio_lines(comp, PAPER_GOODPUT.get(setup) if name == "goodput" else None))
            out.append("Goodput (tok/s) per epoch:\n\n" + _epochs_table(methods, "goodput_tok_per_s", ",.0f"))
            out.append("Plan alpha (fraction of the epoch's demand the plan serves) per epoch:\n\n"
                       + _epochs_table(methods, "plan_alpha", ".2f"))
            img(fig_goodput_epochs(methods, fig_dir / f"{name}_{case}_goodput_epochs.png",
                                   f"{setup}: goodput over epochs ({case})"), "goodput over epochs")
            img(fig_bars([("goodput (tok/s)", {m: r["goodput_tok_per_s"] for m, r in methods.items()}),
                          ("$ per M good tokens", {m: r["usd_per_mtok_good"] for m, r in methods.items()}),
                          ("cost ($/h)", {m: r["cost_usd_per_h"] for m, r in methods.items()})],
                         fig_dir / f"{name}_{case}_goodput.png", f"{setup}: {case} availability"), "goodput bars")
        out.append("SLO attainment per model against its target (the whole run / its worst epoch):\n\n"
                   + _target_table(methods))
        out.append("SLO attainment per epoch (requests arriving in the epoch):\n\n"
                   + _epochs_table(methods, "slo_attainment", ".1%"))
        out.append("Instances started / stopped per epoch (the first epoch's starts are the initial plan):\n\n"
                   + _churn_table(methods))
        out.append("Per model:\n\n" + _per_model_table(methods))
        img(fig_cost_per_model(methods, fig_dir / f"{name}_{case}_per_model.png",
                               f"{setup}: cost per model ({case})"), "cost per model")
        out.append("<details><summary>latency and utilization per model</summary>\n\n" + _latency_table(methods)
                   + "\n\n</details>")
    if name == "cost":
        out.append("Heterogeneous templates Coral picked:\n\n" + templates_table(result["coral_hetero_templates"]))
    if name == "goodput":
        out.append("Tight availability (nodes per region/config): "
                   + ", ".join(f"{k} {v}" for k, v in result["availability"].items()))
    if name == "ablation":
        img(fig_bars([("abundant: cost ($/h)", {m: r["cost_usd_per_h"] for m, r in result["cases"]["abundant"].items()}),
                      ("tight: goodput (tok/s)", {m: r["goodput_tok_per_s"] for m, r in result["cases"]["tight"].items()}),
                      ("tight: $ per M good tok", {m: r["usd_per_mtok_good"] for m, r in result["cases"]["tight"].items()})],
                     fig_dir / "ablation.png", f"{setup}: template-greedy vs Coral"), "ablation")
    return out


def _skew_section(result: Mapping[str, Any], setup: str, fig_dir: Path, rel: str) -> list[str]:
    """The demand-skew study: per variant, the methods against the paper's ratio."""
    out: list[str] = []
    img = _image_link(out, rel)
    out.append("Rate multipliers: " + "; ".join(
        f"{v}: " + ", ".join(f"{m} ×{x:.2f}" for m, x in mult.items()) for v, mult in result["rate_multipliers"].items()))
    for variant, methods in result["cases"].items():
        out.append(f"### {variant}")
        out.append(_methods_table(methods))
        out.append(_cost_ratio_lines(result["comparison"][variant], PAPER_SKEW.get(setup, {}).get(variant)))
        out.append(_per_model_table(methods))
        img(fig_cost_epochs(methods, fig_dir / f"skew_{variant}_cost.png", f"{setup}: {variant}"), f"{variant} cost")
        img(fig_cost_per_model(methods, fig_dir / f"skew_{variant}_per_model.png", f"{setup}: {variant} per model"),
            f"{variant} per model")
    return out


def _helix_section(result: Mapping[str, Any], fig_dir: Path, rel: str) -> list[str]:
    """Coral against Helix's reported cost and throughput on Helix's cluster."""
    out: list[str] = []
    img = _image_link(out, rel)
    coral = result["cases"]["helix"]["coral"]
    helix = result["helix"]
    comp = result["comparison"]
    model = next(iter(coral["per_model"].values()))
    out.append(table(["system", "$/h", "decode tok/s", "goodput tok/s", "SLO attainment", "GPUs"], [
        ["helix (reported; whole cluster)", _fmt(helix["cost_usd_per_h"]), _fmt(helix["decode_tok_per_s"], ",.1f"),
         "– (no SLO)", "–", helix["gpus"]],
        ["coral (simulated)", _fmt(coral["cost_usd_per_h"]), _fmt(model["decode_tok_per_s"], ",.1f"),
         _fmt(coral["goodput_tok_per_s"], ",.1f"), _pct(coral["slo_attainment"]),
         "/".join(str(g) for g in comp["coral_gpus_per_epoch"]) + " (per epoch)"]]))
    out.append(f"- cost reduction vs Helix: {comp['cost_reduction']:.1%} (paper: 21 %)\n"
               f"- decode throughput vs Helix: {comp['throughput_gain']:+.1%} (paper: +26 %); "
               f"goodput vs Helix's throughput: {comp['goodput_vs_helix_throughput']:+.1%}")
    out.append(_per_model_table({"coral": coral}))
    out.append(_latency_table({"coral": coral}))
    out.append("Heterogeneous templates Coral picked:\n\n" + templates_table(result["coral_hetero_templates"]))
    img(fig_bars([("cost ($/h)", {"helix (reported)": helix["cost_usd_per_h"], "coral": coral["cost_usd_per_h"]}),
                  ("decode tok/s", {"helix (reported)": helix["decode_tok_per_s"], "coral": model["decode_tok_per_s"]}),
                  ("goodput tok/s", {"helix (reported)": None, "coral": coral["goodput_tok_per_s"]})],
                 fig_dir / "helix.png", "Llama-2-70B on Helix's cluster"), "helix")
    return out


def _sensitivity_section(result: Mapping[str, Any], setup: str, fig_dir: Path, rel: str) -> list[str]:
    """The n_max x rho sweep: library size, build time, plan cost and efficiency per phase."""
    out: list[str] = []
    img = _image_link(out, rel)
    rows = result["rows"]
    phases = list(rows[0]["per_phase"]) if rows else []
    out.append(f"Testbed: {result['testbed']}; efficiency priced in {result['region']}.")
    out.append(table(["n_max", "rho", "templates", "build s", "Coral plan $/h", "plan solve s",
                      *(f"best tok/s per $/h {p}" for p in phases)],
                     [[r["n_max"], f"{r['rho']:g}", f"{r['templates']:,}", _fmt(r["build_s"], ",.1f"),
                       _fmt(r.get("plan_cost_usd_per_h")), _fmt(r.get("plan_solve_s"), ".3f"),
                       *(_fmt(r["per_phase"][p]["best_tok_per_s_per_usd_h"], ",.0f") for p in phases)]
                      for r in rows]))
    if rows:
        img(fig_sensitivity(rows, fig_dir / "sensitivity.png", f"{setup}: n_max x rho"), "sensitivity")
    return out


TITLES = {"cost": "§6.3 End-to-end cost (abundant GPUs)", "goodput": "§6.4 Goodput under tight availability",
          "skew": "§6.5 Demand imbalance (80 % to large / small models)", "helix": "§6.6 Single model vs Helix",
          "ablation": "§6.7 Ablation: template-greedy vs Coral", "sensitivity": "§6.8 Template pruning sensitivity",
          "spot": "Spot capacity in the plan (issue 30)"}


def header(meta: Mapping[str, Any]) -> str:
    """Provenance: how to reproduce this report."""
    rows = [["command", f"`{meta['command']}`"], ["coral version", meta["version"]], ["setup", meta["setup"]],
            ["scenario", meta["scenario"]], ["seed", meta["seed"]], ["arrivals", meta.get("arrival", "scenario default")], ["duration", f"{meta['duration_s']:g} s"],
            ["epoch", f"{meta['epoch_s']:g} s"], ["quick", meta["quick"]],
            ["n_max override", meta["n_max"] if meta["n_max"] is not None else "none (scenario default)"],
            ["started", meta["started_at"]], ["wall time", f"{meta['wall_s']:.1f} s"]]
    return table(["", ""], rows)


ATTAINMENT_GOAL = 0.95  # the share of requests in SLO a plan is meant to reach (DESIGN §4a)

RESULTS_DOC = Path(__file__).resolve().parents[3] / "docs" / "results.md"  # in a source checkout


def _results_link(out_dir: Path) -> str:
    """A link to docs/results.md: relative to the report where the checkout holds it (the report
    is written into a sibling of its final folder, so the relative path is the same)."""
    if RESULTS_DOC.exists():
        return f"[`docs/results.md`]({os.path.relpath(RESULTS_DOC, out_dir.resolve())})"
    return "`docs/results.md` in the Coral source repository"


def _attainments(name: str, result: Mapping[str, Any]) -> list[tuple[str, str, float | None, float]]:
    """(study and case, method, SLO attainment, its goal) for every method run."""
    out = []
    studies = result["experiments"].items() if name == "all" else [(name, result)]
    for study, r in studies:
        for case, methods in r.get("cases", {}).items():
            for m, rec in methods.items():
                goal = rec.get("slo_attainment_target") or ATTAINMENT_GOAL
                out.append((f"{study} / {case}", m, rec.get("slo_attainment"), float(goal)))
    return out


def _worst_coral_model(name: str, result: Mapping[str, Any]) -> str | None:
    """Coral's model furthest from its SLOs over every case: the one number (a TTFT p50 of
    minutes, say) a reader otherwise stumbles on unexplained."""
    studies = result["experiments"].items() if name == "all" else [(name, result)]
    ranked = []
    for study, r in studies:
        for case, methods in r.get("cases", {}).items():
            for model, pm in methods.get("coral", {}).get("per_model", {}).items():
                if pm.get("slo_attainment") is not None:
                    ranked.append((pm["slo_attainment"], f"{study} / {case}", model, pm.get("ttft_p50_s")))
    if not ranked:
        return None
    att, case, model, ttft = min(ranked, key=lambda x: x[0])
    return (f"Coral's model furthest from its SLOs: {model} in {case}, {_pct(att)} of its requests within them"
            + (f" (TTFT p50 {ttft:,.1f} s)." if ttft is not None else "."))


def how_to_read(name: str, result: Mapping[str, Any], out_dir: Path) -> str:
    """The report's opening: what the numbers mean, whether the plans did their job, and where the
    comparison with the paper is discussed."""
    rows = _attainments(name, result)
    if not rows:  # §6.8 alone: libraries only, nothing simulated
        return ("**How to read this report.** This study builds template libraries over a grid of `n_max` "
                "(most nodes per template) and `rho` (most GPU memory per template, as a multiple of the "
                "weights) and plans on each; no traffic is simulated, so there is no SLO attainment here. "
                "The paper's figures come from its own testbed and catalog; " + _results_link(out_dir)
                + " sets our numbers next to them.")
    parts = ["**How to read this report.** Every method plans the same models on the same catalog and "
             "serves the same traffic in the simulator, re-planning every epoch. *SLO attainment* is the share "
             "of requests that met both their TTFT and their TPOT SLO; a plan does its job when it is near "
             f"{ATTAINMENT_GOAL:.0%}. *Plan $/h* is what the allocator rents; *sim $/h* what the simulator "
             "bills, including instances starting up and draining. A cost ratio `X / coral` above 1× means X "
             "costs more than Coral."]
    if rows:
        by_case: dict[str, list[str]] = {}
        for case, m, att, _ in rows:
            by_case.setdefault(case, []).append(f"{m} {_pct(att)}")
        parts.append("SLO attainment here: " + "; ".join(f"{case}: {', '.join(v)}" for case, v in by_case.items()) + ".")
        worst = _worst_coral_model(name, result)
        if worst:
            parts.append(worst)
        short = [(case, m, att, goal) for case, m, att, goal in rows if att is not None and att < goal]
        if any(m == "coral" for _, m, _, _ in short):
            parts.append(f"**Coral's plans fall short of the {ATTAINMENT_GOAL:.0%} goal**, so the costs below compare "
                         "plans that do not serve their traffic within the SLOs: read a cost ratio as the price of "
                         "the capacity each method chose, not as the price of meeting the SLOs. The measured "
                         "causes are in " + _results_link(out_dir) + ".")
    parts.append("The paper's figures (\"paper: …\") come from its own testbed, catalog and SLOs; "
                 + _results_link(out_dir) + " sets our numbers next to them and says why they differ.")
    return "\n\n".join(parts)


def render(name: str, result: Mapping[str, Any], meta: Mapping[str, Any], out_dir: Path) -> str:
    """The full Markdown report of one experiment, writing its figures under `out_dir/figures`."""
    parts = [f"# Coral experiment `{name}` ({meta['setup']})", how_to_read(name, result, out_dir), header(meta)]
    names = list(result["experiments"]) if name == "all" else [name]
    for n in names:
        r = result["experiments"][n] if name == "all" else result
        parts.append(f"## {TITLES[n]}")
        parts.append(section(n, r, meta["setup"], out_dir / "figures"))
    return "\n\n".join(parts) + "\n"
