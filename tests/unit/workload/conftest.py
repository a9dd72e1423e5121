"""Fixtures for the workload tests: the shared data directory and small trace files."""
from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def shared_data_dir() -> Path:
    """`$CORAL_SHARED_DATA`, else `<repo>/../shared/data`."""
    env = os.environ.get("CORAL_SHARED_DATA")
    return Path(env) if env else (REPO / ".." / "shared" / "data").resolve()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared data directory; the test is skipped when it is absent."""
    path = shared_data_dir()
    if not (path / "traces").is_dir():
        pytest.skip(f"shared data directory {path}/traces is absent (set CORAL_SHARED_DATA to run these tests)")
    return path


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
