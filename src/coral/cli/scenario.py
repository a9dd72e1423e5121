"""`coral scenario`: list, show and start scenarios."""
from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from coral.atomic import write_text
from coral.cli.common import console, emit_json, json_opt, scenario_opt
from coral.cli_support import CoralGroup, check_output_path, err_console
from coral.errors import CoralError


@click.group(cls=CoralGroup)
def scenario() -> None:
    """Scenarios: models + SLOs + workloads, configurations, regions, prices, planner knobs."""


@scenario.command("list")
def scenario_list() -> None:
    """Built-in scenario names."""
    # lazy: the core (numpy, pydantic, yaml) loads when the command runs, not when `coral` starts
    from coral.scenario import builtin_scenario_names, load_scenario

    for name in builtin_scenario_names():
        click.echo(f"{name:10s} {load_scenario(name).description}")


def scenario_summary(s: Any) -> dict[str, Any]:
    # lazy: the core (numpy, pydantic, yaml) loads when the command runs, not when `coral` starts
    from coral.allocator.demand import capacity_targets, offered_demand
    from coral.perf import Phase

    offered = offered_demand(s)
    targets = capacity_targets(s)
    return {
        "name": s.name, "description": s.description,
        "models": [{"name": m.name, "spec": m.spec.name, "ttft_ms": m.ttft_ms, "tpot_ms": m.tpot_ms,
                    "rate_per_s": m.rate_per_s, "dataset": m.workload.dataset,
                    "prompt_tokens_mean": m.prompt_tokens_mean, "output_tokens_mean": m.output_tokens_mean,
                    "slo_attainment": m.slo.attainment,
                    "demand_prefill_tok_per_s": offered[(m.name, Phase.PREFILL)],
                    "demand_decode_tok_per_s": offered[(m.name, Phase.DECODE)],
                    # the capacity the allocator plans for (queueing model on the traffic sample), as
                    # `allocator.build_inputs` computes it
                    "capacity_target_prefill_tok_per_s": targets[(m.name, Phase.PREFILL)].capacity_tok_per_s,
                    "capacity_target_decode_tok_per_s": targets[(m.name, Phase.DECODE)].capacity_tok_per_s,
                    "regions": list(m.regions) if m.regions else "all"} for m in s.models],
        "configs": [c.name for c in s.configs],
        "regions": [{"name": r, "offers": [{"config": c, "price_usd_per_h": s.prices[(r, c)],
                                            "available": s.availability[(r, c)], "derived": s.is_derived(r, c),
                                            **({"suspect": s.suspect[(r, c)]} if (r, c) in s.suspect else {})}
                                           for c in (cfg.name for cfg in s.configs) if (r, c) in s.prices],
                     **({"spot": spot_summary(s, r)} if any(k[0] == r for k in s.spot) else {})}
                    for r in s.regions],
        "warnings": s.warnings(),
        "perf": s.perf.version, "planner": s.planner.model_dump(),
    }


def spot_summary(s: Any, region: str) -> dict[str, Any]:
    """A spot region's offers and process (only regions with `spot: true` have one)."""
    offers = [s.spot[(region, c.name)] for c in s.configs if (region, c.name) in s.spot]
    p = offers[0].process
    return {"share_cap": {m.name: s.spot_share_cap[(region, m.name)] for m in s.models},
            "process": {"preemption_per_node_h": p.preemption_per_node_h, "co_loss_share": p.co_loss_share,
                        "availability": p.availability, "recovery_s": p.recovery_s, "source": p.source},
            "offers": [{"config": o.config, "instance_type": o.instance_type, "spot_usd_per_h": o.spot_usd_per_h,
                        "on_demand_usd_per_h": o.on_demand_usd_per_h} for o in offers]}


