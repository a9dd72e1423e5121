"""The exact search compiled with numba: one call solves a node multiset over every depth and
micro-batch (DESIGN §3). Same answers as `coral.templates.exact` (tests hold them to each other,
to the ILP and to brute force), 10–30× faster, which is what lets the `extended` library build
in minutes instead of an hour.

How one `(S, b)` problem is solved. The stage lists of the multiset (from `multisets.stage_lists`) are
read in enumeration order, keeping the best throughput Θ found so far. Each stage is a *slot*:
a block of nodes (a sub-multiset, by node type) at a position class. A list beats Θ iff it is
feasible just above Θ: every stage's `U_s = max{j ≤ cap_s : R_s(j) ≥ Θ}` is ≥ 1, `Σ U_s ≥ L`,
and the minimum latency over splits `1 ≤ j_s ≤ U_s`, `Σ j_s = L` fits the budget (stage
latency is a max of lines, so convex in `j`: the minimum is greedy on increments). `U_s` is a
binary search on `R_s(j) = Σ_k u/(j·t_k + o_k)`, evaluated on demand and cached per slot for
the current Θ. For a list that beats Θ, its own optimum (a breakpoint `R_s(j)`: feasibility
only changes there and is monotone in Θ) is bracketed by bisection on Θ until few breakpoints
remain between the brackets, which are then tried from the top. Ties keep the first list, as
the numpy search does.

Numba is a dependency of the package; when it cannot be imported (or `CORAL_NO_JIT=1`), the
callers use the numpy search instead.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from coral.templates.multisets import stage_lists, sub_multisets

try:  # pragma: no cover - exercised by the environment, not by a test
    import numba  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover
    numba = None  # type: ignore[assignment]

HAVE_JIT = numba is not None


def enabled() -> bool:
    """Whether the compiled search is used (numba importable and `CORAL_NO_JIT` not set)."""
    return HAVE_JIT and os.environ.get("CORAL_NO_JIT", "") in ("", "0")


def _jit(fn: Callable[..., Any]) -> Any:
    if numba is None:  # pragma: no cover
        return fn
    return numba.njit(cache=True, nogil=True)(fn)


@_jit
def _pos(c: int, stages: int) -> int:
    """Position class of stage `c` (FIRST 0, MIDDLE 1, LAST 2, ONLY 3; see problem.position)."""
    if stages == 1:
        return 3
    if c == 0:
        return 0
    if c == stages - 1:
        return 2
    return 1


@_jit
def _rate(block: np.ndarray, p: int, j: int, u: float, t: np.ndarray, o: np.ndarray) -> float:
    """`R_s(j)`: the stage's tokens/s with `j` layers, summed node by node."""
    acc = 0.0
    for k in range(t.shape[0]):
        tau = j * t[k] + o[k, p]
        for _ in range(block[k]):
            acc += u / tau
    return acc


@_jit
def _lat(block: np.ndarray, p: int, j: int, t: np.ndarray, o: np.ndarray) -> float:
    """`T_s(j)`: the slowest node's time with `j` layers."""
    best = -1.0
    for k in range(t.shape[0]):
        if block[k] > 0:
            tau = j * t[k] + o[k, p]
            if tau > best:
                best = tau
    return best


@_jit
def _upper(block: np.ndarray, p: int, theta: float, capj: int, u: float, t: np.ndarray, o: np.ndarray) -> int:
    """`U_s(Θ)`: most layers (≤ capj) whose rate is still ≥ Θ (the rate decreases in j)."""
    lo, hi = 0, capj
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _rate(block, p, mid, u, t, o) >= theta:
            lo = mid
        else:
            hi = mid - 1
    return lo


@_jit
def _fits(row: np.ndarray, stages: int, uu: np.ndarray, layers: int, budget: float, t: np.ndarray, o: np.ndarray,
          blocks: np.ndarray, js: np.ndarray, inc: np.ndarray) -> bool:
    """Whether some split with `1 ≤ j_s ≤ uu_s`, `Σ j_s = layers` fits `budget`; leaves the
    minimum-latency split in `js` (greedy: the cheapest latency increment first)."""
    total_u = 0
    for c in range(stages):
        if uu[c] < 1:
            return False
        total_u += uu[c]
    if total_u < layers:
        return False
    running = 0.0
    for c in range(stages):
        b = blocks[row[c]]
        p = _pos(c, stages)
        js[c] = 1
        base = _lat(b, p, 1, t, o)
        running += base
        inc[c] = _lat(b, p, 2, t, o) - base if uu[c] > 1 else np.inf
    slack = budget + 1e-12 * abs(budget)
    for _ in range(layers - stages):
        best_c = 0
        for c in range(1, stages):
            if inc[c] < inc[best_c]:
                best_c = c
        running += inc[best_c]
        if running > slack:
            return False
        js[best_c] += 1
        if js[best_c] < uu[best_c]:
            b = blocks[row[best_c]]
            p = _pos(best_c, stages)
            inc[best_c] = _lat(b, p, js[best_c] + 1, t, o) - _lat(b, p, js[best_c], t, o)
        else:
            inc[best_c] = np.inf
    exact = 0.0
    for c in range(stages):
        exact += _lat(blocks[row[c]], _pos(c, stages), js[c], t, o)
    return exact <= budget


