"""Trace file loaders: Azure LLM inference 2023, BurstGPT and a generic CSV, gzip or plain."""
from __future__ import annotations

import csv
import gzip
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coral.errors import CoralError
from coral.workload import trace_cache
from coral.workload.trace import FloatArray, IntArray, LoadedTrace, Trace

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens")
CSV_DEFAULT_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Table:
    """A CSV file's header and data rows, with 1-based file line numbers for error messages."""

    path: Path
    header: tuple[str, ...]
    rows: tuple[list[str], ...]

    def column(self, name: str, fix: str) -> int:
        if name not in self.header:
            raise CoralError(
                f"{self.path}: no column {name!r}; its columns are {', '.join(map(repr, self.header))}. {fix}"
            )
        return self.header.index(name)

    def strings(self, index: int) -> list[str]:
        out = []
        for row_number, row in enumerate(self.rows):
            if index >= len(row):
                raise CoralError(
                    f"{self.path}, line {row_number + 2}: the row has {len(row)} fields but column "
                    f"{self.header[index]!r} is field {index + 1}; fix or delete that row"
                )
            out.append(row[index].strip())
        return out


def _read_raw(path: Path | str) -> tuple[Path, bytes]:
    """A trace file's bytes, gunzipped (gzip detected by its magic bytes, not its name)."""
    path = Path(path)
    if not path.is_file():
        where = path if path.is_absolute() else f"{path} (resolved against {Path.cwd()})"
        raise CoralError(f"trace file not found: {where}; check the path or give an absolute one")
    try:
        raw = path.read_bytes()
        if raw[:2] == _GZIP_MAGIC:
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise CoralError(f"{path}: cannot read the file ({exc}); is it a complete CSV or .csv.gz?") from None
    return path, raw


