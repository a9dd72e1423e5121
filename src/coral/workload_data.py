"""Where the public data (traces, profiles) lives: the same search as the workload's datasets."""
from __future__ import annotations

from pathlib import Path

from coral.errors import CoralError
from coral.workload.datasets import data_dir_candidates


def shared_data_dir(explicit: str | Path | None = None) -> Path:
    """The data folder: `explicit`, else $CORAL_DATA_DIR, else `<repo>/../shared/data`
    (`coral.workload.datasets.data_dir_candidates`).

    Raises:
        CoralError: when none exists, saying how to point Coral at a copy.
    """
    candidates = data_dir_candidates(explicit)
    for path, _ in candidates:
        if path.is_dir():
            return path.resolve()
    looked = ", ".join(f"{p} ({origin})" for p, origin in candidates) or "nowhere: no candidate"
    raise CoralError(f"public data folder not found (looked in: {looked}); "
                     "pass --data-dir or set CORAL_DATA_DIR to a copy of shared/data")
