"""One (model, phase)'s templates as a lazy sequence with the arrays the allocator reads: made
from Template objects in memory, or from a file (`coral.templates.columnar`) without making any
object until one is asked for."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, overload

import numpy as np

from coral.perf.model import Phase
from coral.templates.template import LibraryStats, Template

Arrays = tuple[list[str], np.ndarray, np.ndarray]  # config names, usage [template, config] (int8), throughput
_CHUNK = 16_384  # rows made per step when iterating


class TableSource(Protocol):
    """Where a file-backed table reads from."""

    num_rows: int

    def arrays(self) -> Arrays: ...

    def rows(self, rows: Sequence[int]) -> list[Template]: ...

    def decode_rates(self) -> np.ndarray: ...


class TemplateTable(Sequence[Template]):
    """A (model, phase)'s templates: a `Sequence[Template]` whose `len` is free and whose
    indexing makes (and keeps) only the rows asked for; `arrays()` and `find()` work without
    making any object."""

    def __init__(self, *, model: str, phase: Phase, stats: LibraryStats | None = None,
                 source: TableSource | None = None, objects: Sequence[Template] | None = None) -> None:
        if (source is None) == (objects is None):
            raise ValueError("a TemplateTable needs exactly one of source, objects")
        self.model, self.phase, self.stats = model, phase, stats
        self._source = source
        self._objects = tuple(objects) if objects is not None else None
        self._len = source.num_rows if source is not None else len(self._objects or ())
        self._memo: dict[int, Template] = {}
        self._arrays: Arrays | None = None
        self._decode: np.ndarray | None = None
        self._hashes: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def __repr__(self) -> str:
        return f"TemplateTable({self.model}/{self.phase.value}, {self._len} templates)"

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> Template: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Template]: ...

    def __getitem__(self, i: int | slice) -> Template | Sequence[Template]:
        if isinstance(i, slice):
            return self.take(range(*i.indices(self._len)))
        if not -self._len <= i < self._len:
            raise IndexError(f"template {i} of {self._len}")
        return self.take([i % self._len])[0]

    def __iter__(self) -> Iterator[Template]:
        for lo in range(0, self._len, _CHUNK):
            yield from self.take(range(lo, min(lo + _CHUNK, self._len)))

    def take(self, rows: Sequence[int]) -> list[Template]:
        """The templates of `rows`, made once and kept (the same row gives the same object)."""
        if self._objects is not None:
            return [self._objects[int(r)] for r in rows]
        missing = sorted({int(r) for r in rows} - self._memo.keys())
        if missing:
            assert self._source is not None
            self._memo.update(zip(missing, self._source.rows(missing), strict=True))
        return [self._memo[int(r)] for r in rows]

    def arrays(self) -> Arrays:
        """(configuration names, `U[t, c]` nodes of each in each template (int8), throughput per
        template), computed once per table and kept (reused across epochs)."""
        if self._arrays is None:
            if self._source is not None:
                self._arrays = self._source.arrays()
            else:
                ts = self._objects or ()
                names, usage = usage_matrix(ts)
                theta = np.fromiter((t.throughput_tok_per_s for t in ts), dtype=float, count=len(ts))
                self._arrays = (names, usage, theta)
        return self._arrays

    def decode_rates(self) -> np.ndarray:
        """`Θ_D` per template (colocated templates' generated tokens/s; 0 for the other phases),
        computed once and kept."""
        if self._decode is None:
            if self._source is not None:
                self._decode = self._source.decode_rates()
            else:
                ts = self._objects or ()
                self._decode = np.fromiter((t.decode_tok_per_s or 0.0 for t in ts), dtype=float, count=len(ts))
        return self._decode

    def find(self, nodes: Sequence[str]) -> int | None:
        """The row of the template on exactly this node multiset, or None.

        Each template's usage row is hashed (a dot product with random 64-bit numbers, wrapping
        around) once per table; a lookup is a binary search plus one check of the row.
        """
        names, usage, _ = self.arrays()
        if self._hashes is None:
            salt = np.random.default_rng(0x5EED).integers(1, 2**62, size=len(names), dtype=np.int64)
            h = usage.astype(np.int64) @ salt if len(names) else np.zeros(len(usage), dtype=np.int64)
            order = np.argsort(h, kind="stable")
            self._hashes = (salt, h[order], order)
        salt, sorted_h, order = self._hashes
        index = {n: i for i, n in enumerate(names)}
        if not nodes or any(n not in index for n in nodes):
            return None
        key = salt[[index[n] for n in nodes]].sum()  # wraps around like the product above
        want = tuple(sorted(nodes))
        for k in range(int(np.searchsorted(sorted_h, key, "left")), int(np.searchsorted(sorted_h, key, "right"))):
            row = int(order[k])
            if self.take([row])[0].nodes == want:  # rules out a hash collision
                return row
        return None


def usage_matrix(templates: Sequence[Template]) -> tuple[list[str], np.ndarray]:
    """(the configurations that occur, sorted; `U[t, c]` nodes of each in each template, int8)."""
    names = sorted({n for t in templates for n in t.nodes})
    index = {n: i for i, n in enumerate(names)}
    lengths = np.fromiter((len(t.nodes) for t in templates), dtype=np.int64, count=len(templates))
    codes = np.fromiter((index[n] for t in templates for n in t.nodes), dtype=np.int64, count=int(lengths.sum()))
    owner = np.repeat(np.arange(len(templates), dtype=np.int64), lengths)
    usage = np.bincount(owner * len(names) + codes, minlength=len(templates) * len(names))
    if usage.size and usage.max() > np.iinfo(np.int8).max:
        raise ValueError("a template with more than 127 nodes of one configuration")
    return names, usage.reshape(len(templates), len(names)).astype(np.int8)


def as_table(templates: Sequence[Template]) -> TemplateTable:
    """`templates` as a TemplateTable (itself when it is one)."""
    if isinstance(templates, TemplateTable):
        return templates
    first = templates[0] if len(templates) else None
    return TemplateTable(model=first.model if first else "", phase=first.phase if first else Phase.PREFILL,
                         objects=templates)


def rank_by_value(templates: Sequence[Template], prices: dict[str, float],
                  top: int) -> list[tuple[float, float, Template]]:
    """The `top` templates by throughput per $/h at `prices` (config -> $/h per node), best
    first, as (tok/s per $/h, $/h, template); templates using a config without a price are
    left out. Ranks on the table's arrays and makes only the `top` template objects."""
    table = as_table(templates)
    names, usage, theta = table.arrays()
    if not len(table):
        return []
    price = np.array([prices.get(n, np.nan) for n in names], dtype=float)
    sold = ~np.isnan(price)
    ok = ~np.any(usage[:, ~sold] > 0, axis=1)
    cost = usage[:, sold].astype(float) @ price[sold]
    with np.errstate(divide="ignore", invalid="ignore"):
        value = np.where(ok & (cost > 0), theta / np.where(cost > 0, cost, 1.0), -np.inf)
    order = np.argsort(-value, kind="stable")[: min(top, int(ok.sum()))]
    order = order[np.isfinite(value[order])]
    return [(float(value[i]), float(cost[i]), t) for i, t in zip(order, table.take(order.tolist()), strict=True)]
