"""Bounds for the allocation ILP stronger than its LP relaxation's: the Lagrangian relaxation of the
availability rows, where each (model, phase) keeps its demand row as an integer knapsack cover.

Why it helps: the LP may cover a group's demand with 1.3 instances of its best template; any plan
needs whole instances, so each group's cover is rounded up before the groups share the nodes.

For multipliers `λ_rc ≥ 0` on the availability rows `Σ_j U_rc(j)·ν_j ≤ A_rc`, every plan `ν` that
fits the availability has `Σ_j w_j·ν_j ≤ λ·A` with `w_j = Σ_rc λ_rc·U_rc(j)`, so

* cost mode (minimize `c·ν` s.t. demand rows `Σ_{j∈g} Θ_j·ν_j ≥ α·D_g`):
  `cost ≥ Σ_g K_g − λ·A`, `K_g = min{Σ_{j∈g} (c_j + w_j)·ν_j : Σ_{j∈g} Θ_j·ν_j ≥ α·D_g,
  0 ≤ ν_j ≤ ub_j, ν integer}` (the start-up and stop terms of running columns are ≥ 0 and
  dropped, which keeps it a lower bound);
* goodput mode, α fixed: when `Σ_g min{Σ_{j∈g} w_j·ν_j : cover of α·D_g} > λ·A`, no plan serves
  `α` (every plan that serves it uses more than the availability in the λ-weighted sum).

`λ` comes from the LP relaxation (its availability duals, recovered from the reduced costs: the
adapter reports `d = c − Aᵀy`, and there are few rows, so `y` solves the normal equations of
`Aᵀy = c − d` over the `ν` columns); any `λ ≥ 0` gives a valid bound (the weights `w` are computed
from `λ` and the usage, never from `d`), so the recovery's accuracy only affects the bound's
strength. With those duals and the knapsacks solved as LPs the bound is the LP's, so it is never
weaker (`lagrangian_cost_bound` returns at least the LP bound). Each knapsack is solved exactly
(reduced-cost fixing against a greedy cover, then a depth-first branch and bound on the columns
left); one that runs out of nodes counts with its LP value, a valid bound.
"""
from __future__ import annotations

import math
import time

import numpy as np

from coral.allocator.inputs import Columns
from coral.solver import CsrMatrix, MilpModel, SolveOptions, SolveResult, Status, solve

KNAPSACK_NODES = 20_000  # the most branch-and-bound nodes one group's knapsack may take (then its LP value counts)
DW_ROUNDS = 60  # the most column-generation rounds of `alpha_out_of_reach`
DW_TEST_S = 0.4  # the most one α test of `column_generation_alpha_bound` may take


def availability_duals(cols: Columns, c: np.ndarray, lp: SolveResult, *, maximize: bool,
                       skip: np.ndarray | None = None, alpha_col: int | None = None) -> np.ndarray | None:
    """Multipliers `λ ≥ 0` per (region, config) for the availability rows (0 where unbounded), from
    the LP's reduced costs: the least-squares solution of `Σ_c U_c(j)·y_{r_j,c} + Θ_j·y_{g_j} =
    c_j − d_j` over the `ν` columns (`skip`: columns whose equation has other rows' duals too, the
    running ones). `alpha_col`: goodput mode's α column (objective 1, `−D_g` in each demand row),
    whose equation `−Σ_g D_g·y_g = 1 − d_α` pins the demand duals when the `ν` columns alone leave
    them free. Minimizing, a `≤` row's dual is ≤ 0 and `λ = −y`; maximizing, `λ = y`. None
    without reduced costs."""
    if lp.reduced_costs is None:
        return None
    R, C = cols.avail.shape
    G = len(cols.groups)
    n = cols.num_cols
    rhs_all = np.asarray(c[:n], dtype=float) - np.asarray(lp.reduced_costs[:n], dtype=float)
    rows = np.arange(n) if skip is None else np.flatnonzero(~skip)
    k = R * C + G
    gram = np.zeros((k, k))  # the normal equations BᵀB y = Bᵀ(c − d), block by block (B is sparse)
    target = np.zeros(k)
    theta = cols.col_theta()[rows]
    grp = cols.group[cols.col_t[rows]]
    rhs = rhs_all[rows]
    use = cols.usage[cols.col_t[rows]].astype(float)
    reg = cols.col_r[rows]
    for r in range(R):
        m = reg == r
        if not m.any():
            continue
        u = use[m]
        by_g = np.zeros((u.shape[0], G))
        by_g[np.arange(u.shape[0]), grp[m]] = theta[m]
        blk = slice(r * C, (r + 1) * C)
        gram[blk, blk] = u.T @ u
        gram[blk, R * C:] = u.T @ by_g
        gram[R * C:, blk] = gram[blk, R * C:].T
        target[blk] = u.T @ rhs[m]
    gram[R * C:, R * C:] = np.diag(np.bincount(grp, weights=theta * theta, minlength=G))
    target[R * C:] = np.bincount(grp, weights=theta * rhs, minlength=G)
    if alpha_col is not None:
        a = -np.asarray(cols.demand, dtype=float)
        gram[R * C:, R * C:] += np.outer(a, a)
        target[R * C:] += a * (1.0 - float(lp.reduced_costs[alpha_col]))
    y, *_ = np.linalg.lstsq(gram, target, rcond=None)
    lam = (y[:R * C] if maximize else -y[:R * C]).reshape(R, C)
    lam = np.where(np.isfinite(cols.avail), np.maximum(lam, 0.0), 0.0)
    return lam


