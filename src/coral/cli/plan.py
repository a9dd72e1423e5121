"""`coral plan`: which nodes to rent where, with its --verify / --calibrate, --attainment,
--engine and --running modes."""
from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from coral.atomic import write_text
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
    solve_progress,
    spot_opt,
)
from coral.cli_support import EXIT_INFEASIBLE, check_output_path, err_console
from coral.errors import CoralError


def _mark_derived(data: dict[str, Any], scenario: Any) -> dict[str, Any]:
    """Add `"derived": true/false` to a plan's node and instance entries (a derived shape is one the
    region does not sell, priced by the scenario's `derive_missing_prices`) and each node's cloud
    instance type."""
    for n in data.get("nodes", []):
        n["derived"] = scenario.is_derived(n["region"], n["config"])
        offer = scenario.catalog.offers.get((n["region"], n["config"]))
        n["instance_type"] = offer.instance_type if offer is not None else None  # None: a derived shape
    for i in data.get("instances", []):
        i["derived"] = any(scenario.is_derived(i["region"], c) for c in i["nodes"])
    return data


@click.command("plan")
@scenario_opt
@method_opt
@avail_opt
@scale_opt
@jobs_opt
@cache_opt
@nmax_opt
@spot_opt
@click.option("--time-limit-s", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True, help=(
    "Seconds the solve may take (replaying the traffic for the capacity targets before it is not counted). "
    "A plan that hits it is kept (exit 0) with one line on stderr giving its gap."))
@click.option("--gap", type=click.FloatRange(min=0), default=1e-4, show_default=True, help="Relative MIP gap.")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Also write the plan as JSON here.")
@click.option("--verify", is_flag=True, help=(
    "Simulate the plan for one epoch of the scenario's traffic and print each (model, phase)'s predicted "
    "attainment next to its target. Exit code 3 when a model is predicted below its target."))
@click.option("--calibrate", is_flag=True, help=(
    "Verify, then raise the capacity of the (model, phase) pairs that miss and re-solve, printing each step, "
    "up to --iterations times. Exit code 3 when it does not converge."))
@click.option("--iterations", type=click.IntRange(min=0), default=4, show_default=True,
              help="Most re-solves of --calibrate.")
@click.option("--attainment", "attainment_list", default=None, help=(
    "Comma-separated attainment targets, e.g. 0.5,0.9,0.95,0.99: print the plan's $/h at each (a table; "
    "with --plot, a PNG) instead of one plan."))
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="With --attainment: write the cost-of-attainment plot (PNG) here.")
@click.option("--engine", type=click.Choice(["coral", "vllm"]), default="coral", show_default=True, help=(
    "vllm: only templates vLLM can run (identical data-parallel replicas, or one engine per pipeline stage "
    "at one TP degree), every model's first token from the decode instance (vLLM's P/D proxy, so its KV "
    "transfer counts in TTFT); prints the cost of that restriction next to the unrestricted plan."))
@click.option("--mode", default="auto", show_default=True, help=(
    "How models are served: auto (the ILP picks per model: disaggregated prefill/decode pools, colocated "
    "instances with chunked prefill, whichever costs least at the attainment target), disagg or "
    "colocated (every model so). The baselines (--method other than coral) always plan disaggregated."))
@click.option("--running", "running_path", type=click.Path(dir_okay=False), default=None, help=(
    "Advisory mode: the plan file the fleet runs now. Plans from it (starting instances costs their "
    "init_s), prints the instances to start and drain and the $/h delta, and changes nothing."))
