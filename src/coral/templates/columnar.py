"""The template library on disk as Apache Parquet: one file per (model, phase), one row per
template, a column per field, read lazily and only in the columns a caller needs.

The layout follows the `Template` dataclass itself (walked with `dataclasses.fields`), so a field
added to `Template`, `Placement` or `Stage` becomes a column without editing this module:

* a scalar field (`str`, `int`, `float`, `bool`, an `Enum`, or any of them `| None`) is a column
  of that type (an enum stores its value);
* a nested dataclass is flattened into `parent.child` columns (`placement.micro_batch`,
  `placement.throughput_tok_per_s`, ...), as `pandas.json_normalize` names them;
* a `tuple[X, ...]` is a list column (`nodes: list<string>`), and a tuple of dataclasses a list
  of structs (`placement.stages: list<struct<nodes, node_index, layers, time_s, ...>>`);
* a mapping is stored as JSON text.

One more column per configuration, `count.<config>` (int8), holds the template's node counts
`U_c(τ)`: the allocator's usage matrix, kept in the file so no process rebuilds it from `nodes`.

The file's key-value metadata holds the build's `LibraryStats`, the container version and the
configurations of the count columns. A file
whose columns do not match the current dataclass (a field added or renamed since it was written)
reads as a cache miss, so it is rebuilt rather than misread.

`read` opens a file as a lazy `coral.templates.table.TemplateTable`: its length comes from the
footer, the allocator's arrays (usage and throughput) from their columns, and `Template`
objects are made only for the rows asked for, reading only their row groups.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from coral.atomic import replacing
from coral.perf.model import Phase
from coral.templates.table import TemplateTable, usage_matrix
from coral.templates.template import LibraryStats, Template

CONTAINER = "coral-parquet/1"  # how the rows are laid out (not what they mean: that is LIBRARY_FORMAT)
ROW_GROUP_ROWS = 4_096  # making one template reads one row group (all its columns), not the file
COUNT = "count."  # + a configuration name: U_c(τ), the template's nodes of that configuration
THROUGHPUT = "placement.throughput_tok_per_s"
REALIZED = "realized_tok_per_s"  # Θ on the length distribution (Template.throughput_tok_per_s); null: the placement's
DECODE = "decode_tok_per_s"  # Θ_D of a colocated template; null for the other phases
_META = b"coral"


# --- the dataclass <-> Arrow mapping ---------------------------------------------------------------

@functools.cache
def _hints(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def _optional(tp: Any) -> tuple[Any, bool]:
    """(the type without `None`, whether `None` was allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) != len(typing.get_args(tp))
    return tp, False


@functools.cache
def _kind(tp: Any) -> tuple[str, Any]:
    """How a field type is stored: ('scalar', arrow type), ('enum', the enum), ('dataclass',
    cls), ('list', item type) or ('json', None)."""
    tp, _ = _optional(tp)
    origin = typing.get_origin(tp)
    if origin in (tuple, list) or tp in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        if len(set(args)) != 1:
            raise TypeError(f"a columnar tuple field needs one item type (tuple[X, ...]), got {tp!r}")
        return "list", args[0]
    if origin in (dict, Mapping) or tp in (dict,) or origin is typing.get_origin(Mapping[str, int]):
        return "json", None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return "dataclass", tp
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "enum", tp
    scalar = {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string()}
    if tp in scalar:
        return "scalar", scalar[tp]
    raise TypeError(f"no columnar representation for {tp!r}; extend coral.templates.columnar._kind")


def _arrow_type(tp: Any) -> pa.DataType:
    kind, arg = _kind(tp)
    if kind == "scalar":
        return arg
    if kind == "enum":
        return _arrow_type(type(next(iter(arg)).value))
    if kind == "json":
        return pa.string()
    if kind == "list":
        return pa.list_(_arrow_type(arg))
    return pa.struct([pa.field(n, _arrow_type(t)) for n, t in _hints(arg)])


def _encode(values: list[Any], tp: Any) -> pa.Array:
    """`values` (all of field type `tp`) as one Arrow array."""
    kind, arg = _kind(tp)
    if kind == "scalar":
        return pa.array(values, type=arg)
    if kind == "enum":
        return pa.array([None if v is None else v.value for v in values], type=_arrow_type(tp))
    if kind == "json":
        return pa.array([None if v is None else json.dumps(dict(v), sort_keys=True, default=str) for v in values],
                        type=pa.string())
    if kind == "list":
        lengths = np.fromiter((0 if v is None else len(v) for v in values), dtype=np.int32, count=len(values))
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)
        flat = [x for v in values if v is not None for x in v]
        mask = pa.array([v is None for v in values]) if any(v is None for v in values) else None
        return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), _encode(flat, arg), mask=mask)
    children = [_encode([None if v is None else getattr(v, n) for v in values], t) for n, t in _hints(arg)]
    mask = pa.array([v is None for v in values]) if any(v is None for v in values) else None
    return pa.StructArray.from_arrays(children, names=[n for n, _ in _hints(arg)], mask=mask)


