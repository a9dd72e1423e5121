"""What the `coral` command modules share: the results console, `--json` output, and the options
and library preparation of `coral plan` and `coral simulate`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from coral.cli_support import err_console, progress_display, stdout_console

console = stdout_console()


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


json_opt = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")

scenario_opt = click.option("--scenario", "scenario_name", required=True, help="Built-in scenario name or YAML path.")
method_opt = click.option("--method", type=click.Choice(["coral", "homo", "cauchy", "template-greedy"]), default="coral",
                           show_default=True, help="Allocation method (the baselines use the same templates and catalog).")
avail_opt = click.option("--availability", type=click.Choice(["abundant", "tight"]), default="abundant", show_default=True,
                          help="abundant: the scenario's availability. tight: only the (region, config) pairs Coral's "
                               "own abundant plan rents, each capped at that count + 25 % (75 % for extended), every "
                               "other pair 0. Coral's plan at the same demand always fits it, so `coral plan` is "
                               "unchanged; it limits the baselines and the simulator's re-plans.")
scale_opt = click.option("--demand-scale", type=float, default=1.0, show_default=True, help="Multiply every model's rate.")
jobs_opt = click.option("--jobs", type=click.IntRange(min=1), default=2, show_default=True, help="Processes for a library build.")
cache_opt = click.option("--cache-dir", type=click.Path(file_okay=False), default=None, help="Template cache folder.")
nmax_opt = click.option("--n-max", type=click.IntRange(1, 8), default=None,
                         help="Override the scenario's n_max (most nodes per template) for the library.")


def prepare_with_progress(scenario_name: str, demand_scale: float, availability: str, jobs: int,
                           cache_dir: str | None, quiet: bool, n_max: int | None = None) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from coral.experiments.pipeline import prepare, scaled_scenario

    scenario = scaled_scenario(scenario_name, demand_scale)
    with progress_display(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("multisets"),
                          TimeElapsedColumn(), TimeRemainingColumn(), console=err_console, disable=quiet,
                          transient=True) as bar:
        tasks: dict[Any, Any] = {}

        def step(spec: Any, done: int, total: int) -> None:
            key = (spec.model.name, spec.phase)
            if key not in tasks:
                tasks[key] = bar.add_task(f"templates {spec.model.name} {spec.phase.value}", total=total)
            bar.update(tasks[key], completed=done)

        return prepare(scenario, availability=availability, jobs=jobs, n_max=n_max,
                       cache_dir=Path(cache_dir) if cache_dir else None, step=step)
