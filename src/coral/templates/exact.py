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
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from coral.templates import kernel
from coral.templates.multisets import Counts, stage_lists
from coral.templates.problem import Placement, PlacementProblem, evaluate, position


class _Stage:
    """A stage in a problem: its curves and its memory cap."""

    __slots__ = ("members", "cap", "rate", "lat", "inc", "neg_rate", "work")

    def __init__(self, members: list[int], cap: int, curves: _Slot) -> None:
        self.members = members
        self.cap = cap
        self.rate, self.lat, self.inc = curves.rate, curves.lat, curves.inc
        self.neg_rate, self.work = curves.neg_rate, curves.work

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


CurveCache = dict[tuple[object, ...], "_Slot"]
_CACHE_LIMIT = 200_000
_RUNS = 12  # increments of T_s(j) form <= 2·(node types) runs; padded to this width


class _Slot:
    """A block of nodes at one position class: rates, latencies and latency-increment runs."""

    __slots__ = ("rate", "lat", "inc", "neg_rate", "work", "run_val", "run_start", "run_len")

    def __init__(self, u: float, ts: list[float], os_: list[float], js: np.ndarray) -> None:
        taus = np.array([js * t + o for t, o in zip(ts, os_, strict=True)])
        self.rate = (u / taus).sum(axis=0)  # R_s(j), decreasing in j
        self.lat = taus.max(axis=0)  # T_s(j), convex piecewise linear in j
        self.inc = np.diff(self.lat)  # T_s(j+1) - T_s(j), non-decreasing
        self.neg_rate = (-self.rate).tolist()  # increasing: for bisect
        self.work = sum(u / t for t in ts)  # Σ u/t_k: R_s(j) ≤ work / j
        # Run-length encode the increments (constant while one node is the slowest).
        val = np.zeros(_RUNS)  # padding runs have length 0: they never count
        start = np.zeros(_RUNS)
        length = np.zeros(_RUNS)
        if self.inc.size:
            # Increments equal up to rounding (1e-9 relative) form one run valued at its largest
            # member, so the run-based latency is never below the true one.
            step = np.abs(np.diff(self.inc))
            cut = np.flatnonzero(step > 1e-9 * np.abs(self.inc[1:])) + 1
            bounds = np.concatenate([[0], cut, [self.inc.size]])
            if bounds.size - 1 > _RUNS:  # never for <= 6 nodes; fall back to exact per-increment runs
                raise ValueError("too many latency-increment runs")
            for r, (a, b) in enumerate(itertools.pairwise(bounds)):
                val[r], start[r], length[r] = self.inc[a:b].max(), a, b - a
        self.run_val, self.run_start, self.run_len = val, start, length


@functools.lru_cache(maxsize=4096)
def _list_structure(counts: Counts, stages: int) -> tuple[tuple[tuple[Counts, int], ...], np.ndarray, np.ndarray]:
    """Stage lists as slot indices: the distinct (block, position) slots, and per list and
    stage the index of its slot (plus each list's slot keys in pipeline order)."""
    lists = stage_lists(counts, stages)
    slots: dict[tuple[Counts, int], int] = {}
    idx = np.empty((len(lists), stages), dtype=np.int64)
    poss = [position(c, stages) for c in range(stages)]
    for i, lst in enumerate(lists):
        for c, block in enumerate(lst):
            idx[i, c] = slots.setdefault((block, poss[c]), len(slots))
    return tuple(slots), idx, np.arange(len(slots))


def solve_exact(problem: PlacementProblem, floor: float = 0.0, cache: CurveCache | None = None,
                local: dict[tuple[object, ...], tuple[_Slot, list[int]]] | None = None) -> Placement | None:
    """The throughput-optimal placement of `problem` (fixed S and b) above `floor`, or None.

    Uses the compiled search (`coral.templates.kernel`) when numba is available, otherwise
    the numpy one (`solve_exact_numpy`); both give the same optimum and tie-break alike.
    """
    if kernel.enabled():
        return solve_exact_jit(problem, floor)
    return solve_exact_numpy(problem, floor, cache, local)


def _node_types(p: PlacementProblem) -> list[list[int]]:
    """Nodes grouped by what the problem says of them (identical nodes are interchangeable)."""
    types: dict[tuple[float, tuple[float, ...], tuple[int, ...]], list[int]] = {}
    for k in range(len(p.nodes)):
        types.setdefault((p.t[k], p.o[k], p.cap[k]), []).append(k)
    return list(types.values())


