"""Fixtures for the workload tests: the shared data directory and small trace files."""
from __future__ import annotations

import gzip
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shared_data(data_dir: Path) -> Path:
    """The public data folder (tests/conftest.py); the test is skipped when it has no traces."""
    if not (data_dir / "traces").is_dir():
        pytest.skip(f"{data_dir}/traces is absent (set CORAL_DATA_DIR to a copy of shared/data)")
    return data_dir


@pytest.fixture(scope="session")
def traces_dir(shared_data: Path) -> Path:
    return shared_data / "traces"


@pytest.fixture
def no_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty data directory in $CORAL_DATA_DIR and no checkout fallback: as on an installed package."""
    empty = tmp_path / "empty-data"
    empty.mkdir()
    monkeypatch.setenv("CORAL_DATA_DIR", str(empty))
    monkeypatch.setattr("coral.workload.datasets.checkout_data_dir", lambda: None)
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
