"""What every click group of the `coral` command shares: user mistakes as one clean line, output
paths checked before any work, progress that also shows in a pipe, and consoles that do not cut
tables or wrap result lines at 80 columns when stdout is not a terminal."""
from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from coral.errors import CoralError

# Without a terminal rich assumes 80 columns, which cuts model names in tables and breaks long
# result lines; a pipe or a log file has no width, so only $COLUMNS (if set) limits it.
_PIPE_WIDTH = 240


def _console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(stderr=stderr, width=None if tty or os.environ.get("COLUMNS") else _PIPE_WIDTH)


def stdout_console() -> Console:
    """The console for a command's results (stdout)."""
    return _console()


err_console = _console(stderr=True)

# exit codes every command shares (documented in `coral --help`)
EXIT_USAGE = 2  # bad input: a one-line error naming the field, nothing written
EXIT_INFEASIBLE = 4  # the input is valid but no plan serves any of the demand; nothing written


class UserError(click.ClickException):
    """A CoralError raised out of a command that may run outside the `coral` group (`coral serve`
    as `python -m coral.runtime.deploy.serve_cli`, a test invoking the command itself): click prints it as one
    line, `Error: ...`, with the same exit code 2."""

    exit_code = EXIT_USAGE


def _os_error_line(exc: OSError) -> str:
    """`FileExistsError: [Errno 17] File exists: 'a'` as a sentence naming the path."""
    path = exc.filename
    what = {errno.EEXIST: "a file is in the way of a folder", errno.ENOTDIR: "a part of the path is a file, not a folder",
            errno.EISDIR: "it is a folder, not a file", errno.EACCES: "permission denied",
            errno.ENOENT: "no such file or folder", errno.EROFS: "read-only file system",
            errno.ENOSPC: "no space left on the device"}.get(exc.errno or 0, exc.strerror or str(exc))
    return f"cannot use {path}: {what}" if path else f"{what}"


class CoralGroup(click.Group):
    """Prints user mistakes (CoralError) as one clear line, without a traceback, exit code 2.

    An `OSError` naming a path (a file where a folder must be, a folder given as a file, no
    permission) is the user's environment too: it gets the same one line instead of a traceback.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CoralError as exc:
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
            sys.exit(EXIT_USAGE)
        except OSError as exc:
            if exc.filename is None or isinstance(exc, BrokenPipeError):
                raise
            err_console.print(f"[bold red]error:[/] {_os_error_line(exc)}", highlight=False, markup=True)
            sys.exit(EXIT_USAGE)


def pick_scenario(positional: str | None, flag: str | None, *, what: str = "SCENARIO", flag_name: str = "--scenario",
                  default: str | None = None) -> str:
    """The scenario named by the positional argument or its `--scenario` alias (one of them, or both
    alike), else `default`.

    Raises:
        CoralError: neither given and no default, or two different ones (exit code 2, one line).
    """
    if positional is not None and flag is not None and positional != flag:
        raise CoralError(f"{what} given twice ({positional!r} and {flag_name} {flag!r}); give it once")
    name = positional if positional is not None else flag if flag is not None else default
    if name is None:
        raise CoralError(f"missing {what}: a built-in name (e.g. core) or a YAML file, as the first argument "
                         f"or {flag_name}")
    return name


def check_output_path(path: str | Path, option: str, *, folder: bool) -> Path:
    """Refuse, before any work is done, an output path that cannot be written.

    Args:
        path: the output file or folder.
        option: the option it came from (named in the error), e.g. "--out".
        folder: whether `path` is to be a folder (replaced whole) or a file.

    Returns:
        `path` as a Path.

    Raises:
        CoralError: a part of the path is an existing file, `path` is a folder where a file is
            written (or the reverse), or the nearest existing folder is not writable.
    """
    p = Path(path)
    if p.exists():
        if folder and not p.is_dir():
            raise CoralError(f"{option} {p}: is a file; give a folder (it is created, or replaced whole)")
        if not folder and p.is_dir():
            raise CoralError(f"{option} {p}: is a folder; give a file name, e.g. {p / 'plan.json'}")
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CoralError(f"{option} {p}: {parent} is a file, not a folder; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CoralError(f"{option} {p}: cannot write into {parent} (permission denied)")
    return p


class LineProgress:
    """The subset of `rich.progress.Progress` the CLI uses, printing plain lines instead of a live
    bar: for a pipe or a log file (`make demo | tee`), where rich's bar shows nothing at all.

    A task prints a line every `every_s` seconds while it runs and one when it completes; a task
    done in under `quiet_s` (a cached library, say) prints nothing.
    """

    def __init__(self, console: Console, *, disable: bool = False, every_s: float = 5.0, quiet_s: float = 1.0) -> None:
        self.console = console
        self.disable = disable
        self.every_s = every_s
        self.quiet_s = quiet_s
        self._tasks: dict[int, dict[str, Any]] = {}
        self._next_id = 0

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **_: Any) -> int:
        tid = self._next_id
        self._next_id += 1
        now = time.monotonic()
        self._tasks[tid] = {"description": description, "total": total, "completed": 0.0, "started": now,
                            "printed": now, "lines": 0, "done": False}
        return tid

    def remove_task(self, task: int) -> None:
        self._tasks.pop(task, None)

    def advance(self, task: int, advance: float = 1) -> None:
        t = self._tasks.get(task)
        if t is not None:
            self.update(task, completed=t["completed"] + advance)

    def update(self, task: int, *, completed: float | None = None, total: float | None = None, **_: Any) -> None:
        t = self._tasks.get(task)
        if t is None or t["done"]:
            return
        if total is not None:
            t["total"] = total
        if completed is not None:
            t["completed"] = completed
        now = time.monotonic()
        finished = bool(t["total"]) and t["completed"] >= t["total"]
        if finished:
            t["done"] = True
            if t["lines"] == 0 and now - t["started"] < self.quiet_s:
                return
        elif now - t["printed"] < self.every_s:
            return
        t["printed"] = now
        t["lines"] += 1
        of = f"/{t['total']:,.0f}" if t["total"] else ""
        self._print(f"  {t['description']}: {t['completed']:,.0f}{of}{' done' if finished else ''} "
                    f"({now - t['started']:.0f} s)")

    def _print(self, line: str) -> None:
        if not self.disable:
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)


def progress_display(*columns: Any, console: Console = err_console, disable: bool = False,
                     transient: bool = False) -> Any:
    """A rich progress bar on a terminal; `LineProgress` (plain, throttled lines) otherwise."""
    if console.is_terminal:
        from rich.progress import Progress

        return Progress(*columns, console=console, disable=disable, transient=transient)
    return LineProgress(console, disable=disable)