def _print_spot(s: Any, data: dict[str, Any]) -> None:
    for region in data["regions"]:
        if "spot" not in region:
            continue
        spot = region["spot"]
        p = spot["process"]
        caps = ", ".join(f"{m} {cap:g}" for m, cap in spot["share_cap"].items())
        t = Table(title=f"Spot offers in {region['name']} (spot share cap per model: {caps})")
        for col in ("config", "instance type", "spot $/h", "on-demand $/h", "spot / on-demand"):
            t.add_column(col)
        for o in spot["offers"]:
            t.add_row(o["config"], o["instance_type"], f"{o['spot_usd_per_h']:.2f}", f"{o['on_demand_usd_per_h']:.2f}",
                      f"{o['spot_usd_per_h'] / o['on_demand_usd_per_h']:.0%}" if o["on_demand_usd_per_h"] else "-")
        console.print(t)
        console.print(f"spot process: {p['preemption_per_node_h']:.3g} preemptions per node-hour, co-loss share "
                      f"{p['co_loss_share']:.2f}, availability {p['availability']:.0%}, {p['recovery_s'] / 3600:.1f} h to "
                      f"get capacity back; {p['source']}", highlight=False)


@scenario.command("show")
@scenario_opt
@json_opt
def scenario_show(scenario_name: str, as_json: bool) -> None:
    """Print SCENARIO (built-in name or YAML path) resolved: specs, demand, prices, availability."""
    # lazy: the core (numpy, pydantic, yaml) loads when the command runs, not when `coral` starts
    from coral.scenario import load_scenario

    s = load_scenario(scenario_name)
    data = scenario_summary(s)
    for line in data["warnings"]:
        err_console.print(f"[yellow]warning:[/] {line}")
    if as_json:
        return emit_json(data)
    console.print(f"[bold]{s.name}[/]: {s.description}")
    t = Table(title="Models")
    for col in ("model", "TTFT ms", "TPOT ms", "req/s", "dataset", "P̄ / D̄ tokens", "demand prefill / decode tok/s",
                "capacity target prefill / decode tok/s"):
        t.add_column(col)
    for m in data["models"]:
        t.add_row(m["name"], f"{m['ttft_ms']:g}", f"{m['tpot_ms']:g}", f"{m['rate_per_s']:g}", m["dataset"],
                  f"{m['prompt_tokens_mean']:.0f} / {m['output_tokens_mean']:.0f}",
                  f"{m['demand_prefill_tok_per_s']:,.0f} / {m['demand_decode_tok_per_s']:,.0f}",
                  f"{m['capacity_target_prefill_tok_per_s']:,.0f} / {m['capacity_target_decode_tok_per_s']:,.0f}")
    console.print(t)
    t = Table(title="Offers ($/h, available nodes)")
    t.add_column("config")
    for r in s.regions:
        t.add_column(r)
    for c in data["configs"]:
        cells = [f"{s.prices[(r, c)]:.2f} x{s.availability[(r, c)]}{' derived' if s.is_derived(r, c) else ''}"
                 f"{' SUSPECT' if (r, c) in s.suspect else ''}" if (r, c) in s.prices else "-" for r in s.regions]
        t.add_row(c, *cells)
    console.print(t)
    _print_spot(s, data)
    if s.derived:
        console.print("derived: a shape the region does not sell, priced per GPU from the nearest larger shape sold there "
                      "(derive_missing_prices)")
    console.print(f"perf model: {s.perf.version}; planner: {s.planner.model_dump()}")
    console.print("demand: the traffic (req/s x mean tokens); capacity target: what the plan provisions for it "
                  "(see `planner` in docs/scenarios.md)", highlight=False)


@scenario.command("init")
@click.argument("path", type=click.Path(dir_okay=False))
def scenario_init(path: str) -> None:
    """Write a commented starter scenario to PATH (never overwrites); edit it, then
    `coral scenario show PATH`. Every field is listed in docs/scenarios.md."""
    # lazy: the core (numpy, pydantic, yaml) loads when the command runs, not when `coral` starts
    from coral.scenario.starter import STARTER_YAML

    p = check_output_path(path, "PATH", folder=False)
    if p.exists():
        raise CoralError(f"{p} already exists; give a new file name (coral scenario init never overwrites)")
    write_text(p, STARTER_YAML)
    console.print(f"wrote {p}; check it with `coral scenario show {p}`", highlight=False, soft_wrap=True)
