"""Fixtures for every test: the public data folder, and the switch between a long test's reduced and full form."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from coral.workload.datasets import builtin_data_dir

#: `CORAL_LONG_TESTS=1` (`make test-long`) runs the tests marked `long` in their full form; `make test`
#: runs their reduced form (a shorter soak, the fidelity study on a stand-in runtime).
LONG_TESTS = os.environ.get("CORAL_LONG_TESTS", "") == "1"

# Under pytest-xdist (make test runs two workers) the tests see COLUMNS=80 / LINES=24. The CLI outputs the
# tests compare are a pipe's, with no terminal width: drop them before any test imports the CLI's
# consoles (they read COLUMNS when they are built) or starts `coral` in a subprocess.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if LONG_TESTS:
        return
    for item in items:
        mark = item.get_closest_marker("long")
        if mark is not None:
            reduced = mark.kwargs.get("reduced", "")
            item.add_marker(pytest.mark.skip(reason="long form: CORAL_LONG_TESTS=1 (make test-long) runs it"
                                                    + (f"; make test runs {reduced}" if reduced else "")))


@pytest.fixture(scope="session")
def long_form() -> bool:
    """Whether this run takes the long tests' full form (a soak sizes its duration on it)."""
    return LONG_TESTS


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The public data shipped with Coral (`src/coral/data`): always there, never skipped."""
    return builtin_data_dir()
