"""What the `coral` command modules share: the results console, `--json` output, and the options
and library preparation of `coral plan` and `coral simulate`."""
from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from coral.cli_support import err_console, pick_scenario, progress_display, stdout_console

console = stdout_console()


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


json_opt = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def scenario_opt(f: Callable[..., Any]) -> Callable[..., Any]:
    """The scenario a command works on: a positional SCENARIO (built-in name or YAML file), with
    `--scenario` kept as an alias; the command receives it as `scenario_name`."""

    @functools.wraps(f)
    def wrapper(*args: Any, scenario_arg: str | None, scenario_flag: str | None, **kwargs: Any) -> Any:
        return f(*args, scenario_name=pick_scenario(scenario_arg, scenario_flag), **kwargs)

    wrapper = click.option("--scenario", "scenario_flag", default=None, metavar="SCENARIO",
                           help="The same as the SCENARIO argument: a built-in name or a YAML file.")(wrapper)
    return click.argument("scenario_arg", metavar="SCENARIO", required=False)(wrapper)

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
spot_opt = click.option("--spot", is_flag=True, help=(
    "Offer spot instances in every region that sells them, beside the on-demand ones (a scenario can "
    "also turn spot on per region: regions[].spot). The plan mixes them: each spot instance counts at "
    "the chance that all its nodes survive an epoch and a replacement's start-up, under preemption "
    "rates fitted from AWS spot traces (V100, the proxy for every GPU); docs/reference/allocator.md."))
nmax_opt = click.option("--n-max", type=click.IntRange(1, 8), default=None,
                         help="Override the scenario's n_max (most nodes per template) for the library.")


def prepare_with_progress(scenario_name: str, demand_scale: float, availability: str, jobs: int,
                           cache_dir: str | None, quiet: bool, n_max: int | None = None,
                           overrides: Any = None, spot: bool = False) -> Any:
    # lazy: the core (numpy, pydantic, yaml) loads when the command runs, not when `coral` starts
    from coral.experiments.pipeline import prepare, scaled_scenario
    from coral.scenario import with_spot

    scenario = scaled_scenario(scenario_name, demand_scale, overrides)
    if spot:
        scenario = with_spot(scenario)
    with progress_display(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("multisets"),
                          TimeElapsedColumn(), TimeRemainingColumn(), console=err_console, disable=quiet,
                          transient=True) as bar:
        tasks: dict[Any, Any] = {}

        def step(spec: Any, done: int, total: int) -> None:
            key = (spec.model.name, spec.phase)
            if key not in tasks:
                tasks[key] = bar.add_task(f"templates {spec.model.name} {spec.phase.value}", total=total)
            bar.update(tasks[key], completed=done)

        setup = prepare(scenario, availability=availability, jobs=jobs, n_max=n_max,
                        cache_dir=Path(cache_dir) if cache_dir else None, step=step)
        # the capacity targets replay each model's traffic sample (seconds per model at a large
        # demand; kept in memory and on disk for the plan that follows)
        # lazy: the core (numpy, pydantic, yaml) loads when the command runs, not when `coral` starts
        from coral.allocator.demand import capacity_targets

        task = bar.add_task("capacity targets (replaying each model's traffic)", total=len(scenario.models))
        capacity_targets(setup.scenario, library=setup.library,
                         progress=lambda done, total: bar.update(task, completed=done, total=total))
        return setup


@contextmanager
def solve_progress(limit_s: float, quiet: bool) -> Iterator[None]:
    """A bar up to the solve's time limit while the allocation solves (the solver reports
    nothing until it returns); in a pipe a line every few seconds, none for a quick solve."""
    with progress_display(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=err_console,
                          disable=quiet, transient=True) as bar:
        task = bar.add_task(f"solving the allocation (time limit {limit_s:g} s, seconds)", total=limit_s)
        stop = threading.Event()

        def beat() -> None:
            began = time.monotonic()
            while not stop.wait(1.0):
                bar.update(task, completed=min(time.monotonic() - began, 0.99 * limit_s))

        ticker = threading.Thread(target=beat, name="solve-progress", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
            bar.remove_task(task)
