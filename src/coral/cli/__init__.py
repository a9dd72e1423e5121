"""The `coral` command: the `main` group and one module per command group, each of which parses,
calls the core and writes output (parse -> load config -> call the core -> write outputs)."""
from __future__ import annotations

import importlib

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


# The commands whose modules are heavy to import (the experiments, the runtime, the deploy
# writers) are imported only when they run or `coral --help` lists them, so that `coral plan` and
# `coral templates show` don't pay for them. name -> (module, attribute).
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "experiment": ("coral.experiments.cli", "experiment"),
    "export": ("coral.runtime.deploy.cli", "export_cmd"),
    # these need the runtime extra (torch, pyzmq): without it they are not commands at all
    "serve": ("coral.runtime.deploy.serve_cli", "serve"),
    "keys": ("coral.runtime.deploy.serve_cli", "keys"),
    "bench": ("coral.runtime.serving.loadgen", "bench_serve"),
    "profile": ("coral.experiments.profile_cmd", "profile"),
}


class _LazyGroup(CoralGroup):
    """`CoralGroup` whose :data:`LAZY_COMMANDS` are imported on first use."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands or cmd_name not in LAZY_COMMANDS:
            return self.commands.get(cmd_name)
        module, attr = LAZY_COMMANDS[cmd_name]
        try:
            cmd: click.Command = getattr(importlib.import_module(module), attr)
        except ImportError:  # an extra that isn't installed
            return None
        self.add_command(cmd, cmd_name)
        return cmd

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *(n for n in LAZY_COMMANDS if self.get_command(ctx, n) is not None)})

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        if self.get_command(ctx, click.utils.make_str(args[0])) is None:
            self.list_commands(ctx)  # a misspelt command: every name for click's "did you mean"
        return super().resolve_command(ctx, args)


@click.group(cls=_LazyGroup)
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
