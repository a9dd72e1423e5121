"""Fixtures for every test: the public data folder."""
from __future__ import annotations

from pathlib import Path

import pytest

from coral.errors import CoralError
from coral.workload_data import shared_data_dir


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The public data folder, found as Coral finds it ($CORAL_DATA_DIR, else `<repo>/../shared/data`);
    a test that needs it is skipped, with the reason, when there is none (CI has it)."""
    try:
        return shared_data_dir()
    except CoralError as e:
        pytest.skip(str(e))
