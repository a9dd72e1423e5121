"""Shared CLI pieces: progress that shows in a pipe, consoles that do not cut at 80 columns."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from coral import cli_support
from coral.cli_support import LineProgress, progress_display


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(cli_support.time, "monotonic", c)
    return c


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200), buf


def test_line_progress_prints_long_work_and_stays_quiet_on_quick_work(clock: Clock):
    console, buf = _console()
    bar = LineProgress(console, every_s=5.0, quiet_s=1.0)
    quick = bar.add_task("templates phi-4 prefill", total=1)
    clock.t += 0.2
    bar.update(quick, completed=1)  # a cached unit: nothing to say
    assert "" == buf.getvalue()
    slow = bar.add_task("templates qwen3-32b prefill", total=18563)
    for done in range(0, 18564, 1000):
        clock.t += 1.0
        bar.update(slow, completed=min(done, 18563))
    bar.update(slow, completed=18563)
    lines = buf.getvalue().splitlines()
    assert "  templates qwen3-32b prefill: 4,000/18,563 (5 s)" == lines[0]
    assert "  templates qwen3-32b prefill: 18,563/18,563 done (19 s)" == lines[-1]
    assert 4 == len(lines)  # 5, 10, 15 s and done: throttled, not one per update


def test_line_progress_advance_and_unknown_total(clock: Clock):
    console, buf = _console()
    bar = LineProgress(console, every_s=1.0)
    t = bar.add_task("simulating coral", total=None)
    clock.t += 2
    bar.advance(t, 7)
    bar.remove_task(t)
    bar.update(t, completed=9)  # removed: ignored
    assert ["  simulating coral: 7 (2 s)"] == buf.getvalue().splitlines()


def test_progress_display_is_plain_in_a_pipe_and_rich_on_a_terminal():
    pipe = Console(file=io.StringIO())
    assert isinstance(progress_display(console=pipe), LineProgress)
    tty = Console(file=io.StringIO(), force_terminal=True)
    from rich.progress import Progress

    assert isinstance(progress_display(console=tty), Progress)


def test_pipe_console_is_wide_unless_columns_says_otherwise(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(cli_support.sys, "stdout", io.StringIO())
    assert cli_support._PIPE_WIDTH == cli_support.stdout_console().width
    monkeypatch.setenv("COLUMNS", "100")
    assert 100 == cli_support.stdout_console().width


def test_check_output_path(tmp_path):
    from coral.errors import CoralError

    (tmp_path / "f").write_text("")
    with pytest.raises(CoralError, match="f is a file, not a folder"):
        cli_support.check_output_path(tmp_path / "f" / "deeper" / "out", "--out", folder=True)
    with pytest.raises(CoralError, match="--out .*: is a file; give a folder"):
        cli_support.check_output_path(tmp_path / "f", "--out", folder=True)
    with pytest.raises(CoralError, match="is a folder; give a file name"):
        cli_support.check_output_path(tmp_path, "--out", folder=False)
    assert tmp_path / "new" / "plan.json" == cli_support.check_output_path(tmp_path / "new" / "plan.json", "--out",
                                                                          folder=False)
    assert not (tmp_path / "new").exists()  # checking creates nothing
