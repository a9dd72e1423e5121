"""The folder where Coral keeps what it can compute again: template libraries, capacity targets and
parsed traces (`$CORAL_CACHE_DIR`, default `~/.cache/coral/templates`). A leaf module: anything may
import it."""
from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$CORAL_CACHE_DIR`, else `~/.cache/coral/templates`."""
    env = os.environ.get("CORAL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "coral" / "templates"
