"""Fixtures for the workload tests: the public data shipped with Coral and small trace files."""
from __future__ import annotations

import gzip
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shared_data(data_dir: Path) -> Path:
    """The public data folder (tests/conftest.py)."""
    return data_dir


@pytest.fixture(scope="session")
def traces_dir(shared_data: Path) -> Path:
    return shared_data / "traces"


@pytest.fixture
def no_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty data directory in $CORAL_DATA_DIR and none shipped: as if the package data were missing."""
    empty = tmp_path / "empty-data"
    empty.mkdir()
    monkeypatch.setenv("CORAL_DATA_DIR", str(empty))
    monkeypatch.setattr("coral.workload.datasets.builtin_data_dir", lambda: tmp_path / "no-package-data")
    return empty


@pytest.fixture
def write_csv(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A function writing `text` (each line stripped) to `tmp_path / name`, gzipped for `.gz` names."""

    def write(name: str, text: str) -> Path:
        body = ("\n".join(line.strip() for line in text.strip().splitlines()) + "\n").encode()
        path = tmp_path / name
        path.write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
        return path

    return write