def _flat_columns(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    """(column name, field type) of every column of `cls`, nested dataclasses flattened."""
    out: list[tuple[str, Any]] = []
    for name, tp in _hints(cls):
        inner, _ = _optional(tp)
        if _kind(tp)[0] == "dataclass" and inner is tp:  # an optional dataclass stays one struct column
            out.extend(_flat_columns(inner, f"{prefix}{name}."))
        else:
            out.append((prefix + name, tp))
    return out


def schema(cls: type = Template) -> pa.Schema:
    """The Arrow schema of a table of `cls` rows (see the module docstring)."""
    return pa.schema([pa.field(n, _arrow_type(t)) for n, t in _flat_columns(cls)])


def to_table(rows: Sequence[Any], cls: type = Template) -> pa.Table:
    """Dataclass instances as a flat Arrow table (one row each)."""
    arrays, names = [], []

    def walk(objs: list[Any], c: type, prefix: str) -> None:
        for name, tp in _hints(c):
            inner, _ = _optional(tp)
            vals = [getattr(o, name) for o in objs]
            if _kind(tp)[0] == "dataclass" and inner is tp:
                walk(vals, inner, f"{prefix}{name}.")
            else:
                arrays.append(_encode(vals, tp))
                names.append(prefix + name)

    walk(list(rows), cls, "")
    return pa.Table.from_arrays(arrays, schema=schema(cls)) if arrays else pa.table({})


Decoder = typing.Callable[[Any], Any]


@functools.cache
def _decoder(tp: Any) -> Decoder:
    """A function turning one stored value of field type `tp` back into its Python value (made
    once per type: a library has ~10^6 rows)."""
    kind, arg = _kind(tp)
    if kind == "scalar":
        return lambda v: v
    if kind == "enum":
        return lambda v: None if v is None else arg(v)
    if kind == "json":
        return lambda v: None if v is None else json.loads(v)
    if kind == "list":
        item = _decoder(arg)
        return lambda v: None if v is None else tuple(map(item, v))
    fields = tuple((n, _decoder(t)) for n, t in _hints(arg))
    return lambda v: None if v is None else arg(**{n: f(v[n]) for n, f in fields})


@functools.cache
def _row_decoder(cls: type, prefix: str = "") -> Decoder:
    parts: list[tuple[str, Any]] = []
    for name, tp in _hints(cls):
        inner, _ = _optional(tp)
        if _kind(tp)[0] == "dataclass" and inner is tp:
            parts.append((name, ("nested", _row_decoder(inner, f"{prefix}{name}."))))
        else:
            parts.append((name, (prefix + name, _decoder(tp))))

    def decode(row: Mapping[str, Any]) -> Any:
        return cls(**{n: (f(row) if col == "nested" else f(row[col])) for n, (col, f) in parts})
    return decode


def from_row(row: Mapping[str, Any], cls: type = Template) -> Any:
    """One flat row (column name -> Python value, as `Table.to_pylist` gives) as a `cls`."""
    return _row_decoder(cls)(row)


def _stats_json(stats: LibraryStats) -> dict[str, Any]:
    return {**dataclasses.asdict(stats), "phase": stats.phase.value}


def _stats_from(d: Mapping[str, Any]) -> LibraryStats:
    known = {f.name for f in dataclasses.fields(LibraryStats)}
    return LibraryStats(**{**{k: v for k, v in d.items() if k in known}, "phase": Phase(d["phase"])})


# --- files -----------------------------------------------------------------------------------------

def write(path: Path, templates: Sequence[Template], stats: LibraryStats) -> None:
    """Write one (model, phase)'s templates as Parquet, atomically (`coral.atomic.replacing`: an
    interrupted build never leaves a half-written entry).

    Besides the dataclass columns, one `count.<config>` column (int8) per configuration that
    occurs holds `U_c(τ)`, the template's nodes of that configuration: the allocator's usage
    matrix, stored once per library version and read by every process without parsing `nodes`.
    """
    table = to_table(templates)
    names, usage = usage_matrix(templates)
    for k, name in enumerate(names):
        table = table.append_column(pa.field(COUNT + name, pa.int8()), pa.array(usage[:, k], type=pa.int8()))
    meta = {"container": CONTAINER, "stats": _stats_json(stats), "configs": names}
    table = table.replace_schema_metadata({_META: json.dumps(meta).encode()})
    with replacing(path) as tmp:
        pq.write_table(table, tmp, row_group_size=ROW_GROUP_ROWS, compression="zstd")


def read(path: Path) -> TemplateTable | None:
    """Open a library file (footer only), or None when it is missing, unreadable, of another
    container version or of another schema (the caller rebuilds it)."""
    try:
        pf = pq.ParquetFile(path)
        raw = (pf.schema_arrow.metadata or {}).get(_META)
        meta = json.loads(raw) if raw else {}
        if meta.get("container") != CONTAINER:
            return None
        counts = [COUNT + n for n in meta["configs"]]
        fields = pa.schema([f for f in pf.schema_arrow if not f.name.startswith(COUNT)])
        if not fields.equals(schema(), check_metadata=False) or \
                [f.name for f in pf.schema_arrow if f.name.startswith(COUNT)] != counts:
            return None
        stats = dataclasses.replace(_stats_from(meta["stats"]), cached=True)
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException):
        return None
    return TemplateTable(model=stats.model, phase=stats.phase, stats=stats,
                         source=ParquetSource(pf, list(meta["configs"]), path))