def _weights(cols: Columns, lam: np.ndarray) -> tuple[np.ndarray, float]:
    """`w_j = Σ_c λ_{r_j,c}·U_c(j)` per column, and `λ·A` over the finite availability."""
    w = np.einsum("jc,jc->j", cols.usage[cols.col_t].astype(float), lam[cols.col_r])
    finite = np.isfinite(cols.avail)
    return w, float(np.sum(lam[finite] * cols.avail[finite]))


def _by_group(cols: Columns) -> list[np.ndarray]:
    grp = cols.group[cols.col_t]
    order = np.argsort(grp, kind="stable")
    starts = np.searchsorted(grp[order], np.arange(len(cols.groups) + 1))
    return [order[starts[g]:starts[g + 1]] for g in range(len(cols.groups))]


def lagrangian_cost_bound(cols: Columns, c: np.ndarray, ub: np.ndarray, alpha: float, lp: SolveResult, *,
                          skip: np.ndarray | None = None, floor_lp: bool = True,
                          limit_s: float = math.inf) -> tuple[float, np.ndarray] | None:
    """A lower bound on the cost ILP's optimum at `alpha` (module docstring), at least the LP's.

    Args:
        cols: the model's columns.
        c: the objective per `ν` column (`ilp.formulate`'s `c[:n]`: price plus start-up penalty, the
            price alone for running columns, whose start-up and stop terms are ≥ 0 and dropped).
        ub: the upper bound per `ν` column.
        alpha: the demand fraction every group meets.
        lp: the model's LP relaxation, solved to optimality (with reduced costs); or, with
            `floor_lp` False, the LP of another model of the same columns (its duals are multipliers
            like any other, its objective bounds nothing here).
        skip: columns left out of the dual recovery (the running ones).
        floor_lp: whether `lp` is this model's LP, whose objective the bound is raised to.
        limit_s: past this many seconds, the groups left count with their knapsack's LP value
            (valid, and no stronger than the LP's share).

    Returns:
        (the bound, `inf` when some group cannot be covered at all; the groups' cheapest covers at
        those prices, instances per column: where the bound would have the plan be), or None
        without reduced costs.
    """
    if lp.x is None or not math.isfinite(lp.objective):
        return None
    lam = availability_duals(cols, c, lp, maximize=False, skip=skip)
    if lam is None:
        return None
    w, cap = _weights(cols, lam)
    cost = np.asarray(c[:cols.num_cols], dtype=float) + w
    theta = cols.col_theta()
    total = -cap
    covers = np.zeros(cols.num_cols)
    deadline = time.perf_counter() + limit_s
    for g, idx in enumerate(_by_group(cols)):
        nodes = KNAPSACK_NODES if time.perf_counter() < deadline else 0
        bound, x = cover(cost[idx], theta[idx], ub[idx], alpha * float(cols.demand[g]), max_nodes=nodes)
        total += bound
        if x is not None:
            covers[idx] = x
    return (max(total, float(lp.objective)) if floor_lp else total), covers