def assign_blocks(groups: list[list[int]], blocks: list[Counts]) -> list[list[int]]:
    """Concrete node indices per stage for a stage list given as type counts."""
    pools = [list(g) for g in groups]
    assignment = []
    for block in blocks:
        members = []
        for g, n in enumerate(block):
            members.extend(pools[g][:n])
            del pools[g][:n]
        assignment.append(sorted(members))
    return assignment


def solve_exact_jit(problem: PlacementProblem, floor: float = 0.0) -> Placement | None:
    """`solve_exact` through the compiled search (needs numba)."""
    p = problem
    budget = p.budget_s * (1 + 1e-9) - (p.stages - 1) * p.comm_s
    if budget < 0:
        return None
    groups = _node_types(p)
    counts = tuple(len(g) for g in groups)
    blocks, rows_all, row_off, keys = kernel.structure(counts, len(p.nodes))
    rows = rows_all[row_off[p.stages]:row_off[p.stages + 1], :p.stages]
    t = np.array([p.t[g[0]] for g in groups], dtype=float)
    o = np.array([p.o[g[0]] for g in groups], dtype=float)
    cap = np.array([p.cap[g[0]] for g in groups], dtype=np.int64)
    js = np.zeros(p.stages, dtype=np.int64)
    _, row = kernel.solve_depth(p.num_layers, p.stages, budget, float(p.u), t, o, cap, blocks, rows, float(floor), js)
    if row < 0:
        return None
    assignment = assign_blocks(groups, [keys[i] for i in rows[row].tolist()])
    placement = evaluate(p, assignment, js.tolist())
    assert placement is not None, "exact search produced a placement that fails verification"
    return placement


def _gather_slots(p: PlacementProblem, groups: list[list[int]], slot_keys: Sequence[tuple[Counts, int]],
                  js: np.ndarray, cache: CurveCache | None,
                  local: dict[tuple[object, ...], tuple[_Slot, list[int]]] | None,
                  ) -> tuple[list[_Slot], list[list[int]], np.ndarray]:
    """Per (block, position) slot of `solve_exact_numpy`: its curve (from `local`, then `cache`, else built),
    its member nodes and its layer cap."""
    curves = cache if cache is not None else {}
    if len(curves) > _CACHE_LIMIT:
        curves.clear()
    near = local if local is not None else {}
    gsig = tuple((p.nodes[g[0]], p.t[g[0]], p.o[g[0]], len(g)) for g in groups)  # what a block means
    slots: list[_Slot] = []
    members_of: list[list[int]] = []
    caps = np.empty(len(slot_keys), dtype=np.int64)
    for i, (block, pos) in enumerate(slot_keys):
        hit = near.get((gsig, block, pos))
        if hit is None:
            members = [g[0] for g, n in zip(groups, block, strict=True) for _ in range(n)]
            ts = [p.t[k] for k in members]
            os_ = [p.o[k][pos] for k in members]
            ckey = (p.u, p.num_layers, *sorted(zip(ts, os_, strict=True)))
            slot = curves.get(ckey)
            if slot is None:
                slot = curves[ckey] = _Slot(p.u, ts, os_, js)
            hit = near[(gsig, block, pos)] = (slot, members)
        slots.append(hit[0])
        members_of.append(hit[1])
        caps[i] = min(p.cap[k][pos] for k in hit[1])
    return slots, members_of, caps


def _last_feasible(cands: np.ndarray, alive: np.ndarray,
                   feasible: Callable[[float, np.ndarray], np.ndarray]) -> tuple[float, np.ndarray]:
    """Bisection over the sorted breakpoints `cands`: the largest with a feasible stage list, and those lists."""
    lo, hi = 0, cands.size - 1  # every alive list's optimum is a breakpoint >= cands[0]
    alive = feasible(float(cands[0]), alive)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        got = feasible(float(cands[mid]), alive)
        if got.size:
            lo, alive = mid, got
        else:
            hi = mid - 1
    theta = float(cands[lo])
    return theta, alive