@json_opt
def plan_cmd(scenario_name: str, method: str, availability: str, demand_scale: float, jobs: int, cache_dir: str | None,
             n_max: int | None, time_limit_s: float, gap: float, out: str | None, verify: bool, calibrate: bool,
             iterations: int, attainment_list: str | None, plot_path: str | None, engine: str, mode: str,
             running_path: str | None, as_json: bool, spot: bool = False) -> None:
    """Which nodes to rent where, and how to split each model across them (DESIGN §4).

    Capacity per (model, phase) is sized so that the model's slo_attainment share of its requests
    meets both SLOs on its traffic (docs/reference/allocator.md). Exit codes: 0 plan written, 2 bad input,
    3 --verify / --calibrate predict a model below its attainment target, 4 the plan serves none of
    the demand (nothing written).
    """
    # lazy: the core loads only when the command runs (`coral --help` stays quick)
    from coral.allocator import render_plan
    from coral.allocator.inputs import MODES

    # lazy: the core loads only when the command runs (`coral --help` stays quick)
    from coral.solver import SolveOptions

    if mode not in MODES:  # checked here, not by click.Choice: one line on stderr, exit 2
        raise CoralError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode != "auto" and attainment_list is not None:
        raise CoralError("--mode disagg / colocated goes with a plain plan, --verify, --calibrate, --engine or "
                         "--running, not with --attainment (it plans with --mode auto)")
    options = SolveOptions(backend="highs", time_limit_s=time_limit_s, mip_gap=gap)
    if attainment_list is not None:
        if spot:
            raise CoralError("--spot goes with a plain plan, --verify or --calibrate, not with --attainment")
        return _attainment_sweep(scenario_name, attainment_list, method, demand_scale, availability, jobs, cache_dir,
                                 options, plot_path, out, as_json)
    if plot_path:
        raise CoralError("--plot goes with --attainment (the cost-of-attainment plot)")
    if out:
        check_output_path(out, "--out", folder=False)
    # vLLM's P/D proxy returns the first token from the decode instance: plan every model so
    # (its KV transfer in TTFT), as the vLLM export requires
    overrides = {"planner": {"first_token": "decode"}} if engine == "vllm" else None
    setup = prepare_with_progress(scenario_name, demand_scale, availability, jobs, cache_dir, as_json, n_max, overrides,
                                  spot=spot)
    setup, deploy = _plan_deploy_setup(setup, scenario_name, method, options, engine, running_path, mode)
    result, steps = _solve_checked(setup, method, options, deploy, mode=mode, calibrate=calibrate, verify=verify,
                                   iterations=iterations, as_json=as_json)
    # lazy: the core loads only when the command runs (`coral --help` stays quick)
    from coral.allocator.demand import offered_demand

    offered = offered_demand(setup.scenario)
    data = _mark_derived({"scenario": setup.scenario.name, "availability": availability, "demand_scale": demand_scale,
                          "offered_tok_per_s": [{"model": m, "phase": ph.value, "tok_per_s": v}
                                                for (m, ph), v in offered.items()],
                          **result.to_json()}, setup.scenario)
    if result.alpha <= 0 and any(d.demand_tok_per_s > 0 for d in result.demand):
        why = "; ".join(result.notes) or "no template fits the available nodes"
        if as_json:
            emit_json({**data, "feasible": False})
        err_console.print(f"[bold red]infeasible:[/] the {method} plan serves none of the demand (alpha 0): {why}. "
                          "Allow more nodes (availability), other shapes (configs) or looser SLOs; nothing written.",
                          highlight=False, soft_wrap=True)
        sys.exit(EXIT_INFEASIBLE)
    if steps:
        data["verification"] = _verification_json(steps)
    data.update(_plan_deploy_fields(deploy, result, data, setup))
    if out:
        write_text(Path(out), json.dumps(data, indent=2, default=str))
    if as_json:
        emit_json(data)
    else:
        render_plan(result, console, offered, derived=setup.scenario.derived)
        _print_deploy_fields(data)
        if out:
            console.print(f"plan written to {out}")
    if steps and not steps[-1].ok:
        missing = sorted({f"{v.model} ({v.model_attainment:.1%} < {v.model_target:.0%})" for v in steps[-1].verdicts if not v.ok})
        err_console.print(("calibration did not converge in " f"{iterations} iterations: " if calibrate else
                           "predicted below target: ") + ", ".join(missing))
        raise SystemExit(3)


def _solve_checked(setup: Any, method: str, options: Any, deploy: dict[str, Any], *, mode: str, calibrate: bool,
                   verify: bool, iterations: int, as_json: bool) -> tuple[Any, list[Any]]:
    """The plan, and its calibration steps (--calibrate) or its one verification step (--verify)."""
    # lazy: the core loads only when the command runs (`coral --help` stays quick)
    from coral.experiments.pipeline import plan

    time_limit_s, gap = options.time_limit_s, options.mip_gap
    steps: list[Any] = []
    if calibrate:
        # lazy: the core loads only when the command runs (`coral --help` stays quick)
        from coral.experiments.verify import calibrate_plan

        def show(step: Any) -> None:
            if not as_json:
                _print_verdicts(step.verdicts, f"calibration step {step.iteration}: plan {step.cost_usd_per_h:.2f} $/h"
                                + (f", capacity x{', x'.join(f'{k:.3g} {m}/{ph.value}' for (m, ph), k in step.boost.items())}"
                                   if step.boost else ""))

        result, steps = calibrate_plan(setup, method, iterations=iterations, options=options, on_step=show,
                                       mode=mode)
    else:
        with solve_progress(time_limit_s, as_json):
            result = plan(setup, method, options=options, prev=deploy.get("prev"), demand=deploy.get("demand"),
                          mode=mode)
        _warn_time_limit(result, time_limit_s, gap)
        if verify:
            # lazy: the core loads only when the command runs (`coral --help` stays quick)
            from coral.experiments.verify import CalibrationStep, verify_plan

            steps = [CalibrationStep(iteration=0, cost_usd_per_h=result.cost_usd_per_h, boost={},
                                     verdicts=tuple(verify_plan(setup, result)))]
            if not as_json:
                _print_verdicts(steps[0].verdicts, f"verification: plan {result.cost_usd_per_h:.2f} $/h, one epoch simulated")
    return result, steps


