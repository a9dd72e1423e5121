"""Built-in dataset names and the data directory they are found in."""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from coral.errors import CoralError
from coral.workload.lengths import AZURE_CODE_LENGTHS, AZURE_CONV_LENGTHS, LognormalLengths
from coral.workload.loaders import load_trace_file
from coral.workload.trace import LoadedTrace

DATA_DIR_ENV = "CORAL_DATA_DIR"

# Trace files of the built-in datasets, relative to the data directory (its `traces/` folder).
BUILTIN_DATASET_FILES = {
    "azure-code": "traces/azure_llm_2023_code.csv.gz",
    "azure-conv": "traces/azure_llm_2023_conv.csv.gz",
    "burstgpt": "traces/burstgpt_1_first400.csv.gz",
}
# Mean (prompt, output) tokens of the built-in trace files: the Azure figures are the published ones
# (coral/data/README.md); BurstGPT's are those of the 383 requests the loader keeps from its 400 rows.
BUILTIN_DATASET_MEANS_TOK = {
    "azure-code": (2047.8, 27.9),
    "azure-conv": (1154.7, 211.1),
    "burstgpt": (543.6, 288.8),
}
# Datasets that need no file: lognormal fits to the Azure traces' published statistics.
SYNTHETIC_FITS: dict[str, LognormalLengths] = {
    "synthetic-azure-code": AZURE_CODE_LENGTHS,
    "synthetic-azure-conv": AZURE_CONV_LENGTHS,
}
# Lengths from the spec's own means (and optional medians).
SYNTHETIC = "synthetic"
DATASET_NAMES = (*BUILTIN_DATASET_FILES, SYNTHETIC, *SYNTHETIC_FITS)


def builtin_data_dir() -> Path:
    """The public data shipped inside the package (`coral/data`: traces, profiles, prices,
    model configs; provenance and licences in its README.md).

    Returns:
        The folder (a real directory: the package is installed from a wheel or a checkout).
    """
    return Path(str(resources.files("coral") / "data"))


def data_dir_candidates(data_dir: Path | str | None = None) -> list[tuple[Path, str]]:
    """The folders searched for built-in datasets, in order, each with where it came from.

    An explicit `data_dir` is the only candidate; otherwise `$CORAL_DATA_DIR` (when set),
    then the copy shipped with Coral (`builtin_data_dir`).

    Args:
        data_dir: an explicit data directory (the CLI's `--data-dir`), or None.

    Returns:
        (folder, origin) pairs.
    """
    if data_dir is not None:
        return [(Path(data_dir), "--data-dir")]
    out: list[tuple[Path, str]] = []
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        out.append((Path(env), f"${DATA_DIR_ENV}"))
    out.append((builtin_data_dir(), "shipped with Coral"))
    return out


def dataset_path(name: str, data_dir: Path | str | None = None) -> Path:
    """Find a built-in dataset's trace file.

    Each candidate folder (see `data_dir_candidates`) is searched for `traces/<file>`, then
    `<file>` directly.

    Args:
        name: `azure-code`, `azure-conv` or `burstgpt`.
        data_dir: an explicit data directory, or None for the default search.

    Returns:
        The file's path.

    Raises:
        CoralError: an unknown name, or the file is in none of the folders.
    """
    if name not in BUILTIN_DATASET_FILES:
        raise CoralError(
            f"{name!r} is not a built-in dataset with a trace file; those are {', '.join(BUILTIN_DATASET_FILES)}"
        )
    relative = Path(BUILTIN_DATASET_FILES[name])
    looked: list[str] = []
    for folder, origin in data_dir_candidates(data_dir):
        for candidate in (folder / relative, folder / relative.name):
            if candidate.is_file():
                return candidate
        looked.append(f"{folder / relative} ({origin})")
    where = "; looked in " + ", ".join(looked) if looked else "; no data directory was given"
    fallback = f"synthetic-{name}" if f"synthetic-{name}" in SYNTHETIC_FITS else None
    hint = f", or use dataset {fallback!r} (a lognormal fit that needs no data)" if fallback else ""
    raise CoralError(
        f"dataset {name!r} needs the file {relative}{where}. Pass --data-dir DIR or set {DATA_DIR_ENV}=DIR "
        f"to a folder holding {relative}{hint}"
    )


def resolve_dataset_file(dataset: str, data_dir: Path | str | None = None, base_dir: Path | str | None = None) -> Path:
    """The trace file behind a dataset: a built-in name or a CSV path.

    Args:
        dataset: a built-in name with a file, or a path to a CSV (relative paths are taken
            against `base_dir`, default the current directory).
        data_dir: where built-in datasets live (see `dataset_path`).
        base_dir: the folder relative paths are resolved against (e.g. the scenario file's).

    Returns:
        The file's path (not checked for existence when it is a user path).

    Raises:
        CoralError: a built-in dataset that cannot be found, or a name without a file.
    """
    if dataset in BUILTIN_DATASET_FILES:
        return dataset_path(dataset, data_dir)
    if dataset in SYNTHETIC_FITS or dataset == SYNTHETIC:
        raise CoralError(f"dataset {dataset!r} is synthetic and has no trace file")
    path = Path(dataset).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return path


def load_dataset(
    dataset: str,
    data_dir: Path | str | None = None,
    *,
    base_dir: Path | str | None = None,
    columns: tuple[str, str, str] | None = None,
) -> LoadedTrace:
    """Load a built-in dataset (named after it) or a trace CSV (format from its header).

    Args:
        dataset: `azure-code`, `azure-conv`, `burstgpt` or a path to a CSV.
        data_dir: where built-in datasets live (see `dataset_path`).
        base_dir: the folder relative CSV paths are resolved against.
        columns: for a generic CSV, its arrival-seconds, prompt-token and output-token columns.

    Returns:
        The trace and what the loader dropped.

    Raises:
        CoralError: a dataset that cannot be found or read.
    """
    path = resolve_dataset_file(dataset, data_dir, base_dir)
    name = dataset if dataset in BUILTIN_DATASET_FILES else None
    return load_trace_file(path, columns=columns, name=name)
