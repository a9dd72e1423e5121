"""Render a `Plan` as rich tables (nodes per region, instances, demand vs capacity, cost)."""
from __future__ import annotations

from collections.abc import Collection, Mapping

from rich.console import Console
from rich.table import Table

from coral.allocator.plan import Plan
from coral.perf.model import Phase


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def plan_tables(plan: Plan, offered: Mapping[tuple[str, Phase], float] | None = None,
                derived: Collection[tuple[str, str]] = ()) -> list[Table]:
    """The plan as five tables: summary, nodes per region, instances, demand vs capacity and cost
    by (model, phase), and each model's serving mode (disagg, colocated or mix) with its $/h. No
    I/O; the caller prints them. A colocated instance's capacity counts in both phases' lines.

    The demand lines hold the capacity the allocator was asked for (the *capacity target*: the
    capacity that keeps the attainment target on the model's traffic, `coral.allocator.demand`);
    `offered`, the traffic itself in tok/s per (model, phase), adds it as its own column, so neither
    is mistaken for the other. `derived` (region, config) shapes, which the region does not sell,
    are marked "(derived)"."""
    summary = Table(title=f"Plan ({plan.method})", show_header=False)
    summary.add_column("field")
    summary.add_column("value", justify="right")
    summary.add_row("status", plan.status.value)
    summary.add_row("cost $/h", f"{plan.cost_usd_per_h:.2f}")
    if any(i.spot for i in plan.instances):
        summary.add_row("of it spot $/h", f"{plan.spot_cost_usd_per_h:.2f}")
    if plan.init_penalty_usd_per_h:
        summary.add_row("start-up penalty $/h", f"{plan.init_penalty_usd_per_h:.2f}")
    summary.add_row("alpha (served fraction)", f"{plan.alpha:.4f}" + (" (goodput mode)" if plan.goodput_mode else ""))
    summary.add_row("solve time s", f"{plan.solve_s:.3f}")
    summary.add_row("MIP gap", _fmt(plan.gap, ".2e"))
    for note in plan.notes:
        summary.add_row("note", note)

    nodes = Table(title="Nodes per region")
    for col, just in (("region", "left"), ("config", "left"), ("nodes", "right"), ("available", "right"),
                      ("binding", "center")):
        nodes.add_column(col, justify=just)  # type: ignore[arg-type]
    for n in sorted(plan.nodes, key=lambda n: (n.region, n.config, n.spot)):
        config = n.config + (" (derived)" if (n.region, n.config) in derived else "") + (" spot" if n.spot else "")
        nodes.add_row(n.region, config, str(n.count), "∞" if n.available is None else str(n.available),
                      "yes" if n.binding else "")

    inst = Table(title="Serving instances")
    for col, just in (("model", "left"), ("phase", "left"), ("region", "left"), ("nodes", "left"),
                      ("stages (layers)", "left"), ("count", "right"), ("tok/s each", "right"),
                      ("$/h each", "right")):
        inst.add_column(col, justify=just)  # type: ignore[arg-type]
    for i in sorted(plan.instances, key=lambda i: (i.model, i.phase.value, i.region, i.spot, i.template.nodes)):
        stages = " | ".join(f"{'+'.join(s.nodes)}:{s.layers}" for s in i.template.placement.stages)
        names = "+".join(c + ("*" if (i.region, c) in derived else "") for c in i.template.nodes)
        each = f"{i.throughput_tok_per_s:,.0f}"
        if i.phase is Phase.COLOCATED:  # prompt + generated tokens/s, and its chunk
            each = f"{each} + {i.template.decode_tok_per_s or 0:,.0f} (chunk {i.template.chunk_tokens})"
        if i.spot:  # what it counts for: its capacity times the chance that all its nodes survive
            each = f"{each} x {i.capacity_share:.3f}"
        inst.add_row(i.model, i.phase.value, i.region + (" spot" if i.spot else ""), names, stages, str(i.count), each,
                     f"{i.price_usd_per_h:.2f}")

    dem = Table(title="Demand vs capacity")
    cols = ("model", "phase", *(("demand tok/s",) if offered is not None else ()), "capacity target tok/s",
            "planned capacity tok/s", "of target", *(("load",) if offered is not None else ()), "$/h")
    for col in cols:
        dem.add_column(col, justify="left" if col in ("model", "phase") else "right")
    cost = plan.cost_by_model_phase()
    for d in plan.demand:
        raw: tuple[str, ...] = ()
        load: tuple[str, ...] = ()
        if offered is not None:
            o = offered.get((d.model, d.phase))
            raw = ("-" if o is None else f"{o:,.0f}",)
            load = ("-" if o is None or d.capacity_tok_per_s <= 0 else f"{o / d.capacity_tok_per_s:.1%}",)
        dem.add_row(d.model, d.phase.value, *raw, f"{d.demand_tok_per_s:,.0f}", f"{d.capacity_tok_per_s:,.0f}",
                    f"{d.served_fraction:.1%}", *load, f"{cost.get((d.model, d.phase), 0.0):.2f}")
    modes = Table(title="Serving mode per model")
    for col in ("model", "mode", "$/h"):
        modes.add_column(col, justify="right" if col == "$/h" else "left")
    for m, mode in plan.model_modes().items():
        modes.add_row(m, mode, f"{sum(c for (mm, _), c in cost.items() if mm == m):.2f}")
    return [summary, nodes, inst, dem, modes]


def render_plan(plan: Plan, console: Console | None = None,
                offered: Mapping[tuple[str, Phase], float] | None = None,
                derived: Collection[tuple[str, str]] = ()) -> None:
    """Print the plan's tables to `console` (default: a new stdout console); `offered` and `derived`
    as for `plan_tables`."""
    console = console or Console()
    for table in plan_tables(plan, offered, derived):
        console.print(table)
    if any((i.region, c) in derived for i in plan.instances for c in i.template.nodes):
        console.print("* derived shape: not sold in that region; priced per GPU from the nearest larger shape sold there")
