"""Fixtures for every test: the public data folder."""
from __future__ import annotations

from pathlib import Path

import pytest

from coral.workload.datasets import builtin_data_dir


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The public data shipped with Coral (`src/coral/data`): always there, never skipped."""
    return builtin_data_dir()