@_jit
def _uppers_at(row: np.ndarray, stages: int, theta: float, slot_cap: np.ndarray, u: float, t: np.ndarray,
               o: np.ndarray, blocks: np.ndarray, out: np.ndarray) -> None:
    for c in range(stages):
        p = _pos(c, stages)
        out[c] = _upper(blocks[row[c]], p, theta, slot_cap[row[c], p], u, t, o)


@_jit
def _row_optimum(row: np.ndarray, stages: int, probe: float, uu_probe: np.ndarray, layers: int, budget: float,
                 slot_cap: np.ndarray, u: float, t: np.ndarray, o: np.ndarray, blocks: np.ndarray,
                 js: np.ndarray, inc: np.ndarray) -> float:
    """The best throughput of one stage list that is feasible at `probe` (bracket, then try the
    few breakpoints left between the brackets from the top)."""
    hi = np.inf
    for c in range(stages):
        r1 = _rate(blocks[row[c]], _pos(c, stages), 1, u, t, o)
        if r1 < hi:
            hi = r1
    u_hi = np.empty(stages, dtype=np.int64)
    _uppers_at(row, stages, hi, slot_cap, u, t, o, blocks, u_hi)
    if _fits(row, stages, u_hi, layers, budget, t, o, blocks, js, inc):
        return hi
    lo = probe
    u_lo = uu_probe.copy()
    u_mid = np.empty(stages, dtype=np.int64)
    for _ in range(200):
        left = 0
        for c in range(stages):
            left += u_lo[c] - u_hi[c]
        if left <= 8:
            break
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        _uppers_at(row, stages, mid, slot_cap, u, t, o, blocks, u_mid)
        if _fits(row, stages, u_mid, layers, budget, t, o, blocks, js, inc):
            lo = mid
            u_lo[:] = u_mid
        else:
            hi = mid
            u_hi[:] = u_mid
    n = 0
    for c in range(stages):
        n += u_lo[c] - u_hi[c]
    cands = np.empty(n)
    n = 0
    for c in range(stages):
        p = _pos(c, stages)
        for j in range(u_hi[c] + 1, u_lo[c] + 1):
            cands[n] = _rate(blocks[row[c]], p, j, u, t, o)
            n += 1
    cands = np.sort(cands)[::-1]
    for theta in cands:
        _uppers_at(row, stages, theta, slot_cap, u, t, o, blocks, u_mid)
        if _fits(row, stages, u_mid, layers, budget, t, o, blocks, js, inc):
            return theta
    return lo  # unreachable: the lowest candidate has lo's layer caps


@_jit
def solve_depth(layers: int, stages: int, budget: float, u: float, t: np.ndarray, o: np.ndarray, cap: np.ndarray,
                blocks: np.ndarray, rows: np.ndarray, floor: float, js: np.ndarray) -> tuple[float, int]:
    """Best throughput above `floor` of one `(S, b)` problem over the stage lists `rows`
    (block ids per stage), and the index of the first list reaching it (-1: none); `js` gets its
    layer split. `t`, `o`, `cap` are per node type; `budget` already excludes the hops."""
    nb, kinds = blocks.shape
    slot_cap = np.empty((nb, 4), dtype=np.int64)
    for i in range(nb):
        for p in range(4):
            m = layers
            for k in range(kinds):
                if blocks[i, k] > 0 and cap[k, p] < m:
                    m = cap[k, p]
            slot_cap[i, p] = m
    cache = np.full((nb, 4), -1, dtype=np.int64)
    best, best_row = floor, -1
    probe = np.nextafter(best, np.inf)
    uu = np.empty(stages, dtype=np.int64)
    inc = np.empty(stages)
    for r in range(rows.shape[0]):
        row = rows[r]
        ok = True
        total = 0
        for c in range(stages):
            p = _pos(c, stages)
            v = cache[row[c], p]
            if v < 0:
                v = _upper(blocks[row[c]], p, probe, slot_cap[row[c], p], u, t, o)
                cache[row[c], p] = v
            if v < 1:
                ok = False
                break
            uu[c] = v
            total += v
        if not ok or total < layers:
            continue
        if not _fits(row, stages, uu, layers, budget, t, o, blocks, js, inc):
            continue
        best = _row_optimum(row, stages, probe, uu, layers, budget, slot_cap, u, t, o, blocks, js, inc)
        best_row = r
        probe = np.nextafter(best, np.inf)
        cache[:, :] = -1
    if best_row >= 0:
        row = rows[best_row]
        _uppers_at(row, stages, best, slot_cap, u, t, o, blocks, uu)
        _fits(row, stages, uu, layers, budget, t, o, blocks, js, inc)
    return best, best_row


