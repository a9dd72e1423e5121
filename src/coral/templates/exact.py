"""Exact fast search for the placement problem (DESIGN §3), the ILP's agreeing twin.

Identical nodes are interchangeable and middle stages are interchangeable (only the first and
last stage carry extras), so we enumerate (first block, last block, unordered partition of the
rest into S−2 middle blocks) of the node *multiset*. For each such stage list the best layer
split is found exactly: for a target throughput Θ each stage's largest feasible layer count is
`U_s(Θ) = max{j ≤ cap_s : R_s(j) ≥ Θ}` (`R_s` decreases in `j`); a split exists iff
`Σ U_s ≥ L` and the minimum latency over splits with `1 ≤ j_s ≤ U_s`, `Σ j_s = L` fits the SLO.
Stage latency `T_s(j) = max_k τ_k(j)` is a max of lines, so its increments are non-decreasing
and the minimum latency is found greedily (separable convex resource allocation). Feasibility
is monotone in Θ and the optimum equals some `R_s(j)`, so bisection over those breakpoints is exact.
"""
from __future__ import annotations

import bisect
import functools
import heapq
from collections.abc import Iterator

import numpy as np

from coral.templates.problem import FIRST, LAST, MIDDLE, ONLY, Placement, PlacementProblem, evaluate

Counts = tuple[int, ...]


def _sub_multisets(avail: Counts) -> Iterator[Counts]:
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


def _partitions(avail: Counts, blocks: int, bound: Counts | None = None) -> Iterator[list[Counts]]:
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
    for block in _sub_multisets(avail):
        if bound is not None and block > bound:
            continue
        rest = tuple(a - b for a, b in zip(avail, block, strict=True))
        for tail in _partitions(rest, blocks - 1, block):
            yield [block, *tail]


@functools.lru_cache(maxsize=4096)
def stage_lists(counts: Counts, stages: int) -> tuple[tuple[Counts, ...], ...]:
    """Stage lists (pipeline order) up to identical nodes and the order of middle stages.

    Memoized: the same count vectors (e.g. three of one config, two of another) recur across
    thousands of multisets."""
    if stages == 1:
        return ((counts,),)
    out = []
    for first in _sub_multisets(counts):
        rest = tuple(a - b for a, b in zip(counts, first, strict=True))
        for last in _sub_multisets(rest):
            mid = tuple(a - b for a, b in zip(rest, last, strict=True))
            for middle in _partitions(mid, stages - 2):
                out.append((first, *middle, last))
    return tuple(out)


class _Stage:
    """Rates and latencies of one stage for every layer count `j = 1..L`."""

    __slots__ = ("members", "cap", "rate", "lat", "inc", "neg_rate")

    def __init__(self, problem: PlacementProblem, members: list[int], pos: int, js: np.ndarray) -> None:
        self.members = members
        self.cap = min(problem.cap[k][pos] for k in members)
        taus = np.array([js * problem.t[k] + problem.o[k][pos] for k in members])
        self.rate = (problem.u / taus).sum(axis=0)  # R_s(j), decreasing in j
        self.lat = taus.max(axis=0)  # T_s(j), convex piecewise linear in j
        self.inc = np.diff(self.lat)  # T_s(j+1) - T_s(j), non-decreasing
        self.neg_rate = (-self.rate).tolist()  # increasing: for bisect

    def upper(self, theta: float) -> int:
        """`U_s(Θ)`: most layers with rate ≥ Θ, within memory."""
        # rate is decreasing, so the j with rate[j-1] >= theta form a prefix
        return min(bisect.bisect_right(self.neg_rate, -theta), self.cap)


def _min_latency(stages: list[_Stage], upper: list[int], layers: int) -> tuple[float, list[int]] | None:
    """Minimum Σ T_s(j_s) with 1 ≤ j_s ≤ upper_s, Σ j_s = layers (greedy on increments)."""
    if any(u < 1 for u in upper) or sum(upper) < layers:
        return None
    js = [1] * len(stages)
    total = sum(float(st.lat[0]) for st in stages)
    heap = [(float(st.lat[1] - st.lat[0]), s) for s, st in enumerate(stages) if upper[s] > 1]
    heapq.heapify(heap)
    for _ in range(layers - len(stages)):
        inc, s = heapq.heappop(heap)
        total += inc
        js[s] += 1
        if js[s] < upper[s]:
            st = stages[s]
            heapq.heappush(heap, (float(st.lat[js[s]] - st.lat[js[s] - 1]), s))
    return total, js


