"""`coral templates`: solve one template, build, show and plot a scenario's template library."""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from coral.cli.common import console, emit_json, json_opt, scenario_opt
from coral.cli_support import CoralGroup, check_output_path, err_console, progress_display
from coral.errors import CoralError, unknown


@click.group(cls=CoralGroup)
def templates() -> None:
    """Serving templates: throughput-optimal placements of a model on node multisets (DESIGN §3)."""


def _placement_table(tmpl_dict: dict[str, Any], title: str) -> Table:
    t = Table(title=title)
    for col in ("stage", "nodes (data parallel)", "layers", "stage time ms", "stage tok/s"):
        t.add_column(col)
    start = 0
    for i, st in enumerate(tmpl_dict["stages"]):
        t.add_row(str(i), " + ".join(st["nodes"]), f"{start}-{start + st['layers'] - 1} ({st['layers']})",
                  f"{st['stage_time_ms']:.1f}", f"{st['throughput_tok_per_s']:,.0f}")
        start += st["layers"]
    return t


@templates.command("solve")
@click.option("--model", required=True, help="Built-in model name or config.json path.")
@click.option("--phase", type=click.Choice(["prefill", "decode"]), required=True)
@click.option("--slo-ms", type=click.FloatRange(min=0, min_open=True), required=True, help=(
    "TTFT (prefill) or TPOT (decode) SLO; the placement is held to the budget the planner derives from it "
    "(prefill: ttft_headroom x SLO, 0.5 by default; decode: tpot_headroom x SLO, 0.9, with no KV transfer)."))
@click.option("--nodes", required=True, help="Comma-separated node multiset, e.g. 1xL4,1xL40S,1xL40S.")
@click.option("--prompt-tokens", type=click.FloatRange(min=1), default=1024.0, show_default=True)
@click.option("--output-tokens", type=click.FloatRange(min=0), default=256.0, show_default=True)
@click.option("--solver", type=click.Choice(["exact", "ilp"]), default="exact", show_default=True)
@click.option("--backend", type=click.Choice(["highs", "cpsat"]), default="highs", show_default=True, help="ILP backend (with --solver ilp).")
@click.option("--batches", default="1,2,4,8,16,32,64,128", show_default=True, help="Micro-batch sizes to try.")
@click.option("--n-max", type=click.IntRange(1, 8), default=6, show_default=True)
@json_opt
def templates_solve(model: str, phase: str, slo_ms: float, nodes: str, prompt_tokens: float, output_tokens: float,
                    solver: str, backend: str, batches: str, n_max: int, as_json: bool) -> None:
    """Solve one template: the best placement of MODEL on a node multiset under an SLO."""
    # lazy: the core loads only when the command runs (`coral --help` stays quick)
    from coral.catalog import builtin_catalog, resolve_model_spec
    from coral.perf import Phase, RooflinePerf
    from coral.scenario.schema import PlannerEntry
    from coral.slo import Slo
    from coral.templates.budget import latency_budget_ms
    from coral.templates.library import (
        check_multiset,
        infeasible_reason,
        single_template_spec,
        solve_multiset,
        template_timings,
        template_to_dict,
    )
    from coral.templates.template import Template

    cat = builtin_catalog()
    names = [n.strip() for n in nodes.split(",") if n.strip()]
    check_multiset(names, n_max)
    configs = tuple({c.name: c for c in (cat.config(n) for n in names)}.values())
    names = sorted(cat.config(n).name for n in names)
    spec = resolve_model_spec(model)
    for c in configs:  # each entry runs TP over its GPUs: the degree must be one vLLM accepts
        if spec.tp_problem(c.count) is not None:
            valid = spec.valid_tp(c.count if c.is_group else c.count)
            try:
                spec.check_tp(c.count, c.node_count or c.count)
            except CoralError as exc:
                raise CoralError(f"--nodes {c.name}: {exc}; give the node's TP groups instead, e.g. "
                                 f"{c.node_name}/tp{max(valid)}") from None
    try:
        grid = tuple(sorted({int(b) for b in batches.split(",") if b.strip()}))
    except ValueError:
        raise CoralError(f"--batches must be comma-separated integers, got {batches!r}") from None
    if not grid or grid[0] < 1:
        raise CoralError("--batches must list integers >= 1")
    ph = Phase(phase)
    defaults = PlannerEntry()
    budget_ms = latency_budget_ms(Slo(ttft_ms=slo_ms, tpot_ms=slo_ms), ph, ttft_headroom=defaults.ttft_headroom,
                                  tpot_headroom=defaults.tpot_headroom)
    tspec = single_template_spec(spec, ph, slo_ms, budget_ms, configs, names, prompt_tokens=prompt_tokens,
                                 output_tokens=output_tokens, n_max=n_max, batches=grid)
    perf = RooflinePerf()
    timings = template_timings(perf, tspec)
    solve_fn = None
    if solver == "ilp":
        # lazy: the core loads only when the command runs (`coral --help` stays quick)
        from coral.solver import SolveOptions
        from coral.templates.ilp import solve_placement_ilp

        opts = SolveOptions(backend="cpsat" if backend == "cpsat" else "highs", time_limit_s=120.0, mip_gap=1e-7)

        def solve_fn(problem: Any, floor: float) -> Any:
            placement, _ = solve_placement_ilp(problem, opts)
            return placement if placement is not None and placement.throughput_tok_per_s > floor else None

    t0 = time.perf_counter()
    placement = solve_multiset(timings, names, solver=solve_fn)
    wall = time.perf_counter() - t0
    if placement is None:
        reason = infeasible_reason(perf, timings, names)
        out = {"feasible": False, "reason": reason, "model": spec.name, "phase": phase, "slo_ms": slo_ms,
               "budget_ms": budget_ms, "nodes": names, "solve_s": wall}
        if as_json:
            return emit_json(out)
        console.print(f"[bold red]infeasible:[/] {reason}")
        return
    tmpl = Template(model=spec.name, phase=ph, slo_ms=slo_ms, budget_ms=budget_ms, nodes=tuple(names),
                    placement=placement, prompt_tokens=prompt_tokens)
    d = template_to_dict(tmpl)
    out = {"feasible": True, **d, "solver": solver, "solve_s": wall,
           "latency_breakdown_ms": {"stages": [s["stage_time_ms"] for s in d["stages"]],
                                    "communication": placement.comm_s * 1e3 * (len(placement.stages) - 1)}}
    if as_json:
        return emit_json(out)
    console.print(_placement_table(d, f"{spec.name} {phase} on {' + '.join(names)}  (SLO {slo_ms:g} ms, budget {budget_ms:g} ms)"))
    console.print(f"throughput [bold]{placement.throughput_tok_per_s:,.0f} tok/s[/], micro-batch {placement.micro_batch}, "
                  f"latency {placement.latency_s * 1e3:.1f} ms = stages {' + '.join(f'{s.time_s * 1e3:.1f}' for s in placement.stages)}"
                  f" + comm {placement.comm_s * 1e3 * (len(placement.stages) - 1):.1f}; solved in {wall:.2f} s ({solver})")