def solve_exact_numpy(problem: PlacementProblem, floor: float = 0.0, cache: CurveCache | None = None,
                      local: dict[tuple[object, ...], tuple[_Slot, list[int]]] | None = None) -> Placement | None:
    """The throughput-optimal placement of `problem` (fixed S and b), or None if infeasible.

    All stage lists are checked at once (numpy): for a target Θ, each slot's `U_s(Θ)`; a list is
    feasible iff every `U_s ≥ 1`, `Σ U_s ≥ L` and its minimum latency fits, where the minimum
    latency is `Σ_s T_s(1)` plus the `L − S` cheapest increments among the stages' first
    `U_s − 1` increments (runs of equal increments, taken cheapest first). Bisection over the
    throughput breakpoints keeps the lists still feasible.

    Args:
        problem: the placement problem.
        floor: only placements with throughput strictly above `floor` are of interest; None is
            returned when there is none (the library passes the best throughput already found).
        cache: slot curves keyed by their nodes' numbers, shared across calls (the library
            passes one per (model, phase): the same blocks recur across depths and multisets).
        local: slot curves keyed by (block, position), valid for one node multiset and one
            micro-batch across pipeline depths (the library passes one per (multiset, b)).

    Returns:
        The optimal placement (its throughput is optimal; among equal throughputs the first
        stage list in enumeration order wins), or None.
    """
    p = problem
    groups = _node_types(p)
    counts = tuple(len(g) for g in groups)
    slot_keys, slot_idx, _ = _list_structure(counts, p.stages)
    # 1e-9 relative slack absorbs the rounding of the run-based latency (see _Slot).
    budget = p.budget_s * (1 + 1e-9) - (p.stages - 1) * p.comm_s
    if budget < 0:
        return None
    js = np.arange(1, p.num_layers + 1, dtype=float)
    slots, members_of, caps = _gather_slots(p, groups, slot_keys, js, cache, local)
    lat0 = np.array([sl.lat[0] for sl in slots])
    run_val = np.array([sl.run_val for sl in slots])
    run_start = np.array([sl.run_start for sl in slots])
    run_len = np.array([sl.run_len for sl in slots])
    base = lat0[slot_idx].sum(axis=1)
    extra = p.num_layers - p.stages
    L = p.num_layers

    def uppers(theta: float) -> np.ndarray:
        return np.minimum([bisect.bisect_right(sl.neg_rate, -theta) for sl in slots], caps)

    def feasible(theta: float, rows: np.ndarray) -> np.ndarray:
        """The subset of `rows` (stage-list indices) feasible at Θ."""
        u = uppers(theta)[slot_idx[rows]]  # [rows, S]
        ok = (u.min(axis=1) >= 1) & (u.sum(axis=1) >= L)
        rows, u = rows[ok], u[ok]
        if rows.size == 0 or extra == 0:
            return rows[base[rows] <= budget]
        sl = slot_idx[rows]
        take = np.clip(u[:, :, None] - 1 - run_start[sl], 0, run_len[sl]).reshape(rows.size, -1)
        val = run_val[sl].reshape(rows.size, -1)
        order = np.argsort(val, axis=1, kind="stable")
        val = np.take_along_axis(val, order, axis=1)
        take = np.take_along_axis(take, order, axis=1)
        before = np.cumsum(take, axis=1) - take  # increments taken by cheaper runs
        use = np.clip(extra - before, 0, take)
        total = base[rows] + (use * val).sum(axis=1)
        return rows[total <= budget]

    alive = feasible(float(np.nextafter(floor, np.inf)), np.arange(len(slot_idx)))
    if alive.size == 0:
        return None
    cands = np.unique(np.concatenate([sl.rate[: max(int(c), 0)] for sl, c in zip(slots, caps, strict=True)]))
    cands = cands[cands > floor]
    theta, alive = _last_feasible(cands, alive, feasible)
    row = int(alive.min())
    u = uppers(theta)[slot_idx[row]].tolist()
    stages = [_Stage(members_of[i], int(caps[i]), slots[i]) for i in slot_idx[row].tolist()]
    split = _min_latency(stages, u, L)
    assert split is not None
    assignment = assign_blocks(groups, [slot_keys[i][0] for i in slot_idx[row].tolist()])
    placement = evaluate(p, assignment, split[1])
    assert placement is not None, "exact search produced a placement that fails verification"
    return placement