def _split(problem: PlacementProblem, stages: list[_Stage], floor: float) -> tuple[float, list[int]] | None:
    """Best (Θ, layers) for fixed stages with Θ > `floor`, or None."""
    p = problem
    budget = p.budget_s * (1 + 1e-12) - (p.stages - 1) * p.comm_s
    if budget < 0:
        return None

    base = sum(float(st.lat[0]) for st in stages)
    extra = p.num_layers - len(stages)

    def feasible(theta: float) -> list[int] | None:
        """The minimum-latency split with every stage's rate ≥ Θ, or None."""
        upper = [st.upper(theta) for st in stages]
        if min(upper) < 1 or sum(upper) < p.num_layers:
            return None
        if extra > 0:
            # Each stage's increments are non-decreasing, so the cheapest `extra` increments
            # overall are prefixes of each stage's list: the greedy's total, without the greedy.
            incs = np.concatenate([st.inc[: u - 1] for st, u in zip(stages, upper, strict=True)])
            total = base + float(np.partition(incs, extra - 1)[:extra].sum())
        else:
            total = base
        if total > budget:
            return None
        return upper

    def split_of(upper: list[int]) -> list[int]:
        got = _min_latency(stages, upper, p.num_layers)
        assert got is not None
        return got[1]

    # Cheap exits first: every stage holds >= 1 layer, so Θ ≤ min_s R_s(1); and nothing above
    # `floor` may be feasible at all (checked at the smallest Θ above it, before sorting breakpoints).
    if min(float(st.rate[0]) for st in stages) <= floor:
        return None
    above = np.nextafter(floor, np.inf)
    if feasible(above) is None:
        return None
    cands = np.unique(np.concatenate([st.rate[: st.cap] for st in stages]))
    cands = cands[cands > floor]
    if cands.size == 0:
        return None
    lo_js = feasible(float(cands[0]))
    if lo_js is None:
        return None
    lo, hi = 0, cands.size - 1  # cands[lo] feasible; find the largest feasible index
    best_js = lo_js
    while lo < hi:
        mid = (lo + hi + 1) // 2
        js = feasible(float(cands[mid]))
        if js is None:
            hi = mid - 1
        else:
            lo, best_js = mid, js
    return float(cands[lo]), split_of(best_js)


def solve_exact(problem: PlacementProblem, floor: float = 0.0) -> Placement | None:
    """The throughput-optimal placement of `problem` (fixed S and b), or None if infeasible.

    Args:
        problem: the placement problem.
        floor: only placements with throughput strictly above `floor` are of interest; None is
            returned when there is none (the library passes the best throughput already found).

    Returns:
        The optimal placement (its throughput is optimal; among equal throughputs the first
        stage list found wins), or None.
    """
    p = problem
    types: dict[tuple[float, tuple[float, ...], tuple[int, ...]], list[int]] = {}
    for k in range(len(p.nodes)):
        types.setdefault((p.t[k], p.o[k], p.cap[k]), []).append(k)
    groups = list(types.values())
    counts = tuple(len(g) for g in groups)
    js = np.arange(1, p.num_layers + 1, dtype=float)
    stage_cache: dict[tuple[Counts, int], _Stage] = {}

    def stage(block: Counts, pos: int) -> _Stage:
        key = (block, pos)
        if key not in stage_cache:
            members = [k for g, n in zip(groups, block, strict=True) for k in [g[0]] * n]
            stage_cache[key] = _Stage(p, members, pos, js)
        return stage_cache[key]

    best: tuple[float, list[Counts], list[int]] | None = None
    for blocks in stage_lists(counts, p.stages):
        if p.stages == 1:
            sts = [stage(blocks[0], ONLY)]
        else:
            sts = [stage(blocks[0], FIRST), *[stage(b, MIDDLE) for b in blocks[1:-1]], stage(blocks[-1], LAST)]
        got = _split(p, sts, best[0] if best else floor)
        if got is not None:
            best = (got[0], blocks, got[1])
    if best is None:
        return None
    _, blocks, layers = best
    # Map type counts back to concrete node indices.
    pools = [list(g) for g in groups]
    assignment = []
    for block in blocks:
        members = []
        for g, n in enumerate(block):
            members.extend(pools[g][:n])
            del pools[g][:n]
        assignment.append(sorted(members))
    placement = evaluate(p, assignment, layers)
    assert placement is not None, "exact search produced a placement that fails verification"
    return placement