def _table_of(path: Path, raw: bytes) -> _Table:
    """A CSV's bytes as a header and rows."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise CoralError(f"{path}: not UTF-8 text ({exc}); is it a CSV file?") from None
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if not header:
        raise CoralError(f"{path}: the file is empty; a trace CSV needs a header row and one row per request")
    rows = tuple(row for row in reader if any(field.strip() for field in row))
    return _Table(path=path, header=tuple(h.strip() for h in header), rows=rows)


def _read_table(path: Path | str) -> _Table:
    """Read a CSV (plain or gzip) into a header and rows."""
    return _table_of(*_read_raw(path))


def _floats(table: _Table, column: str, fix: str) -> FloatArray:
    index = table.column(column, fix)
    strings = table.strings(index)
    try:
        values = np.array(strings, dtype=np.float64) if strings else np.zeros(0)
    except ValueError:
        for row_number, text in enumerate(strings):
            try:
                float(text)
            except ValueError:
                raise CoralError(
                    f"{table.path}, line {row_number + 2}, column {column!r}: {text!r} is not a number; "
                    "fix or delete that row"
                ) from None
        raise  # pragma: no cover - numpy and float() disagree on some string
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        raise CoralError(
            f"{table.path}, line {bad[0] + 2}, column {column!r}: {strings[bad[0]]!r} is NaN or infinite "
            f"({len(bad)} such rows); fix or delete those rows"
        )
    return values


def _tokens(table: _Table, column: str, fix: str) -> IntArray:
    values = _floats(table, column, fix)
    for problem, mask in (("negative", values < 0), ("not a whole number", values != np.floor(values))):
        bad = np.flatnonzero(mask)
        if len(bad):
            raise CoralError(
                f"{table.path}, line {bad[0] + 2}, column {column!r}: token count {values[bad[0]]:g} is "
                f"{problem} ({len(bad)} such rows); token counts must be whole numbers >= 0"
            )
    return values.astype(np.int64)


def _observed_window_s(arrival_s: FloatArray) -> float | None:
    """Span plus one mean gap: rate_per_s is then (n-1)/span and tiled copies do not collide."""
    if len(arrival_s) < 2:
        return None
    span = float(arrival_s[-1] - arrival_s[0])
    return float(arrival_s[-1]) + span / (len(arrival_s) - 1)


def _trace(name: str, arrival_s: FloatArray, prompt: IntArray, output: IntArray) -> Trace:
    order = np.argsort(arrival_s, kind="stable")
    arrival_s = arrival_s[order]
    return Trace(
        name=name,
        arrival_s=arrival_s,
        prompt_tokens=prompt[order],
        output_tokens=output[order],
        window_s=_observed_window_s(arrival_s),
    )


def _default_name(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".csv"):
        name = name.removesuffix(suffix)
    return name


def _parse_azure(table: _Table, name: str | None) -> LoadedTrace:
    fix = f"an Azure LLM inference trace has the columns {', '.join(AZURE_COLUMNS)}"
    stamps = table.strings(table.column("TIMESTAMP", fix))
    prompt = _tokens(table, "ContextTokens", fix)
    output = _tokens(table, "GeneratedTokens", fix)
    try:
        times = np.array(stamps, dtype="datetime64[ns]")
    except ValueError:
        for row_number, text in enumerate(stamps):
            try:
                np.datetime64(text, "ns")
            except ValueError:
                raise CoralError(
                    f"{table.path}, line {row_number + 2}, column 'TIMESTAMP': {text!r} is not a timestamp "
                    "like '2023-11-16 18:15:46.6805900'; fix or delete that row"
                ) from None
        raise  # pragma: no cover
    if np.any(np.isnat(times)):
        bad = int(np.flatnonzero(np.isnat(times))[0])
        raise CoralError(f"{table.path}, line {bad + 2}, column 'TIMESTAMP': empty timestamp; fix or delete that row")
    arrival_s = (times - times.min()).astype(np.int64) / 1e9 if len(times) else np.zeros(0)
    trace = _trace(name or _default_name(table.path), arrival_s, prompt, output)
    return LoadedTrace(trace=trace, path=table.path, format="azure", rows_read=len(table.rows))


def _parse_burstgpt(table: _Table, name: str | None, models: Sequence[str] | None) -> LoadedTrace:
    fix = f"a BurstGPT trace has the columns {', '.join(BURSTGPT_COLUMNS)}, Total tokens, Log Type"
    timestamp = _floats(table, "Timestamp", fix)
    prompt = _tokens(table, "Request tokens", fix)
    output = _tokens(table, "Response tokens", fix)
    keep = np.ones(len(table.rows), dtype=bool)
    if models is not None:
        model_names = np.array(table.strings(table.column("Model", fix)), dtype=object)
        keep &= np.isin(model_names, list(models))
    filtered_out = int((~keep).sum())
    failed = keep & (output == 0)  # upstream: 0 response tokens marks a failed request
    keep &= ~failed
    empty_prompt = keep & (prompt == 0)
    keep &= ~empty_prompt
    arrival_s = timestamp[keep]
    if len(arrival_s):
        arrival_s = arrival_s - arrival_s.min()
    trace = _trace(name or _default_name(table.path), arrival_s, prompt[keep], output[keep])
    return LoadedTrace(
        trace=trace,
        path=table.path,
        format="burstgpt",
        rows_read=len(table.rows),
        dropped_failed=int(failed.sum()),
        dropped_empty_prompt=int(empty_prompt.sum()),
        filtered_out=filtered_out,
    )


def _parse_csv(table: _Table, name: str | None, columns: Sequence[str]) -> LoadedTrace:
    arrival_col, prompt_col, output_col = columns
    fix = (
        f"name the columns that hold the arrival time in seconds, the prompt tokens and the output tokens "
        f"(now {arrival_col!r}, {prompt_col!r}, {output_col!r})"
    )
    arrival_s = _floats(table, arrival_col, fix)
    prompt = _tokens(table, prompt_col, fix)
    output = _tokens(table, output_col, fix)
    if len(arrival_s) and arrival_s.min() < 0:
        bad = int(np.argmin(arrival_s))
        raise CoralError(
            f"{table.path}, line {bad + 2}, column {arrival_col!r}: arrival time {arrival_s[bad]:g} is negative; "
            "arrival times are seconds from the start of the trace, so shift them to start at 0"
        )
    trace = _trace(name or _default_name(table.path), arrival_s, prompt, output)
    return LoadedTrace(trace=trace, path=table.path, format="csv", rows_read=len(table.rows))


def load_azure(path: Path | str, *, name: str | None = None) -> LoadedTrace:
    """Load an Azure LLM inference trace (2023 format).

    Columns `TIMESTAMP` (e.g. `2023-11-16 18:15:46.6805900`), `ContextTokens` (prompt) and
    `GeneratedTokens` (output). Arrivals are rebased so the first is at 0 s; the window is the
    span plus one mean gap (so `rate_per_s` = (n-1)/span).

    Args:
        path: the CSV, plain or gzip-compressed.
        name: the trace's name; default the file name without `.csv` / `.gz`.

    Returns:
        The trace and the file's row count (Azure rows are never dropped).

    Raises:
        CoralError: missing file, missing column, a bad timestamp, NaN or negative token counts.
    """
    return _parse_azure(_read_table(path), name)


def load_burstgpt(path: Path | str, *, name: str | None = None, models: Sequence[str] | None = None) -> LoadedTrace:
    """Load a BurstGPT trace, dropping failed requests.

    Columns `Timestamp` (seconds), `Model`, `Request tokens`, `Response tokens`, `Total tokens`,
    `Log Type`. Rows with 0 response tokens are failed requests and rows with 0 request tokens
    have no prompt: both are dropped and counted in the result. Arrivals are rebased so the
    first kept request is at 0 s.

    Args:
        path: the CSV, plain or gzip-compressed.
        name: the trace's name; default the file name without `.csv` / `.gz`.
        models: keep only rows whose `Model` is one of these (e.g. `["ChatGPT"]`); default all.

    Returns:
        The trace with the counts of dropped and filtered rows.

    Raises:
        CoralError: missing file, missing column, non-numeric, NaN or negative values.
    """
    return _parse_burstgpt(_read_table(path), name, models)


def load_csv(
    path: Path | str,
    *,
    arrival_column: str = CSV_DEFAULT_COLUMNS[0],
    prompt_column: str = CSV_DEFAULT_COLUMNS[1],
    output_column: str = CSV_DEFAULT_COLUMNS[2],
    name: str | None = None,
) -> LoadedTrace:
    """Load a generic CSV trace whose columns the caller names.

    Arrival times are seconds from the start of the trace (>= 0, any order: they are sorted);
    they are not rebased.

    Args:
        path: the CSV, plain or gzip-compressed.
        arrival_column: the column of arrival times in seconds.
        prompt_column: the column of prompt lengths in tokens.
        output_column: the column of output lengths in tokens.
        name: the trace's name; default the file name without `.csv` / `.gz`.

    Returns:
        The trace and the file's row count.

    Raises:
        CoralError: missing file or column, non-numeric, NaN, negative or fractional values.
    """
    return _parse_csv(_read_table(path), name, (arrival_column, prompt_column, output_column))


def load_trace_file(path: Path | str, *, columns: Sequence[str] | None = None, name: str | None = None) -> LoadedTrace:
    """Load a trace file, recognising its format from its header.

    Azure (`TIMESTAMP, ContextTokens, GeneratedTokens`), BurstGPT (`Timestamp, Model,
    Request tokens, Response tokens, ...`) or a generic CSV with the columns `columns`
    (default `arrival_s, prompt_tokens, output_tokens`).

    Args:
        path: the CSV, plain or gzip-compressed.
        columns: generic CSV column names (arrival seconds, prompt tokens, output tokens);
            giving them forces the generic format.
        name: the trace's name; default the file name.

    Returns:
        The loaded trace.

    Raises:
        CoralError: a missing file, an unrecognised header, or bad values.
    """
    path, raw = _read_raw(path)
    cols = None if columns is None else tuple(columns)
    key = trace_cache.key_of(raw, ("load_trace_file", path.name, cols, name), loader=__file__)
    hit = trace_cache.get(key, path)
    if hit is not None:
        return hit
    loaded = _parse_any(_table_of(path, raw), cols, name)
    trace_cache.put(key, loaded)
    return loaded


def _parse_any(table: _Table, columns: Sequence[str] | None, name: str | None) -> LoadedTrace:
    if columns is not None:
        if len(columns) != 3:
            raise CoralError(f"{table.path}: give three column names (arrival seconds, prompt tokens, output tokens)")
        return _parse_csv(table, name, columns)
    header = set(table.header)
    if header >= set(AZURE_COLUMNS):
        return _parse_azure(table, name)
    if header >= set(BURSTGPT_COLUMNS):
        return _parse_burstgpt(table, name, None)
    if header >= set(CSV_DEFAULT_COLUMNS):
        return _parse_csv(table, name, CSV_DEFAULT_COLUMNS)
    raise CoralError(
        f"{table.path}: unrecognised trace columns {', '.join(map(repr, table.header))}; expected an Azure trace "
        f"({', '.join(AZURE_COLUMNS)}), a BurstGPT trace ({', '.join(BURSTGPT_COLUMNS)}, ...) or a CSV with "
        f"{', '.join(CSV_DEFAULT_COLUMNS)}; for other names, say which columns hold the arrival seconds, "
        "prompt tokens and output tokens (`columns:` in the workload spec)"
    )
