"""Where the public data (traces, profiles) lives: $CORAL_DATA_DIR or the checkout's ../shared/data."""
from __future__ import annotations

import os
from pathlib import Path

from coral.errors import CoralError


def shared_data_dir(explicit: str | Path | None = None) -> Path:
    """The data folder: `explicit`, else $CORAL_DATA_DIR, else `<repo>/../shared/data`.

    Raises:
        CoralError: when none exists, saying how to point Coral at a copy.
    """
    candidates = []
    if explicit:
        candidates.append(Path(explicit))
    if os.environ.get("CORAL_DATA_DIR"):
        candidates.append(Path(os.environ["CORAL_DATA_DIR"]))
    candidates.append(Path(__file__).resolve().parents[2] / ".." / "shared" / "data")
    for c in candidates:
        if c.is_dir():
            return c.resolve()
    raise CoralError("public data folder not found (looked in: " + ", ".join(str(c) for c in candidates)
                     + "); pass --data-dir or set CORAL_DATA_DIR to a copy of shared/data")