@_jit
def solve_multiset(layers: int, slo_s: float, floor: float, cfg: np.ndarray, counts: np.ndarray,
                   batches: np.ndarray, work: np.ndarray, times: np.ndarray, extras: np.ndarray, caps: np.ndarray,
                   comm: np.ndarray, blocks: np.ndarray, rows_all: np.ndarray, row_off: np.ndarray,
                   js: np.ndarray) -> tuple[float, int, int, int]:
    """`library.solve_multiset` for the exact search, in one call: the best (Θ, S, batch index,
    stage-list index) over every depth and micro-batch, with the split in `js` (S = -1: none
    beats `floor`).

    `cfg`/`counts`: the multiset's node types (config ids) and multiplicities; `times[b, c]`,
    `extras[b, c, pos]`, `caps[b, S-1, c, pos]`: per-layer time, stage extras and layer caps by batch
    index; `comm[b]`: one hop with the multiset's slowest network; `rows_all[row_off[S]:
    row_off[S+1], :S]`: the stage lists of depth S as block ids into `blocks`."""
    kinds = cfg.shape[0]
    nbat = batches.shape[0]
    n_nodes = 0
    for k in range(kinds):
        n_nodes += counts[k]
    ub = np.zeros(nbat)
    t_min = np.full(nbat, np.inf)
    for i in range(nbat):
        acc = 0.0
        for k in range(kinds):
            tk = times[i, cfg[k]]
            for _ in range(counts[k]):
                acc += work[i] / tk
            if tk < t_min[i]:
                t_min[i] = tk
        ub[i] = acc / layers
    # Batches by bound, largest first (ties: the larger batch), so the bar rises early and the
    # rest can stop at the first batch whose bound is below it.
    order = np.arange(nbat)
    for i in range(nbat):
        for m in range(i + 1, nbat):
            a, b = order[i], order[m]
            if ub[b] > ub[a] or (ub[b] == ub[a] and batches[b] > batches[a]):
                order[i], order[m] = b, a
    best, best_s, best_b, best_r = floor, -1, -1, -1
    split = np.empty(js.shape[0], dtype=np.int64)
    node_caps = np.empty(n_nodes, dtype=np.int64)
    t = np.empty(kinds)
    o = np.empty((kinds, 4))
    cap = np.empty((kinds, 4), dtype=np.int64)
    for bi in order:
        if ub[bi] <= best:
            break
        for k in range(kinds):
            t[k] = times[bi, cfg[k]]
            for p in range(4):
                o[k, p] = extras[bi, cfg[k], p]
        for stages in range(min(n_nodes, layers), 0, -1):
            hop = comm[bi] if stages > 1 else 0.0
            if layers * t_min[bi] + (stages - 1) * hop > slo_s:
                continue
            n = 0
            for k in range(kinds):
                m = 0
                for p in range(4):
                    cap[k, p] = caps[bi, stages - 1, cfg[k], p]
                    if cap[k, p] > m:
                        m = cap[k, p]
                for _ in range(counts[k]):
                    node_caps[n] = m
                    n += 1
            if np.sort(node_caps)[::-1][:stages].sum() < layers:
                continue
            budget = slo_s * (1 + 1e-9) - (stages - 1) * hop
            if budget < 0:
                continue
            rows = rows_all[row_off[stages]:row_off[stages + 1], :stages]
            theta, r = solve_depth(layers, stages, budget, work[bi], t, o, cap, blocks, rows, best, split)
            if r >= 0 and theta > best:
                best, best_s, best_b, best_r = theta, stages, int(bi), r
                js[:stages] = split[:stages]
    return best, best_s, best_b, best_r


@functools.lru_cache(maxsize=512)
def structure(counts: tuple[int, ...], max_stages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[tuple[int, ...], ...]]:
    """The blocks (every non-empty sub-multiset of `counts`) and the stage lists of each depth
    `1..max_stages` as block ids: (blocks, rows_all, row_off, block tuples)."""
    keys = tuple(sub_multisets(counts))
    index = {b: i for i, b in enumerate(keys)}
    per_depth = [[[index[b] for b in lst] for lst in stage_lists(counts, s)] for s in range(1, max_stages + 1)]
    total = sum(len(x) for x in per_depth)
    rows_all = np.zeros((total, max(max_stages, 1)), dtype=np.int64)
    row_off = np.zeros(max_stages + 2, dtype=np.int64)
    n = 0
    for s, lists in enumerate(per_depth, start=1):
        row_off[s] = n
        for lst in lists:
            rows_all[n, :s] = lst
            n += 1
    row_off[max_stages + 1] = n
    return np.array(keys, dtype=np.int64).reshape(len(keys), len(counts)), rows_all, row_off, keys