def _numpy(arr: pa.Array) -> np.ndarray:
    """A primitive Arrow array without nulls as a numpy view of its buffer (`Array.to_numpy`
    would import pandas, half a second that `coral plan` does not need)."""
    if arr.null_count:
        raise ValueError(f"unexpected nulls in a {arr.type} column")
    dtype = np.dtype(arr.type.to_pandas_dtype())
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


class ParquetSource:
    """Reads a library file for a `TemplateTable`: two columns for the arrays, row groups for
    the templates asked for."""

    def __init__(self, file: pq.ParquetFile, configs: list[str], path: Path | None = None) -> None:
        self.file = file
        self.configs = configs
        self.path = path
        md = file.metadata
        self.num_rows = md.num_rows
        self._starts = np.cumsum([0] + [md.row_group(i).num_rows for i in range(md.num_row_groups)])

    def __getstate__(self) -> dict[str, Any]:  # a table travels to another process by its path
        if self.path is None:
            raise TypeError("a ParquetSource opened without a path cannot be pickled")
        return {"path": self.path, "configs": self.configs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(pq.ParquetFile(state["path"]), state["configs"], state["path"])  # type: ignore[misc]

    def arrays(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        cols = [COUNT + n for n in self.configs]
        t = self.file.read(columns=[*cols, THROUGHPUT, REALIZED])
        usage = np.zeros((self.num_rows, len(cols)), dtype=np.int8)
        for k, name in enumerate(cols):
            usage[:, k] = _numpy(t.column(name).combine_chunks())
        # What the allocator counts is Template.throughput_tok_per_s: the realized Θ where set
        placement = _numpy(t.column(THROUGHPUT).combine_chunks()).astype(float)
        col = t.column(REALIZED).combine_chunks()
        if pa.types.is_null(col.type) or col.null_count == len(col):
            return list(self.configs), usage, placement
        if col.null_count == 0:
            return list(self.configs), usage, _numpy(col).astype(float)
        # a few templates without it (hand-made): their placement's (no pyarrow.compute: it loads pandas)
        realized = np.array([np.nan if v is None else v for v in col.to_pylist()], dtype=float)
        return list(self.configs), usage, np.where(np.isnan(realized), placement, realized)

    def decode_rates(self) -> np.ndarray:
        """`Θ_D` per row (`Template.decode_tok_per_s`; 0 where null: not a colocated template)."""
        col = self.file.read(columns=[DECODE]).column(DECODE).combine_chunks()
        if pa.types.is_null(col.type) or col.null_count == len(col):
            return np.zeros(self.num_rows)
        if col.null_count == 0:
            return _numpy(col).astype(float)
        return np.array([0.0 if v is None else v for v in col.to_pylist()], dtype=float)

    def rows(self, rows: Sequence[int]) -> list[Template]:
        """The templates of `rows` (sorted, distinct), reading only their row groups."""
        out: list[Template] = []
        groups = np.searchsorted(self._starts, rows, side="right") - 1
        for g in np.unique(groups):
            part = self.file.read_row_group(int(g))
            local = [r - int(self._starts[g]) for r, gg in zip(rows, groups, strict=True) if gg == g]
            if len(local) > 64:  # many rows of this group: convert it whole
                every = part.to_pylist()
                out.extend(from_row(every[r]) for r in local)
            else:  # a few: one-row slices (`Table.take` on a list would import pandas)
                out.extend(from_row(part.slice(r, 1).to_pylist()[0]) for r in local)
        return out


