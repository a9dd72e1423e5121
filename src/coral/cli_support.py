"""What every click group of the `coral` command shares: user mistakes as one clean line."""
from __future__ import annotations

import sys
from typing import Any

import click
from rich.console import Console

from coral.errors import CoralError

err_console = Console(stderr=True)


class CoralGroup(click.Group):
    """Prints user mistakes (CoralError) as one clear line, without a traceback, exit code 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CoralError as exc:
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
            sys.exit(2)
