"""The folder where Coral keeps what it can compute again: template libraries, capacity targets and
parsed traces (`$CORAL_CACHE_DIR`, default `~/.cache/coral/templates`). A leaf module: anything may
import it."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$CORAL_CACHE_DIR`, else `~/.cache/coral/templates`."""
    env = os.environ.get("CORAL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "coral" / "templates"


def switched_on(variable: str) -> bool:
    """False when the environment variable `variable` is `0`, `false` or `no` (default on)."""
    return os.environ.get(variable, "1").strip().lower() not in ("0", "false", "no")


def source_version(*files: str, extra: str = "") -> str:
    """A short hash of these source files' bytes (and `extra`, e.g. numpy's version): a key part
    that changes whenever the code that computes a cached result does."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
    h.update(extra.encode())
    return h.hexdigest()[:16]