def _cache_dir(cache_dir: str | None, no_cache: bool) -> Path | None:
    # lazy: the core loads only when the command runs (`coral --help` stays quick)
    from coral.cache import default_cache_dir

    if no_cache:
        return None
    return Path(cache_dir) if cache_dir else default_cache_dir()


@templates.command("build")
@scenario_opt
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True, help="Worker processes.")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True)
@click.option("--address", default=None, help="Ray cluster address (with --executor ray).")
@click.option("--n-max", type=click.IntRange(1, 8), default=None, help="Override the scenario's n_max.")
@click.option("--rho", type=click.FloatRange(min=1), default=None, help="Override the scenario's rho.")
@click.option("--model", "models", multiple=True, help="Only these models (repeatable).")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None, help="Cache folder (default ~/.cache/coral/templates or $CORAL_CACHE_DIR).")
@click.option("--no-cache", is_flag=True, help="Neither read nor write the cache.")
@json_opt
def templates_build(scenario_name: str, jobs: int, executor: str, address: str | None, n_max: int | None,
                    rho: float | None, models: tuple[str, ...], cache_dir: str | None, no_cache: bool, as_json: bool) -> None:
    """Build the template library of a scenario (cached: unchanged inputs are never solved twice)."""
    # lazy: the core loads only when the command runs (`coral --help` stays quick)
    from coral.scenario import load_scenario
    from coral.templates.library import build_library, specs_for

    s = load_scenario(scenario_name)
    for m in models:
        s.model(m)
    units = len(specs_for(s, n_max, rho, models or None))
    t0 = time.perf_counter()
    with progress_display(TextColumn("{task.description}"), BarColumn(),
                          TextColumn("{task.completed}/{task.total} model-phases"), TimeElapsedColumn(),
                          console=err_console, disable=as_json) as bar:
        task = bar.add_task(f"building templates ({jobs} job{'s' if jobs > 1 else ''})", total=units)

        def progress(st: Any) -> None:
            bar.advance(task)
            rate = st.solved / st.wall_s if st.wall_s > 0 else 0
            bar.console.print(f"  {st.model} {st.phase.value}: {st.memory_ok} tried, {st.solved} solved, "
                              f"{st.feasible} feasible, {st.kept} kept in {st.wall_s:.1f} s"
                              + (" (cached)" if st.cached else f" ({rate:,.0f} multisets/s)"))

        lib = build_library(s, jobs=jobs, cache_dir=_cache_dir(cache_dir, no_cache), n_max=n_max, rho=rho,
                            models=models or None, progress=progress, executor=executor, address=address)
    wall = time.perf_counter() - t0
    rows = [{**asdict(st), "phase": st.phase.value} for st in lib.stats]
    if as_json:
        return emit_json({"scenario": s.name, "wall_s": wall, "templates": len(lib.templates), "units": rows})
    t = Table(title=f"Template library of {s.name} ({wall:.1f} s)")
    for col in ("model", "phase", "multisets", "memory ok (tried)", "solved", "feasible", "kept", "s", "cached"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["model"], r["phase"], str(r["multisets"]), str(r["memory_ok"]), str(r["solved"]), str(r["feasible"]),
                  str(r["kept"]), f"{r['wall_s']:.1f}", "yes" if r["cached"] else "")
    console.print(t)
    for st in lib.stats:  # e.g. the nodes a model is not colocatable on, with the step time that is too slow
        for note in st.notes:
            console.print(note, highlight=False, soft_wrap=True)


