"""The columnar (Parquet) library: round trip, lazy tables, what a user opens, stale files."""
import dataclasses
import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from coral.perf import Phase
from coral.scenario import load_scenario
from coral.templates import columnar
from coral.templates.library import (
    LIBRARY_FORMAT,
    build_library,
    cache_path,
    specs_for,
    template_to_dict,
)
from coral.templates.table import TemplateTable, rank_by_value
from coral.templates.template import LibraryStats, TemplateLibrary


@pytest.fixture(scope="module")
def core():
    return load_scenario("core", overrides={"planner": {"n_max": 2, "batch_grid": [1, 8, 32]}})


@pytest.fixture(scope="module")
def built(core, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    lib = build_library(core, cache_dir=cache)
    return cache, lib


def test_cached_library_reads_back_identical_and_lazily(core, built):
    cache, lib = built
    again = build_library(core, cache_dir=cache)
    assert all(s.cached for s in again.stats)
    assert len(again.templates) == len(lib.templates) > 0
    table = again.of("qwen3-32b", Phase.PREFILL)
    assert isinstance(table, TemplateTable)
    assert table._memo == {}  # opening the library made no template object
    assert [template_to_dict(t) for t in again.templates] == [template_to_dict(t) for t in lib.templates]
    assert table[3] is table[3]  # made once, then kept


def test_arrays_match_the_templates(built):
    _, lib = built
    for model, phase in lib.groups:
        objs = list(lib.of(model, phase))
        names, usage, theta = lib.of(model, phase).arrays()
        assert usage.dtype == np.int8 and usage.shape == (len(objs), len(names))
        for t, row, th in zip(objs, usage, theta, strict=True):
            assert {n: int(c) for n, c in zip(names, row, strict=True) if c} == t.counts
            assert th == t.throughput_tok_per_s


def test_find_by_multiset(built):
    _, lib = built
    table = lib.of("phi-4", Phase.DECODE)
    for i in (0, len(table) // 2, len(table) - 1):
        assert table.find(table[i].nodes) == i
        assert table.find(tuple(reversed(table[i].nodes))) == i  # a multiset: order does not matter
    assert table.find(("1xNOPE",)) is None
    assert table.find(()) is None


def test_user_opens_the_file_with_pandas(core, built):
    pd = pytest.importorskip("pandas")
    cache, lib = built
    spec = next(s for s in specs_for(core) if s.model.name == "qwen3-32b" and s.phase is Phase.DECODE)
    df = pd.read_parquet(cache_path(spec, core.perf, cache))
    objs = list(lib.of("qwen3-32b", Phase.DECODE))
    assert len(df) == len(objs)
    assert list(df["placement.throughput_tok_per_s"]) == [t.placement.throughput_tok_per_s for t in objs]
    assert list(df["realized_tok_per_s"]) == [t.throughput_tok_per_s for t in objs]  # what the allocator counts
    assert [tuple(n) for n in df["nodes"]] == [t.nodes for t in objs]
    one = next(c for c in df.columns if c.startswith("count."))
    assert list(df[one]) == [t.counts.get(one.removeprefix("count."), 0) for t in objs]
    meta = json.loads(pq.ParquetFile(cache_path(spec, core.perf, cache)).schema_arrow.metadata[b"coral"])
    assert meta["stats"]["kept"] == len(objs)


def test_stale_or_broken_files_read_as_misses(tmp_path, built):
    _, lib = built
    objs = list(lib.of("phi-4", Phase.DECODE))
    stats = next(s for s in lib.stats if (s.model, s.phase) == ("phi-4", Phase.DECODE))
    path = tmp_path / "x.parquet"
    columnar.write(path, objs, stats)
    assert columnar.read(path) is not None
    t = pq.read_table(path)
    pq.write_table(t.drop_columns(["placement.comm_s"]), path)  # a field this version lacks
    assert columnar.read(path) is None
    path.write_bytes(b"PAR1 not really")
    assert columnar.read(path) is None
    assert columnar.read(tmp_path / "missing.parquet") is None


def test_new_dataclass_fields_become_columns():
    @dataclasses.dataclass(frozen=True)
    class Inner:
        a: int
        tags: tuple[str, ...]

    @dataclasses.dataclass(frozen=True)
    class Row:
        name: str
        phase: Phase
        budget_ms: float | None
        inner: Inner
        parts: tuple[Inner, ...]

    rows = [Row(name="x", phase=Phase.DECODE, budget_ms=None, inner=Inner(a=1, tags=("p",)),
                parts=(Inner(a=2, tags=()), Inner(a=3, tags=("q", "r")))),
            Row(name="y", phase=Phase.PREFILL, budget_ms=2.5, inner=Inner(a=4, tags=()), parts=())]
    table = columnar.to_table(rows, Row)
    assert table.column_names == ["name", "phase", "budget_ms", "inner.a", "inner.tags", "parts"]
    assert table.schema.field("parts").type == pa.list_(pa.struct([("a", pa.int64()), ("tags", pa.list_(pa.string()))]))
    assert [columnar.from_row(r, Row) for r in table.to_pylist()] == rows


def test_legacy_json_lines_entry_is_converted_not_solved(core, tmp_path, built):
    _, lib = built
    spec = specs_for(core, models=["gpt-oss-20b"], phases=[Phase.DECODE])[0]
    objs = list(lib.of("gpt-oss-20b", Phase.DECODE))
    stats = next(s for s in lib.stats if (s.model, s.phase) == ("gpt-oss-20b", Phase.DECODE))
    head = {"format": LIBRARY_FORMAT, "stats": {**dataclasses.asdict(stats), "phase": "decode"}}
    legacy = cache_path(spec, core.perf, tmp_path).with_suffix(".jsonl")
    legacy.write_text("".join(json.dumps(x) + "\n" for x in [head, *map(template_to_dict, objs)]))
    got = build_library(core, cache_dir=tmp_path, models=["gpt-oss-20b"])
    assert got.of("gpt-oss-20b", Phase.DECODE).stats.wall_s == stats.wall_s  # the legacy file read, not rebuilt
    assert [template_to_dict(t) for t in got.of("gpt-oss-20b", Phase.DECODE)] == [template_to_dict(t) for t in objs]
    assert cache_path(spec, core.perf, tmp_path).exists()


def test_rank_by_value_matches_a_sort_over_objects(built):
    _, lib = built
    prices = {"1xL4": 0.8, "1xL40S": 1.9, "2xL40S": 3.7}  # other configs unpriced: left out
    ts = lib.of("qwen3-32b", Phase.PREFILL)
    ranked = rank_by_value(ts, prices, 5)
    want = sorted(((t.throughput_tok_per_s / t.price_usd_per_h(prices), t) for t in ts
                   if all(c in prices for c in t.counts)), key=lambda x: -x[0])[:5]
    assert [t for _, _, t in ranked] == [t for _, t in want]
    assert [v for v, _, _ in ranked] == pytest.approx([v for v, _ in want], rel=1e-12)


def test_library_of_tables_and_merge(built):
    _, lib = built
    parts = [TemplateLibrary.from_groups({g: lib.of(*g)}, stats=[s for s in lib.stats if (s.model, s.phase) == g])
             for g in lib.groups]
    merged = TemplateLibrary.merge(parts)
    assert merged.groups == lib.groups and len(merged.templates) == len(lib.templates)
    assert merged.templates[len(merged.templates) - 1] == lib.templates[len(lib.templates) - 1]
    assert isinstance(merged.stats[0], LibraryStats)


def test_reading_the_library_and_planning_import_no_heavy_module(core, built, tmp_path):
    import subprocess

    cache, _ = built
    code = ("import sys; from coral.scenario import load_scenario; from coral.templates.library import build_library;"
            "from coral.allocator import allocate;"
            "s = load_scenario('core', overrides={'planner': {'n_max': 2, 'batch_grid': [1, 8, 32]}});"
            f"lib = build_library(s, cache_dir=__import__('pathlib').Path({str(cache)!r}));"
            "t = lib.of('phi-4', __import__('coral.perf', fromlist=['Phase']).Phase.DECODE); t.arrays(); t[0];"
            "p = allocate(s, lib); assert p.instances, p;"
            "print(sorted(m for m in ('pandas', 'numba', 'torch', 'ray', 'matplotlib', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_a_file_backed_table_pickles_by_its_path(built):
    import pickle

    _, lib = built
    table = lib.of("phi-4", Phase.PREFILL)
    copy = pickle.loads(pickle.dumps(table))
    assert len(copy) == len(table) and copy[len(table) - 1] == table[len(table) - 1]
    assert (copy.arrays()[1] == table.arrays()[1]).all()
