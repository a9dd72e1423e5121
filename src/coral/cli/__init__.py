"""The `coral` command: the `main` group and one module per command group, each of which parses,
calls the core and writes output (parse -> load config -> call the core -> write outputs)."""
from __future__ import annotations

import click

from coral import __version__
from coral.cli.calibrate import calibrate_cmd
from coral.cli.catalog import catalog
from coral.cli.perf import perf_cmd
from coral.cli.plan import plan_cmd
from coral.cli.scenario import scenario
from coral.cli.simulate import demo, simulate_cmd
from coral.cli.templates import templates
from coral.cli_support import CoralGroup

__all__ = ["main"]


@click.group(cls=CoralGroup)
@click.version_option(__version__, prog_name="coral")
def main() -> None:
    """Coral: plan, simulate and serve many LLMs on heterogeneous cloud GPUs at the lowest cost
    that meets every model's latency SLO.

    \b
    Start with:
      coral catalog configs            node shapes and their prices
      coral scenario show core         a built-in scenario, resolved
      coral perf --model qwen3-32b --node 1xL40S --phase decode --batch 8 --prompt-tokens 1000
      coral templates solve --model qwen3-32b --phase prefill --slo-ms 2500 --nodes 1xL40S,1xL40S,2xL4
      coral scenario init my.yaml      a commented starter scenario of your own

    \b
    Exit codes: 0 done; 2 bad input (one line naming the field, nothing written);
    4 `coral plan` found no plan that serves any demand (nothing written).
    """


for _command in (catalog, perf_cmd, scenario, calibrate_cmd, templates, plan_cmd, simulate_cmd, demo):
    main.add_command(_command)


def _register_experiments() -> None:
    from coral.experiments.cli import experiment

    main.add_command(experiment)


_register_experiments()


def _register_optional() -> None:
    """Commands whose modules need the runtime extra (torch, zmq) are added only when importable;
    their heavy imports happen when they run."""
    try:
        from coral.runtime.cli import keys, serve
        from coral.runtime.loadgen import bench_serve
    except ImportError:
        return
    main.add_command(serve)
    main.add_command(keys)
    main.add_command(bench_serve)
    try:
        from coral.experiments.profile_cmd import profile
    except ImportError:
        return
    main.add_command(profile)


_register_optional()


def _register_deploy() -> None:
    """`coral export` (plan -> SkyPilot / vLLM files) needs no runtime extra."""
    from coral.runtime.deploy.cli import export_cmd

    main.add_command(export_cmd)


_register_deploy()
