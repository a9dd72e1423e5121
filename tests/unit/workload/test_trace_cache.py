"""The parsed-trace cache: a hit equals a fresh parse, and an edited file, a changed argument or a
broken entry never serves stale data."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coral.workload import load_trace_file, trace_cache

CSV = """arrival_s,prompt_tokens,output_tokens
0.0,10,5
1.5,20,7
3.0,30,9
"""


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("CORAL_CACHE_DIR", str(folder))
    monkeypatch.setattr(trace_cache, "_memo", {})
    return folder / "traces"


def _same(a, b) -> None:  # type: ignore[no-untyped-def]
    assert (a.trace.name, a.trace.window_s, a.format, a.rows_read, a.dropped, a.filtered_out, a.path) == \
           (b.trace.name, b.trace.window_s, b.format, b.rows_read, b.dropped, b.filtered_out, b.path)
    for field in ("arrival_s", "prompt_tokens", "output_tokens"):
        np.testing.assert_array_equal(getattr(a.trace, field), getattr(b.trace, field))


def test_a_disk_hit_equals_a_fresh_parse(traces_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch):
    path = traces_dir / "burstgpt_1_first400.csv.gz"  # drops rows: the counts travel too
    first = load_trace_file(path)
    assert 1 == len(list(cache_dir.glob("*.npz")))
    monkeypatch.setattr(trace_cache, "_memo", {})  # a new process: only the disk entry is left
    again = load_trace_file(path)
    _same(first, again)
    monkeypatch.setenv("CORAL_TRACE_CACHE", "0")
    monkeypatch.setattr(trace_cache, "_memo", {})
    _same(first, load_trace_file(path))


def test_an_edited_file_is_parsed_again(write_csv, cache_dir: Path):  # type: ignore[no-untyped-def]
    path = write_csv("t.csv", CSV)
    assert [10, 20, 30] == load_trace_file(path).trace.prompt_tokens.tolist()
    write_csv("t.csv", CSV.replace("30,9", "31,9"))
    assert [10, 20, 31] == load_trace_file(path).trace.prompt_tokens.tolist()
    assert 2 == len(list(cache_dir.glob("*.npz")))


def test_same_bytes_under_another_name_keep_their_own_name(write_csv, cache_dir: Path):  # type: ignore[no-untyped-def]
    a, b = write_csv("a.csv", CSV), write_csv("b.csv", CSV)
    assert ("a", a) == (load_trace_file(a).trace.name, load_trace_file(a).path)
    assert ("b", b) == (load_trace_file(b).trace.name, load_trace_file(b).path)
    assert "mine" == load_trace_file(a, name="mine").trace.name


def test_a_broken_entry_is_parsed_again(write_csv, cache_dir: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    path = write_csv("t.csv", CSV)
    load_trace_file(path)
    (entry,) = cache_dir.glob("*.npz")
    entry.write_bytes(b"not an npz")
    monkeypatch.setattr(trace_cache, "_memo", {})
    assert [5, 7, 9] == load_trace_file(path).trace.output_tokens.tolist()


def test_an_unwritable_cache_is_skipped(write_csv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    blocker = tmp_path / "file-not-folder"
    blocker.write_text("x")
    monkeypatch.setenv("CORAL_CACHE_DIR", str(blocker))
    monkeypatch.setattr(trace_cache, "_memo", {})
    assert [0.0, 1.5, 3.0] == load_trace_file(write_csv("t.csv", CSV)).trace.arrival_s.tolist()


def test_bad_files_are_never_cached(write_csv, cache_dir: Path):  # type: ignore[no-untyped-def]
    path = write_csv("t.csv", CSV.replace("20,7", "x,7"))
    with pytest.raises(Exception, match="line 3, column 'prompt_tokens'"):
        load_trace_file(path)
    assert not cache_dir.exists() or not list(cache_dir.glob("*.npz"))