@templates.command("show")
@scenario_opt
@click.option("--model", default=None)
@click.option("--phase", type=click.Choice(["prefill", "decode", "colocated"]), default=None,
              help="One kind (default: prefill and decode).")
@click.option("--region", default=None, help="Price templates in this region (default: the scenario's first).")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--n-max", type=click.IntRange(1, 8), default=None)
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None)
@json_opt
def templates_show(scenario_name: str, model: str | None, phase: str | None, region: str | None, top: int,
                   n_max: int | None, cache_dir: str | None, as_json: bool) -> None:
    """The best templates by throughput per $ (homogeneous vs heterogeneous marked)."""
    # lazy: the core loads only when the command runs (`coral --help` stays quick)
    from coral.perf import DEMAND_PHASES, Phase
    from coral.scenario import load_scenario
    from coral.templates.library import build_library, template_to_dict
    from coral.templates.table import rank_by_value

    s = load_scenario(scenario_name)
    region = region or s.regions[0]
    if region not in s.regions:
        raise unknown("region", region, s.regions)
    models = [s.model(model).name] if model else None
    lib = build_library(s, cache_dir=_cache_dir(cache_dir, False), n_max=n_max, models=models)
    prices = {c: p for (r, c), p in s.prices.items() if r == region}
    out = []
    for m in s.models:
        if models and m.name not in models:
            continue
        for ph in ([Phase(phase)] if phase else list(DEMAND_PHASES)):
            for per_usd, cost, t in rank_by_value(lib.of(m.name, ph), prices, top):  # makes only the top ones
                out.append({**template_to_dict(t), "region": region, "cost_usd_per_h": cost,
                            "tok_per_s_per_usd_h": per_usd, "homogeneous": t.is_homogeneous})
    if as_json:
        return emit_json(out)
    table = Table(title=f"Best templates by throughput per $ in {region}")
    for col in ("model", "phase", "nodes", "kind", "stages (layers)", "b", "tok/s", "$/h", "tok/s per $/h", "latency ms"):
        table.add_column(col)
    for r in out:
        table.add_row(r["model"], r["phase"], " + ".join(r["nodes"]), "homo" if r["homogeneous"] else "[bold]hetero[/]",
                  " | ".join(f"{'+'.join(st['nodes'])}:{st['layers']}" for st in r["stages"]), str(r["micro_batch"]),
                  f"{r['throughput_tok_per_s']:,.0f}", f"{r['cost_usd_per_h']:.2f}", f"{r['tok_per_s_per_usd_h']:,.0f}",
                  f"{r['latency_ms']:.0f}")
    console.print(table)


@templates.command("figure")
@click.option("--scenario", "scenario_name", default="extended", show_default=True)
@click.option("--model", default="qwen3-235b-a22b", show_default=True)
@click.option("--phase", type=click.Choice(["prefill", "decode"]), default="prefill", show_default=True)
@click.option("--slo-ms", type=click.FloatRange(min=0, min_open=True), default=1800.0, show_default=True)
@click.option("--region", default=None, help="Price templates in this region (default: the scenario's first).")
@click.option("--n-max", type=click.IntRange(1, 8), default=None, help="Override the scenario's n_max.")
@click.option("--jobs", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None)
@click.option("--out", type=click.Path(file_okay=False), default="runs/fig1", show_default=True)
@json_opt
def templates_figure(scenario_name: str, model: str, phase: str, slo_ms: float, region: str | None, n_max: int | None,
                     jobs: int, cache_dir: str | None, out: str, as_json: bool) -> None:
    """The paper's Fig. 1: best heterogeneous template vs homogeneous H100 ones (throughput per $),
    and the throughput spectrum of homogeneous vs heterogeneous templates (PNG + Markdown)."""
    # lazy: the core loads only when the command runs (`coral --help` stays quick)
    from coral.experiments.motivation import motivation

    check_output_path(out, "--out", folder=True)
    with progress_display(TextColumn("templates"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=err_console, disable=as_json, transient=True) as bar:
        task = bar.add_task(f"templates {model} {phase}", total=None)
        result = motivation(scenario=scenario_name, model=model, phase=phase, slo_ms=slo_ms, region=region, n_max=n_max,
                            jobs=jobs, cache_dir=_cache_dir(cache_dir, False), out=Path(out),
                            step=lambda spec, done, total: bar.update(task, completed=done, total=total))
    if as_json:
        return emit_json({k: v for k, v in result.items() if k != "spectrum"})
    console.print((Path(out) / "figure.md").read_text())
    console.print(f"figures written to {out}/")
