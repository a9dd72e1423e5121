"""Capacity targets kept on disk across processes, keyed by the content of the queue replay that
computes them (the sample's arrays, every latency figure and the capacity model's own source), so
`coral plan` does not replay an hour of traffic again for an unchanged scenario (DESIGN §4a).

A key names everything the result depends on, so an entry is never stale: another trace, SLO,
budget, KV link, instance rate or a change to `coral.allocator.capacity` gives another key. Entries
live in `capacity/` under the template cache folder (`$CORAL_CACHE_DIR`, default
`~/.cache/coral/templates`), one small JSON file each, written atomically. The cache is an
optimisation only: an entry that cannot be read is recomputed, and one that cannot be written is
skipped. `CORAL_CAPACITY_CACHE=0` turns it off.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from coral.allocator import capacity
from coral.allocator.capacity import CapacityTarget
from coral.atomic import write_text
from coral.cache import default_cache_dir, source_version, switched_on

FORMAT = 1
_FIELDS = ("capacity_tok_per_s", "mean_tok_per_s", "predicted_attainment", "quantile_latency_s")


def enabled() -> bool:
    """False when `CORAL_CAPACITY_CACHE` is `0`, `false` or `no`."""
    return switched_on("CORAL_CAPACITY_CACHE")


def store_dir() -> Path:
    """`capacity/` under the template cache folder."""
    return default_cache_dir() / "capacity"


@lru_cache(maxsize=1)
def _code_version() -> str:
    """The capacity model's source and numpy's version: a change to either changes every key."""
    return source_version(capacity.__file__, extra=np.__version__)


def replay_key(arrays: tuple[np.ndarray, ...], params: Mapping[str, Any]) -> str:
    """The content key of one model's replay: its arrays (dtype, shape, bytes) and scalar inputs."""
    h = hashlib.sha256(f"coral-capacity-{FORMAT}-{_code_version()}".encode())
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    h.update(json.dumps({k: repr(v) for k, v in sorted(params.items())}, sort_keys=True).encode())
    return h.hexdigest()[:32]


def load(key: str, folder: Path | None = None) -> tuple[CapacityTarget, CapacityTarget] | None:
    """The (prefill, decode) targets stored under `key`, or None (absent or unreadable)."""
    path = (folder or store_dir()) / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("key") != key:
            return None
        out = []
        for phase in ("prefill", "decode"):
            vals = {f: float(data[phase][f]) for f in _FIELDS}
            if not all(math.isfinite(v) for v in vals.values()):
                return None
            out.append(CapacityTarget(**vals))
        return out[0], out[1]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save(key: str, prefill: CapacityTarget, decode: CapacityTarget, folder: Path | None = None) -> None:
    """Store the targets under `key` (atomically; a folder that cannot be written is skipped)."""
    folder = folder or store_dir()
    # floats go through repr (shortest round trip), so a loaded target equals the computed one
    data = {"format": FORMAT, "key": key,
            **{phase: {f: getattr(t, f) for f in _FIELDS} for phase, t in (("prefill", prefill), ("decode", decode))}}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_text(folder / f"{key}.json", json.dumps(data))
    except OSError:
        return