def _verification_json(steps: Sequence[Any]) -> list[dict[str, Any]]:
    """The calibration / verification steps as the plan JSON's `verification` list."""
    return [{"iteration": st.iteration, "cost_usd_per_h": st.cost_usd_per_h, "ok": st.ok,
             "boost": {f"{m}/{ph.value}": k for (m, ph), k in st.boost.items()},
             "pairs": [{"model": v.model, "phase": v.phase.value, "attainment": v.attainment,
                        "phase_target": v.phase_target, "phase_ok": v.phase_ok,
                        "model_attainment": v.model_attainment, "model_target": v.model_target,
                        "model_ok": v.ok} for v in st.verdicts]} for st in steps]


def _warn_time_limit(result: Any, time_limit_s: float, gap: float) -> None:
    """One stderr line when the solve stopped at its time limit: the plan stands (exit 0), but
    it is not proved within --gap, and the user can give it more time."""
    # lazy: the core loads only when the command runs (`coral --help` stays quick)
    from coral.solver import Status

    if result.status is not Status.TIME_LIMIT:
        return
    got = (f"with a gap of {result.gap:.2%} (asked: {gap:.2%})" if result.gap is not None
           else "without a proven gap (the template-greedy fallback)")
    err_console.print(f"time limit: the solve stopped after --time-limit-s {time_limit_s:g} {got}; the plan stands "
                      f"(exit 0), but a cheaper one may exist: give it more time, e.g. --time-limit-s "
                      f"{max(2 * time_limit_s, 120):g}", highlight=False, soft_wrap=True)


def _plan_deploy_setup(setup: Any, scenario_name: str, method: str, options: Any, engine: str,
                       running_path: str | None, mode: str = "auto") -> tuple[Any, dict[str, Any]]:
    """`coral plan --engine` / `--running`: restrict the library, plan the unrestricted baseline, read the
    running plan (docs/howto/deploy.md). Returns the setup to plan with and what `_plan_deploy_fields` reports."""
    # lazy: the core loads only when the command runs (`coral --help` stays quick)
    from coral.experiments.pipeline import plan

    # lazy: the core loads only when the command runs (`coral --help` stays quick)
    from coral.runtime.deploy.advisory import running_counts
    from coral.runtime.deploy.cli import load_running, restrict_setup

    deploy: dict[str, Any] = {"engine": engine, "scenario_source": scenario_name}
    if running_path:
        deploy["running"] = load_running(running_path, setup.scenario)
        deploy["prev"] = running_counts(deploy["running"])
    if engine != "coral":
        deploy["full"] = plan(setup, method, options=options, prev=deploy.get("prev"), mode=mode)
        # the restricted plan serves the same capacity target (sized with the full library), so the
        # two costs compare the templates alone
        deploy["demand"] = {(d.model, d.phase): d.demand_tok_per_s for d in deploy["full"].demand}
        setup, deploy["facts"] = restrict_setup(setup, engine)
    return setup, deploy


def _plan_deploy_fields(deploy: dict[str, Any], result: Any, data: dict[str, Any], setup: Any) -> dict[str, Any]:
    """The plan JSON's deployment fields: scenario source, engine restriction cost, advisory diff."""
    # lazy: the core loads only when the command runs (`coral --help` stays quick)
    from coral.runtime.deploy.cli import advise, engine_report

    src = deploy["scenario_source"]
    out: dict[str, Any] = {"scenario_source": str(Path(src).resolve()) if Path(src).is_file() else src}
    if "full" in deploy:
        out["engine_restriction"] = engine_report(deploy["engine"], deploy["full"], result, deploy["facts"])
    if "running" in deploy:
        out["advisory"] = advise(deploy["running"], {**data, **out}, setup.scenario)
    return out


def _print_deploy_fields(data: dict[str, Any]) -> None:
    """After the plan's tables: the engine restriction's cost and the advisory diff, when asked for."""
    # lazy: the core loads only when the command runs (`coral --help` stays quick)
    from coral.runtime.deploy.cli import print_advice, print_engine_report

    if "engine_restriction" in data:
        print_engine_report(data["engine_restriction"])
    if "advisory" in data:
        print_advice(data["advisory"])