def lagrangian_alpha_bound(cols: Columns, ub: np.ndarray, lp: SolveResult, lo: float, hi: float, *, tol: float,
                           limit_s: float) -> tuple[float, int]:
    """The least `α ∈ (lo, hi]` the Lagrangian relaxation at the max-α LP's availability duals
    proves no plan serves, by bisection to `tol` (relative), or `hi` when it proves none.

    `lp` is the max-α LP (`ν` columns first, then α, objective 1 on α: no running columns); `lo`
    an α some plan serves, `hi` a proven bound. The test at `α` is `Σ_g min{w·ν : cover of α·D_g}
    > λ·A` (the knapsacks' minimum only grows with α, so bisection finds where it starts to hold;
    each test that holds is a proof on its own, so the time limit, which turns late knapsacks into
    their LP values, only weakens the bound). Returns (the bound, how many α it tested)."""
    n = cols.num_cols
    lam = availability_duals(cols, np.zeros(n), lp, maximize=True, alpha_col=n)
    if lam is None or not lam.any() or not hi > lo > 0:
        return hi, 0
    w, cap = _weights(cols, lam)
    theta = cols.col_theta()
    groups = _by_group(cols)

    deadline = time.perf_counter() + limit_s

    def infeasible(a: float) -> bool:
        total = 0.0
        for g, idx in enumerate(groups):
            nodes = KNAPSACK_NODES if time.perf_counter() < deadline else 0  # late: the LP values (still valid)
            total += cover_min(w[idx], theta[idx], ub[idx], a * float(cols.demand[g]), max_nodes=nodes)
            if total > cap * (1 + 1e-9) + 1e-12:
                return True
        return False

    tests = 0
    while (hi - lo) / lo > tol and time.perf_counter() < deadline:
        mid = (lo + hi) / 2
        tests += 1
        if infeasible(mid):
            hi = mid
        else:
            lo = mid
    return hi, tests


def cover_min(w: np.ndarray, theta: np.ndarray, ub: np.ndarray, need: float, *,
              max_nodes: int = KNAPSACK_NODES) -> float:
    """A lower bound on `min{w·ν : θ·ν ≥ need, 0 ≤ ν ≤ ub, ν integer}`, exact unless the search
    runs out of nodes (`w ≥ 0`, `θ > 0`); `inf` when every column at its bound does not cover `need`.
    `cover` also returns the best cover found."""
    return cover(w, theta, ub, need, max_nodes=max_nodes)[0]


def cover(w: np.ndarray, theta: np.ndarray, ub: np.ndarray, need: float, *,
          max_nodes: int = KNAPSACK_NODES) -> tuple[float, np.ndarray | None]:
    """`cover_min`'s bound and the cheapest integer cover it found (None when there is none).

    The LP relaxation is the greedy fill by `w/θ` (critical ratio `ρ`); a greedy integer cover gives
    an upper bound `UB`. A column whose reduced cost `w_j − ρθ_j` exceeds `UB − LP` is 0 in every
    cover cheaper than `UB`, and one whose reduced cost is below `LP − UB` sits at its bound in
    every such cover; a depth-first branch and bound over the others (in `w/θ` order, LP bounds
    from prefix sums) finds the optimum. Out of nodes, the LP value counts (a valid bound)."""
    w = np.maximum(np.asarray(w, dtype=float), 0.0)
    theta = np.asarray(theta, dtype=float)
    if need <= 0:
        return 0.0, np.zeros(w.size)
    # a cover with more than ⌈need/θ_j⌉ of column j stays one without an instance of it (w ≥ 0)
    ub = np.minimum(np.asarray(ub, dtype=float), np.ceil(need / theta - 1e-12))
    if float(theta @ ub) < need * (1 - 1e-12):
        return math.inf, None
    lp, inc, red, x_inc = _cover_lp(w, theta, ub, need)
    if inc - lp <= 1e-9 * max(abs(lp), 1.0):
        return inc, x_inc
    slack = inc - lp + 1e-9 * max(abs(inc), 1.0)
    at_ub = red < -slack
    free = np.flatnonzero((red <= slack) & ~at_ub)
    fixed_cost = float(w[at_ub] @ ub[at_ub])
    left = need - float(theta[at_ub] @ ub[at_ub])
    if left <= 0:
        x = np.where(at_ub, ub, 0.0)
        return max(min(fixed_cost, inc), lp), (x if fixed_cost < inc else x_inc)
    if free.size == 0 or float(theta[free] @ ub[free]) < left * (1 - 1e-12):
        return inc, x_inc  # nothing cheaper than the greedy cover exists
    found = _branch_and_bound(w[free], theta[free], ub[free], left, inc - fixed_cost, max_nodes)
    if found is None:
        return lp, x_inc
    best, x_free = found
    if x_free is None:  # nothing beat the greedy cover
        return max(inc, lp), x_inc
    x = np.where(at_ub, ub, 0.0)
    x[free] = x_free
    return max(min(fixed_cost + best, inc), lp), x


