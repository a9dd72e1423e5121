"""`coral export`: turn a plan file into SkyPilot task YAMLs or `vllm serve` scripts (no torch needed)."""
from __future__ import annotations

import click

from coral.runtime.deploy.export import FORMATS


@click.command("export")
@click.option("--plan", "plan_path", required=True, type=click.Path(dir_okay=False),
              help="Plan file written by `coral plan --out plan.json`.")
@click.option("--format", "fmt", required=True, type=click.Choice(FORMATS),
              help="skypilot: a task YAML per (instance, node configuration); vllm: a `vllm serve` script per instance.")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Folder to write (replaced whole; nothing is written on error).")
@click.option("--scenario", "scenario_name", default=None,
              help="Scenario the plan belongs to (default: the one the plan file names); a mismatch is refused.")
@click.option("--allow-derived", is_flag=True,
              help="Export derived shapes (not sold in their region) anyway, flagged, instead of refusing.")
@click.option("--strict", is_flag=True, help="vllm: refuse (exit 2) when any instance is not expressible, instead of listing it.")
def export_cmd(plan_path: str, fmt: str, out: str, scenario_name: str | None, allow_derived: bool, strict: bool) -> None:
    """Export a plan for SkyPilot or vLLM (docs/deploy.md).

    Exit codes: 0 written, 2 bad input (plan of another scenario or an older version, a derived
    shape without --allow-derived, an instance the format cannot express with --strict).
    """
    from coral.errors import CoralError
    from coral.runtime.deploy.export import export_plan, write_export
    from coral.runtime.deploy.plan_file import load_plan_file

    plan = load_plan_file(plan_path, scenario_name)
    result = export_plan(plan, fmt, allow_derived=allow_derived)
    if strict and result.skipped:
        name, why = result.skipped[0]
        raise CoralError(f"--format {fmt} cannot express instance {name}: {why} "
                         f"({len(result.skipped)} such instance line(s); drop --strict to list them)")
    paths = write_export(result, out)
    for w in result.warnings:
        click.echo(f"warning: {w}", err=True)
    click.echo(f"{len(paths)} file(s) written to {out} ({fmt})")
    for name, why in result.skipped:
        click.echo(f"  not expressible in {fmt}: {name}: {why}")


__all__ = ["export_cmd"]
