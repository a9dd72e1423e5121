"""Node multisets as count vectors: their sub-multisets, partitions and the stage lists of a
pipeline over them (shared by the exact search and its compiled kernel)."""
from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence

from coral.catalog.hardware import NodeConfig
from coral.catalog.models import ModelSpec

Counts = tuple[int, ...]


def sub_multisets(avail: Counts) -> Iterator[Counts]:
    """Every non-empty sub-multiset of `avail` (as count vectors)."""
    ranges = [range(a + 1) for a in avail]

    def rec(i: int, acc: list[int]) -> Iterator[Counts]:
        if i == len(avail):
            if any(acc):
                yield tuple(acc)
            return
        for x in ranges[i]:
            acc.append(x)
            yield from rec(i + 1, acc)
            acc.pop()

    yield from rec(0, [])


def partitions(avail: Counts, blocks: int, bound: Counts | None = None) -> Iterator[list[Counts]]:
    """Unordered partitions of the multiset `avail` into exactly `blocks` non-empty blocks,
    each generated once (blocks in non-increasing lexicographic order)."""
    total = sum(avail)
    if blocks == 0:
        if total == 0:
            yield []
        return
    if total < blocks:
        return
    if blocks == 1:
        if bound is None or avail <= bound:
            yield [avail]
        return
    for block in sub_multisets(avail):
        if bound is not None and block > bound:
            continue
        rest = tuple(a - b for a, b in zip(avail, block, strict=True))
        for tail in partitions(rest, blocks - 1, block):
            yield [block, *tail]


@functools.lru_cache(maxsize=4096)
def stage_lists(counts: Counts, stages: int) -> tuple[tuple[Counts, ...], ...]:
    """Stage lists (pipeline order) up to identical nodes and the order of middle stages.

    Memoized: the same count vectors (e.g. three of one config, two of another) recur across
    thousands of multisets."""
    if stages == 1:
        return ((counts,),)
    out = []
    for first in sub_multisets(counts):
        rest = tuple(a - b for a, b in zip(counts, first, strict=True))
        for last in sub_multisets(rest):
            mid = tuple(a - b for a, b in zip(rest, last, strict=True))
            for middle in partitions(mid, stages - 2):
                out.append((first, *middle, last))
    return tuple(out)


def enumerate_multisets(configs: Sequence[NodeConfig], model: ModelSpec, n_max: int, rho: float) -> tuple[int, list[tuple[str, ...]]]:
    """All multisets of at most `n_max` nodes (of several nodes: of the shapes' default instance
    types only), and those whose GPU memory is within `[weights, rho × weights]` (one node: only
    the lower bound), smallest first."""
    names = sorted(c.name for c in configs)
    # Several nodes take each shape's default instance type; every other type of it is a template
    # of its own node only (the types differ in NIC and price, so a single node is where it pays).
    shared = sorted(c.name for c in configs if not c.instance_type)
    mem = {c.name: c.memory_bytes for c in configs}
    lo, hi = model.weights_bytes, rho * model.weights_bytes
    total, ok = 0, []
    for size in range(1, n_max + 1):
        for combo in itertools.combinations_with_replacement(names if size == 1 else shared, size):
            total += 1
            m = sum(mem[n] for n in combo)
            if lo <= m and (m <= hi or size == 1):  # one node is what is rented anyway (its layout splits it)
                ok.append(combo)
    return total, ok
