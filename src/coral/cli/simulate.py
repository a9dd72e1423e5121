"""`coral simulate` (real traces on a method's plans in the discrete-event simulator) and
`coral demo` (a one-minute tour)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from coral.atomic import write_text
from coral.cli.catalog import catalog_configs
from coral.cli.common import (
    avail_opt,
    cache_opt,
    console,
    emit_json,
    jobs_opt,
    json_opt,
    method_opt,
    nmax_opt,
    prepare_with_progress,
    scale_opt,
    scenario_opt,
    spot_opt,
)
from coral.cli.perf import perf_cmd
from coral.cli.scenario import scenario_show
from coral.cli.templates import templates_solve
from coral.cli_support import check_output_path, err_console, progress_display


@click.command("simulate")
@scenario_opt
@method_opt
@avail_opt
@scale_opt
@click.option("--duration-s", type=click.FloatRange(min=0, min_open=True), default=1800.0, show_default=True)
@click.option("--epoch-s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Re-planning period (default: the scenario's, 360 s).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Folder holding traces/ for the built-in datasets (default: $CORAL_DATA_DIR, else the copy shipped with Coral).")
@jobs_opt
@cache_opt
@nmax_opt
@spot_opt
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Write summary.json, requests.csv and plots here.")
@json_opt
def simulate_cmd(scenario_name: str, method: str, availability: str, demand_scale: float, duration_s: float,
                 epoch_s: float | None, seed: int, data_dir: str | None, jobs: int, cache_dir: str | None,
                 n_max: int | None, spot: bool, out: str | None, as_json: bool) -> None:
    """Serve the scenario's real traces on METHOD's plans in the discrete-event simulator,
    re-planning every epoch.

    With spot on (--spot, or regions[].spot in the scenario), spot nodes are preempted as the
    fitted process draws them (seeded by --seed), with AWS's two-minute notice; each notice
    re-plans at once, and the summary gains a spot block (docs/reference/simulator.md)."""
    # lazy: the core (numpy, pydantic, yaml) loads when the command runs, not when `coral` starts
    from coral.experiments.pipeline import run_simulation

    if out:
        check_output_path(out, "--out", folder=True)
    setup = prepare_with_progress(scenario_name, demand_scale, availability, jobs, cache_dir, as_json, n_max, spot=spot)
    t0 = time.perf_counter()
    with progress_display(TextColumn("simulating"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
                          TimeElapsedColumn(), console=err_console, disable=as_json, transient=True) as bar:
        task = bar.add_task("simulating (simulated s)", total=duration_s)
        run = run_simulation(setup, method, duration_s=duration_s, epoch_s=epoch_s, seed=seed, data_dir=data_dir,
                             progress=lambda now, total: bar.update(task, completed=now))
    summary = run.result.summary()
    summary["wall_s"] = time.perf_counter() - t0
    summary["method"] = method
    summary["availability"] = availability
    summary["solve_s"] = [p.solve_s for p in run.plans]
    if out:
        run.result.write(Path(out))
        write_text(Path(out) / "plans.json", json.dumps([p.to_json() for p in run.plans], indent=2, default=str))
        if run.notice_plans:  # the re-plans at spot preemption notices, in time order
            write_text(Path(out) / "notice_plans.json",
                       json.dumps([p.to_json() for p in run.notice_plans], indent=2, default=str))
    if as_json:
        return emit_json(summary)
    t = Table(title=f"{setup.scenario.name} / {method} / {availability}: {duration_s:g} s simulated in {summary['wall_s']:.1f} s")
    for col in ("model", "requests", "TTFT p50 / p99 s", "TPOT p50 / p99 ms", "SLO attainment", "goodput tok/s", "$/h"):
        t.add_column(col)
    for name, m in summary["per_model"].items():
        pre, dec = m["prefill"], m["decode"]
        t.add_row(name, str(m.get("requests", {}).get("arrived", "")),
                  f"{pre['ttft_s'].get('p50', float('nan')):.2f} / {pre['ttft_s'].get('p99', float('nan')):.2f}",
                  f"{dec['tpot_s'].get('p50', float('nan')) * 1e3:.0f} / {dec['tpot_s'].get('p99', float('nan')) * 1e3:.0f}",
                  f"{m.get('slo_attainment', float('nan')):.1%}", f"{m.get('goodput_tok_per_s', float('nan')):,.0f}",
                  f"{m['cost_usd_per_h']:.2f}")  # prefill + decode + colocated instances
    console.print(t)
    r = summary["requests"]
    console.print(f"requests: {r['arrived']} arrived, {r['finished']} finished, {r['failed']} failed, {r['in_flight']} in flight; "
                  f"cost {summary['cost_usd_per_h']:.2f} $/h, goodput {summary['goodput_tok_per_s']:,.0f} tok/s, "
                  f"SLO attainment {summary['slo_attainment']:.1%}")
    if "spot" in summary:
        console.print(_spot_line(summary["spot"]))
    if out:
        console.print(f"results written to {out}")


def _spot_line(sp: dict[str, Any]) -> str:
    """The spot block of a run's summary in two lines: what preemptions took, and the bill."""
    worst = ", ".join(f"{m} {a:.1%}" for m, a in sp["worst_epoch_attainment"].items() if a is not None)
    return (f"spot: {sp['notices']} preemption notices ({sp['zone_events']} zone-wide, {sp['node_events']} single-node, "
            f"{sp['notice_s']:g} s notice) took {sp['instances_noticed']} instances / {sp['nodes_noticed']} nodes, "
            f"{sp['instances_lost']} instances / {sp['nodes_lost']} nodes lost with work on them, "
            f"{sp['requests_requeued']} requests re-queued, {sp['requests_failed']} failed by preemption, "
            f"{sp['spot_starts_refused']} spot starts refused while their pool was down\n"
            f"      node-hours spot {sp['node_hours']['spot']:.2f} (${sp['cost_usd']['spot']:.2f}), "
            f"on-demand {sp['node_hours']['on_demand']:.2f} (${sp['cost_usd']['on_demand']:.2f}); "
            f"worst epoch attainment: {worst or 'none'}")


@click.command("demo")
def demo() -> None:
    """A one-minute tour on the `core` scenario: catalog, scenario, one perf figure, one template.

    (`make demo` runs the main job instead: `coral experiment cost core --duration-s 720`.)
    """
    ctx = click.get_current_context()
    console.rule("coral catalog configs")
    ctx.invoke(catalog_configs, prices=None, as_json=False)
    console.rule("coral scenario show core")
    ctx.invoke(scenario_show, scenario_arg="core", as_json=False)
    console.rule("coral perf --model llama-2-70b --node 1xA100-40GB --phase prefill --batch 1 --prompt-tokens 1000")
    ctx.invoke(perf_cmd, model="llama-2-70b", node="1xA100-40GB", phase="prefill", batch=1, prompt_tokens=1000.0,
               output_tokens=0.0, stages=1, profile=None, as_json=False)
    console.rule("coral templates solve --model qwen3-32b --phase prefill --slo-ms 2500 --nodes 1xL4,1xL40S,1xL40S,2xL40S")
    ctx.invoke(templates_solve, model="qwen3-32b", phase="prefill", slo_ms=2500.0, nodes="1xL4,1xL40S,1xL40S,2xL40S",
               prompt_tokens=2047.8, output_tokens=27.9, solver="exact", backend="highs", batches="1,2,4,8", n_max=6,
               as_json=False)