def _print_verdicts(verdicts: Any, title: str) -> None:
    """One row per (model, phase), marked against the phase's own target; then one line per model
    saying whether its target (both SLOs) holds, which is what the exit code follows."""
    table = Table(title=title)
    for col in ("model", "phase", "SLO", "predicted", "phase target", "met"):
        table.add_column(col, justify="left" if col in ("model", "phase", "SLO", "met") else "right")
    for v in verdicts:
        slo = "TTFT" if v.phase.value == "prefill" else "TPOT"
        table.add_row(v.model, v.phase.value, slo, f"{v.attainment:.1%}", f"{v.phase_target:.1%}",
                      "ok" if v.phase_ok else "[bold red]below[/]")
    console.print(table)
    models = {v.model: v for v in verdicts}
    for v in models.values():
        verdict = "holds" if v.ok else "[bold red]MISSED[/]"
        console.print(f"{v.model}: {v.model_attainment:.1%} of {v.requests:,} requests meet both SLOs; "
                      f"target {v.model_target:.0%} {verdict}", highlight=False)
    if any(v.ok and not v.phase_ok for v in verdicts):
        console.print("below: the phase misses the share it was sized for (half the model's allowed misses); "
                      "the model's target can still hold when the other phase misses less", highlight=False)


def _attainment_sweep(scenario_name: str, attainment_list: str, method: str, demand_scale: float, availability: str,
                      jobs: int, cache_dir: str | None, options: Any, plot_path: str | None, out: str | None,
                      as_json: bool) -> None:
    # lazy: the core loads only when the command runs (`coral --help` stays quick)
    from coral.experiments.verify import attainment_costs, plot_attainment_costs

    try:
        targets = [float(x) for x in attainment_list.split(",") if x.strip()]
    except ValueError:
        raise CoralError(f"--attainment must be comma-separated numbers in (0, 1), got {attainment_list!r}") from None
    if not targets:
        raise CoralError("--attainment needs at least one target, e.g. 0.9,0.95")
    for a in targets:
        if not 0 < a < 1:
            raise CoralError(f"--attainment values must be in (0, 1), got {a:g}")

    def note(a: float, p: Any) -> None:
        if not as_json:
            err_console.print(f"attainment {a:.0%}: " + (f"{p.cost_usd_per_h:,.2f} $/h" if not isinstance(p, str)
                                                          else "unreachable"))

    if out:
        check_output_path(out, "--out", folder=False)
    if plot_path:
        check_output_path(plot_path, "--plot", folder=False)
    rows = attainment_costs(scenario_name, targets, method=method, demand_scale=demand_scale, availability=availability,
                            jobs=jobs, cache_dir=Path(cache_dir) if cache_dir else None, options=options, on_target=note)
    solved = [(a, p) for a, p in rows if not isinstance(p, str)]
    if not solved:
        raise CoralError("no attainment target is reachable: " + "; ".join(f"{a:g}: {p}" for a, p in rows))
    models = list(dict.fromkeys(d.model for _, p in solved for d in p.demand))
    per_model = {a: {m: sum(c for (mm, _), c in p.cost_by_model_phase().items() if mm == m) for m in models}
                 for a, p in solved}
    data: dict[str, Any] = {
        "scenario": scenario_name, "method": method, "availability": availability, "demand_scale": demand_scale,
        "rows": [{"attainment": a, "reachable": False, "reason": p} if isinstance(p, str) else
                 {"attainment": a, "reachable": True, "cost_usd_per_h": p.cost_usd_per_h, "status": p.status.value,
                  "cost_by_model": per_model[a]} for a, p in rows]}
    if plot_path:
        plot_attainment_costs([(a, None if isinstance(p, str) else p.cost_usd_per_h) for a, p in rows], plot_path,
                              f"{scenario_name} ({method}): the cost of attainment")
    if out:
        write_text(Path(out), json.dumps(data, indent=2))
    if as_json:
        return emit_json(data)
    base = solved[0][1].cost_usd_per_h
    table = Table(title=f"Cost of attainment ({scenario_name}, {method})")
    for col in ("target", "$/h", f"x {solved[0][0]:.0%}", *(f"{m} $/h" for m in models)):
        table.add_column(col, justify="right")
    for a, p in rows:
        if isinstance(p, str):
            table.add_row(f"{a:.1%}", "unreachable", "-", *("-" for _ in models))
            continue
        table.add_row(f"{a:.1%}", f"{p.cost_usd_per_h:,.2f}", f"{p.cost_usd_per_h / base:.2f}" if base else "-",
                      *(f"{c:,.2f}" for c in per_model[a].values()))
    console.print(table)
    for a, p in rows:
        if isinstance(p, str):
            console.print(f"{a:.1%} is unreachable: {p}", highlight=False)
    if plot_path:
        console.print(f"plot written to {plot_path}")