def _cover_lp(w: np.ndarray, theta: np.ndarray, ub: np.ndarray,
              need: float) -> tuple[float, float, np.ndarray, np.ndarray]:
    """The knapsack cover's LP value, a greedy integer cover's cost, the LP reduced costs and that cover."""
    order = np.argsort(w / theta, kind="stable")
    cover = np.cumsum((theta * ub)[order])
    k = min(int(np.searchsorted(cover, need * (1 - 1e-12))), order.size - 1)  # the fill ends in column k
    full = order[:k]
    crit = int(order[k])
    rest = need - (float(cover[k - 1]) if k > 0 else 0.0)
    base = float(w[full] @ ub[full])
    lp = base + w[crit] * rest / theta[crit]
    x = np.zeros(w.size)
    x[full] = ub[full]
    inc, left = base, rest
    for j in order[k:]:
        take = min(ub[j], math.ceil(left / theta[j] - 1e-9))
        x[j] = take
        inc += w[j] * take
        left -= theta[j] * take
        if left <= 1e-12 * need:
            break
    return lp, inc, w - (w[crit] / theta[crit]) * theta, x


def _branch_and_bound(w: np.ndarray, theta: np.ndarray, ub: np.ndarray, need: float, best: float,
                      max_nodes: int) -> tuple[float, np.ndarray | None] | None:
    """The least `w·ν` over integer covers of `need` below `best` and that cover (or `best`, None
    when none is cheaper); None out of nodes."""
    order = np.argsort(w / theta, kind="stable")
    wl, tl, ul = w[order].tolist(), theta[order].tolist(), ub[order].tolist()
    m = len(wl)
    cap = [0.0] * (m + 1)  # prefix sums of θ·ub and w·ub, for the LP bound of a suffix
    cost = [0.0] * (m + 1)
    for i in range(m):
        cap[i + 1] = cap[i] + tl[i] * ul[i]
        cost[i + 1] = cost[i] + wl[i] * ul[i]

    def lp_from(i: int, left: float) -> float:
        # the greedy fill of columns i.. (ratio order): whole columns before k, then part of k
        lo_, hi_ = i, m
        target = cap[i] + left
        while lo_ < hi_:
            mid = (lo_ + hi_) // 2
            if cap[mid + 1] >= target:
                hi_ = mid
            else:
                lo_ = mid + 1
        if lo_ >= m:
            return math.inf
        return cost[lo_] - cost[i] + wl[lo_] * (target - cap[lo_]) / tl[lo_]

    tol = 1e-9 * max(abs(best), 1.0)
    nodes = 0
    best_path: tuple | None = None
    stack: list[tuple[int, float, float, tuple | None]] = [(0, need, 0.0, None)]
    while stack:
        i, left, spent, path = stack.pop()
        if left <= 1e-12 * need:
            if spent < best - tol:
                best, best_path = spent, path
            continue
        if i >= m or spent + lp_from(i, left) >= best - tol:
            continue
        nodes += 1
        if nodes > max_nodes:
            return None
        most = int(min(ul[i], math.ceil(left / tl[i] - 1e-9)))
        for k in range(most + 1):  # pushed low to high: the most instances are tried first
            stack.append((i + 1, left - k * tl[i], spent + k * wl[i], (path, i, k) if k else path))
    if best_path is None:
        return best, None
    x = np.zeros(m)
    node = best_path
    while node is not None:
        node, i, k = node
        x[order[i]] = k
    return best, x


