"""`coral export`: turn a plan file into SkyPilot task YAMLs or `vllm serve` scripts (no torch needed)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from coral.errors import CoralError
from coral.runtime.deploy.advisory import diff_plans
from coral.runtime.deploy.export import FORMATS, check_out_folder, export_plan, write_export
from coral.runtime.deploy.plan_file import load_plan_file, parse_plan
from coral.runtime.deploy.secrets import SECRETS_DIR, load_secrets
from coral.runtime.deploy.vllm import vllm_templates
from coral.templates.template import TemplateLibrary


@click.command("export")
@click.option("--plan", "plan_path", default=None, type=click.Path(dir_okay=False),
              help="Plan file written by `coral plan --out plan.json` (skypilot, vllm; grafana needs none).")
@click.option("--format", "fmt", required=True, type=click.Choice(FORMATS),
              help="skypilot: a control-plane task and an engine task YAML per (instance, node configuration), launch order in docs/howto/deploy.md; vllm: a `vllm serve` script per instance; grafana: a dashboard of the metrics (Grafana's JSON, import it as it is).")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Folder to write: new, empty, or an earlier export (replaced whole); nothing is written on error.")
@click.option("--scenario", "scenario_name", default=None,
              help="Scenario the plan belongs to (default: the one the plan file names); a mismatch is refused.")
@click.option("--allow-derived", is_flag=True,
              help="Export derived shapes (not sold in their region) anyway, flagged, instead of refusing.")
@click.option("--strict", is_flag=True, help="vllm: refuse (exit 2) when any instance is not expressible, instead of listing it.")
def export_cmd(plan_path: str | None, fmt: str, out: str, scenario_name: str | None, allow_derived: bool, strict: bool) -> None:
    """Export a plan for SkyPilot or vLLM (docs/howto/deploy.md).

    Exit codes: 0 written, 2 bad input (plan of another scenario or an older version, a derived
    shape without --allow-derived, an instance the format cannot express with --strict).
    """
    check_out_folder(out)  # before any work
    if plan_path is None and fmt != "grafana":
        raise CoralError(f"--format {fmt} exports a plan: pass --plan plan.json (from `coral plan --out`)")
    plan = load_plan_file(plan_path, scenario_name) if plan_path is not None else None
    kept = load_secrets(out)  # a re-export keeps the deployment's keys: the running processes hold them
    result = export_plan(plan, fmt, allow_derived=allow_derived, secrets=kept)
    if strict and result.skipped:
        name, why = result.skipped[0]
        raise CoralError(f"--format {fmt} cannot express instance {name}: {why} "
                         f"({len(result.skipped)} such instance line(s); drop --strict to list them)")
    paths = write_export(result, out)
    for w in result.warnings:
        click.echo(f"warning: {w}", err=True)
    click.echo(f"{len(paths)} file(s) written to {out} ({fmt})")
    if result.secrets is not None:
        click.echo(f"  {'kept' if kept else 'new'} API key and CurveZMQ keys in {out}/{SECRETS_DIR}/ (user-only; clients send "
                   f"Authorization: Bearer $(cat {out}/{SECRETS_DIR}/api_key))")
    for name, why in result.skipped:
        click.echo(f"  not expressible in {fmt}: {name}: {why}")




# --- `coral plan --engine vllm` and `coral plan --running` (called from coral.cli.plan_cmd) ---------

ENGINES = ("coral", "vllm")


def restrict_setup(setup: Any, engine: str) -> tuple[Any, dict[str, Any]]:
    """The setup with only the templates `engine` can run, and what the restriction removed.

    Args:
        setup: a `coral.experiments.pipeline.Setup`.
        engine: one of :data:`ENGINES` ("coral" runs every template: the setup is returned as is).

    Returns:
        (setup, facts): facts has `templates` / `kept` counts per the whole library.
    """
    lib = setup.library
    if engine == "coral":
        return setup, {"templates": len(lib.templates), "kept": len(lib.templates)}
    kept = vllm_templates(lib.templates, {m.name: m.spec for m in setup.scenario.models})
    restricted = TemplateLibrary(templates=kept, stats=lib.stats)
    return dataclasses.replace(setup, library=restricted), {"templates": len(lib.templates), "kept": len(kept)}


def engine_report(engine: str, full: Any, restricted: Any, facts: dict[str, Any]) -> dict[str, Any]:
    """The cost of running only what `engine` can express, next to the unrestricted plan."""
    ratio = restricted.cost_usd_per_h / full.cost_usd_per_h if full.cost_usd_per_h > 0 else None
    return {"engine": engine, "unrestricted_cost_usd_per_h": full.cost_usd_per_h,
            "unrestricted_status": full.status.value, "engine_cost_usd_per_h": restricted.cost_usd_per_h,
            "engine_status": restricted.status.value, "engine_cost_ratio": ratio,
            "templates": facts["templates"], "engine_templates": facts["kept"]}


def print_engine_report(rep: dict[str, Any]) -> None:
    ratio = rep["engine_cost_ratio"]
    click.echo(f"engine {rep['engine']}: {rep['engine_templates']} of {rep['templates']} templates runnable; "
               f"plan {rep['engine_cost_usd_per_h']:,.2f} $/h ({rep['engine_status']}) vs "
               f"{rep['unrestricted_cost_usd_per_h']:,.2f} $/h unrestricted ({rep['unrestricted_status']})"
               + (f": x{ratio:.3f}" if ratio is not None else ""))


def load_running(path: str, scenario: Any) -> Any:
    """The running fleet's plan file, checked against the scenario being planned.

    Raises:
        CoralError: as `coral.runtime.deploy.plan_file.parse_plan`, prefixed with --running.
    """
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CoralError(f"--running {path}: no such file (pass the plan file the fleet runs, from `coral plan --out`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CoralError(f"--running {path}: not a readable plan file ({e})") from None
    return parse_plan(data, scenario, f"--running {path}")


def advise(running: Any, data: dict[str, Any], scenario: Any) -> dict[str, Any]:
    """Diff the running plan against the new plan's JSON `data` (as `PlanDiff.to_json`). Changes nothing."""
    return diff_plans(running, parse_plan(data, scenario, "the new plan")).to_json()


def print_advice(d: dict[str, Any]) -> None:
    """Print an advisory diff (`PlanDiff.to_json`) as a table and a $/h line."""
    t = Table(title=f"Advisory: {d['start']} instance(s) to start, {d['drain']} to drain, {d['unchanged']} unchanged "
                    "(nothing was changed)")
    for col in ("region", "template", "running", "planned", "start", "drain", "Δ $/h"):
        t.add_column(col, justify="left" if col in ("region", "template") else "right")
    for c in d["changes"]:
        t.add_row(c["region"] + (" spot" if c.get("spot") else ""), c["template"], str(c["running"]), str(c["planned"]), str(c["start"]), str(c["drain"]),
                  f"{c['delta_usd_per_h']:+,.2f}")
    Console().print(t)
    click.echo(f"fleet {d['running_usd_per_h']:,.2f} $/h -> {d['planned_usd_per_h']:,.2f} $/h "
               f"({d['delta_usd_per_h']:+,.2f} $/h)")
