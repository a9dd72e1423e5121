"""Parsed trace files kept across calls and processes, keyed by the file's bytes.

Parsing a trace CSV (an Azure trace's timestamps above all) takes 40-150 ms, and `coral plan` reads
each model's trace to size its templates. A parsed file is kept in memory for the process and on
disk, as one small `.npz` under `traces/` in the template cache folder (`$CORAL_CACHE_DIR`, default
`~/.cache/coral/templates`). The key is a hash of the file's bytes, the loader's arguments and the
loaders' own source, so an entry is never stale: an edited trace or loader gives another key. The
cache is an optimisation only: an entry that can't be read is parsed again, one that can't be written
is skipped, and `CORAL_TRACE_CACHE=0` turns the disk part off.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from functools import lru_cache
from pathlib import Path

import numpy as np

from coral.atomic import write_bytes
from coral.cache import default_cache_dir, source_version, switched_on
from coral.workload import trace as trace_module
from coral.workload.trace import LoadedTrace, Trace

FORMAT = 1
_MEMO_MAX = 32
_memo: dict[str, LoadedTrace] = {}


def enabled() -> bool:
    """False when `CORAL_TRACE_CACHE` is `0`, `false` or `no`."""
    return switched_on("CORAL_TRACE_CACHE")


def store_dir() -> Path:
    """`traces/` under the template cache folder."""
    return default_cache_dir() / "traces"


@lru_cache(maxsize=4)
def _code_version(loader: str) -> str:
    """The loader's and the trace's source: a change to either changes every key."""
    return source_version(loader, trace_module.__file__, extra=np.__version__)


def key_of(raw: bytes, args: object, *, loader: str) -> str:
    """The key of one parse: the file's bytes, the loader's arguments (`repr`-able) and the
    loader's source file (`__file__` of the module that parses)."""
    h = hashlib.sha256(f"coral-trace-{FORMAT}-{_code_version(loader)}-{args!r}".encode())
    h.update(raw)
    return h.hexdigest()[:32]


def get(key: str, path: Path) -> LoadedTrace | None:
    """The `LoadedTrace` parsed under `key` (from memory, else from disk), or None."""
    hit = _memo.get(key)
    if hit is not None:
        return _at(hit, path)
    if not enabled():
        return None
    try:
        with np.load(store_dir() / f"{key}.npz", allow_pickle=False) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            if meta.get("format") != FORMAT or meta.get("key") != key:
                return None
            trace = Trace(name=meta["name"], arrival_s=data["arrival_s"], prompt_tokens=data["prompt_tokens"],
                          output_tokens=data["output_tokens"], window_s=meta["window_s"])
        loaded = LoadedTrace(trace=trace, path=path, format=meta["trace_format"], rows_read=meta["rows_read"],
                             dropped_failed=meta["dropped_failed"], dropped_empty_prompt=meta["dropped_empty_prompt"],
                             filtered_out=meta["filtered_out"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    _remember(key, loaded)
    return loaded


def put(key: str, loaded: LoadedTrace) -> None:
    """Keep `loaded` (a `LoadedTrace`) under `key`, in memory and (atomically) on disk."""
    _remember(key, loaded)
    if not enabled():
        return
    t = loaded.trace
    meta = {"format": FORMAT, "key": key, "name": t.name, "window_s": t.window_s, "trace_format": loaded.format,
            "rows_read": loaded.rows_read, "dropped_failed": loaded.dropped_failed,
            "dropped_empty_prompt": loaded.dropped_empty_prompt, "filtered_out": loaded.filtered_out}
    buf = io.BytesIO()
    np.savez(buf, arrival_s=t.arrival_s, prompt_tokens=t.prompt_tokens, output_tokens=t.output_tokens,
             meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    try:
        folder = store_dir()
        folder.mkdir(parents=True, exist_ok=True)
        write_bytes(folder / f"{key}.npz", buf.getvalue())
    except OSError:
        return


def _remember(key: str, loaded: LoadedTrace) -> None:
    if len(_memo) >= _MEMO_MAX:
        _memo.clear()
    _memo[key] = loaded


def _at(loaded: LoadedTrace, path: Path) -> LoadedTrace:
    """`loaded` as read from `path` (the same bytes may sit under another name)."""
    return loaded if loaded.path == path else dataclasses.replace(loaded, path=path)