def alpha_out_of_reach(cols: Columns, ub: np.ndarray, lp: SolveResult, alpha: float, *, limit_s: float,
                       max_rounds: int = DW_ROUNDS) -> bool | None:
    """Whether no plan serves `alpha` of every demand, by the Lagrangian test of
    `lagrangian_alpha_bound` at the best multipliers column generation finds (Dantzig–Wolfe over
    the same knapsacks), starting from the max-α LP `lp`'s availability duals.

    The master LP picks, per (model, phase), a convex combination of its integer covers of
    `alpha·D_g` found so far, using at most `t`× the availability: `min t` s.t. `Σ_p z_gp = 1` per
    group, `Σ_{g,p} U(p)·z_gp ≤ t·A`. Its availability duals `λ` price the next covers; the test
    `Σ_g K_g(λ) > λ·A` is checked at every round's `λ`, and each time it holds it is a proof on
    its own (valid for any `λ ≥ 0`), whether or not the generation has converged. Returns True
    with a proof; False when no cover prices below its group's convexity dual (converged: `alpha`
    is within the knapsacks' reach); None after `max_rounds` or at `limit_s` (undecided)."""
    n = cols.num_cols
    deadline = time.perf_counter() + limit_s
    lam = availability_duals(cols, np.zeros(n), lp, maximize=True, alpha_col=n)
    if lam is None:
        return None
    finite = np.isfinite(cols.avail) & (cols.avail > 0)
    rows_rc = np.flatnonzero(finite.reshape(-1))
    cap = cols.avail.reshape(-1)[rows_rc]
    G = len(cols.groups)
    theta = cols.col_theta()
    groups = _by_group(cols)
    use = cols.usage[cols.col_t].astype(float)
    R, C = cols.avail.shape
    patterns: list[tuple[int, np.ndarray]] = []  # (group, usage over the availability rows)
    mu = np.zeros(G)  # the convexity duals (before the first master every cover is new)
    for rnd in range(max_rounds):
        w, lam_cap = _weights(cols, lam)
        total, added = 0.0, 0
        for g, idx in enumerate(groups):
            bound, x = cover(w[idx], theta[idx], ub[idx], alpha * float(cols.demand[g]))
            total += bound
            if x is not None and (rnd == 0 or bound < mu[g] - 1e-9 * max(abs(mu[g]), 1.0)):
                u = np.zeros((R, C))
                np.add.at(u, cols.col_r[idx], use[idx] * x[:, None])
                patterns.append((g, u.reshape(-1)[rows_rc]))
                added += 1
        if total > lam_cap * (1 + 1e-9) + 1e-12:
            return True
        if added == 0:
            return False
        if time.perf_counter() > deadline:
            return None
        duals = _master_duals(patterns, G, cap)
        if duals is None:
            return None
        mu, lam_rows = duals
        lam = np.zeros(R * C)
        lam[rows_rc] = lam_rows
        lam = lam.reshape(R, C)
    return None


def _master_duals(patterns: list[tuple[int, np.ndarray]], G: int,
                  cap: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The Dantzig–Wolfe master's duals (convexity `μ_g`, availability `λ ≥ 0`), or None.

    Each row gets a column fixed at 0 with a 1 in that row: it changes nothing, and its reduced
    cost `0 − y_i` is the row's dual (the adapter reports reduced costs, not row duals)."""
    P, m = len(patterns), cap.shape[0]
    rows, cols_, vals = [], [], []
    for p, (g, u) in enumerate(patterns):
        nz = np.flatnonzero(u)
        rows += [np.array([g]), G + nz]
        cols_ += [np.array([p]), np.full(nz.size, p)]
        vals += [np.ones(1), u[nz]]
    rows += [G + np.arange(m), np.arange(G + m)]  # t, then the probe columns
    cols_ += [np.full(m, P), P + 1 + np.arange(G + m)]
    vals += [-cap, np.ones(G + m)]
    num = P + 1 + G + m
    A = CsrMatrix.from_coo(np.concatenate(vals), np.concatenate(rows), np.concatenate(cols_), shape=(G + m, num))
    c = np.zeros(num)
    c[P] = 1.0
    upper = np.full(num, np.inf)
    upper[P + 1:] = 0.0
    model = MilpModel(c=c, A=A, row_lower=np.concatenate([np.ones(G), np.full(m, -np.inf)]),
                      row_upper=np.concatenate([np.ones(G), np.zeros(m)]), col_lower=np.zeros(num), col_upper=upper,
                      integrality=np.zeros(num, dtype=bool))
    res = solve(model, SolveOptions(backend="highs", time_limit_s=5.0))
    if res.status is not Status.OPTIMAL or res.reduced_costs is None:
        return None
    y = -np.asarray(res.reduced_costs[P + 1:], dtype=float)
    return y[:G], np.maximum(-y[G:], 0.0)  # minimizing: a ≤ row's dual is ≤ 0


def column_generation_alpha_bound(cols: Columns, ub: np.ndarray, lp: SolveResult, target: float, hi: float, *,
                                  tol: float, limit_s: float) -> tuple[float, int]:
    """The least α `alpha_out_of_reach` proves, tried at `target` first (the α that would close the
    caller's gap), then by bisection up to the proven bound `hi` (relative `tol`), within `limit_s`,
    each test within `DW_TEST_S`; an undecided test ends the search (column generation that does
    not converge in that time, as on the real `extended` scarce case, would not in the next).
    Returns (the bound, `hi` when nothing was proved below it; how many α it tested)."""
    deadline = time.perf_counter() + limit_s
    lo, a, tests = target, target, 0
    while time.perf_counter() < deadline and a < hi:
        tests += 1
        out = alpha_out_of_reach(cols, ub, lp, a, limit_s=min(deadline - time.perf_counter(), DW_TEST_S))
        if out is None:
            break
        if out:
            hi = a
            if a == target:
                break
        else:
            lo = a
        if (hi - lo) / lo <= tol:
            break
        a = (lo + hi) / 2
    return hi, tests
