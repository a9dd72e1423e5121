"""Where the public data (traces, profiles) lives: the same search as the workload's datasets."""
from __future__ import annotations

from pathlib import Path

from coral.errors import CoralError
from coral.workload.datasets import data_dir_candidates


def public_data_path(relative: str | Path, explicit: str | Path | None = None) -> Path:
    """A file or folder of the public data: the first of `explicit`, else $CORAL_DATA_DIR then
    the copy shipped with Coral (`coral.workload.datasets.data_dir_candidates`), that holds it.

    Args:
        relative: the path inside the data folder, e.g. `profiles/helix_llama2_70b`.
        explicit: the CLI's `--data-dir`, the only folder searched when given.

    Raises:
        CoralError: when no candidate holds it, naming each place looked in.
    """
    candidates = data_dir_candidates(explicit)
    for folder, _ in candidates:
        if (folder / relative).exists():
            return (folder / relative).resolve()
    looked = ", ".join(f"{folder / relative} ({origin})" for folder, origin in candidates)
    raise CoralError(f"public data {relative} not found (looked in: {looked}); "
                     "pass --data-dir or set CORAL_DATA_DIR to a folder that holds it")

