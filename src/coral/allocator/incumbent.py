"""Starting points for the allocation ILP in goodput mode: an integer plan that respects the
availability, built from the LP relaxation, so the solver starts with a good incumbent (and its
bound can be compared against one) instead of searching for a first feasible point."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from coral.allocator.inputs import Columns, group_capacity

_TOL = 1e-9


def _fits(cols: Columns, cand: np.ndarray, rem: np.ndarray) -> np.ndarray:
    """Most instances of each candidate column the remaining nodes allow."""
    u = cols.usage[cols.col_t[cand]]
    r = rem[cols.col_r[cand]]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(u > 0, r / np.where(u > 0, u, 1), np.inf)
    return np.floor(ratio.min(axis=1) + _TOL)


def served(cols: Columns, nu: np.ndarray) -> np.ndarray:
    """Served fraction per group, `Σ_j Θ_j ν_j / D_g` (1 where the demand is 0)."""
    cap = group_capacity(cols, np.arange(cols.num_cols), nu)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(cols.demand > 0, cap / np.where(cols.demand > 0, cols.demand, 1.0), 1.0)


def max_alpha_incumbent(cols: Columns, nu_lp: np.ndarray, *, ub: np.ndarray | None = None,
                        max_steps: int = 10_000) -> np.ndarray:
    """An integer `ν` within the availability with a high least served fraction `α`.

    From `⌊ν_LP⌋` (feasible: usage is non-negative), repeatedly give one more instance to the
    least served (model, phase): the column of that group that adds the most throughput per
    share of the scarcest remaining resource it uses. When the least served group has no column
    left that fits, try once to make room: take back one instance from the group with the most
    slack (served beyond the current α by more than that instance's share) and add for the least
    served one if that raises `α`; stop when neither works. The same greedy also runs from
    nothing, after giving every (model, phase) one instance (the most constrained first); the
    better of the two plans is returned.

    Args:
        cols: the candidate columns (availability in `cols.avail`).
        nu_lp: the LP relaxation's `ν` (any non-negative values).
        ub: per-column upper bounds (default `cols.ub`).
        max_steps: a cap on the moves (each adds or swaps one instance).

    Returns:
        Instances per column (integers, a new array).
    """
    ub = cols.ub if ub is None else ub
    from_lp = _greedy(cols, np.minimum(np.floor(np.maximum(nu_lp, 0.0) + _TOL), ub).astype(np.int64), ub, max_steps)
    # From scratch, every (model, phase) first gets one instance, the most constrained first
    # (fewest columns that fit) on its smallest footprint: rounding the LP can leave a group
    # nothing that fits when instances are large against the availability.
    seeded = _greedy(cols, np.zeros(cols.num_cols, dtype=np.int64), ub, max_steps, seed_groups=True)
    return max((from_lp, seeded), key=lambda v: float(served(cols, v).min()))


def _seed_groups(cols: Columns, nu: np.ndarray, ub: np.ndarray, rem: np.ndarray, by_group: list[np.ndarray],
                 demand: np.ndarray, apply: Callable[[int, int], None]) -> None:
    """`_greedy`'s seeding: one instance per demanded group, the group with the fewest columns that fit first,
    each on the column using the least share of its scarcest resource."""
    pending = [g for g in range(len(cols.groups)) if np.isfinite(demand[g])]
    while pending:
        counts = []
        for g in pending:
            cand = by_group[g][nu[by_group[g]] < ub[by_group[g]]]
            counts.append(int((_fits(cols, cand, rem) >= 1).sum()) if cand.size else 0)
        g = pending.pop(int(np.argmin(counts)))
        cand = by_group[g][nu[by_group[g]] < ub[by_group[g]]]
        cand = cand[_fits(cols, cand, rem) >= 1] if cand.size else cand
        if cand.size:
            u = cols.usage[cols.col_t[cand]].astype(float)
            share = np.max(np.where(u > 0, u / np.maximum(rem[cols.col_r[cand]], _TOL), 0.0), axis=1)
            apply(int(cand[np.argmin(share)]), 1)


def _greedy(cols: Columns, nu: np.ndarray, ub: np.ndarray, max_steps: int, seed_groups: bool = False) -> np.ndarray:
    """`max_alpha_incumbent`'s greedy from `nu` (modified in place and returned)."""
    rem = cols.avail.copy()
    nz = np.flatnonzero(nu)
    np.add.at(rem, cols.col_r[nz], -(cols.usage[cols.col_t[nz]].astype(float) * nu[nz, None]))
    theta = cols.col_theta()
    grp = cols.group[cols.col_t]
    by_group = [np.flatnonzero(grp == g) for g in range(len(cols.groups))]
    frac = served(cols, nu)
    demand = np.where(cols.demand > 0, cols.demand, np.inf)
    cross, cross_theta = _cross(cols)

    def best_add(g: int, rem_: np.ndarray) -> int | None:
        cand = by_group[g]
        cand = cand[nu[cand] < ub[cand]]
        if cand.size == 0:
            return None
        fits = _fits(cols, cand, rem_)
        cand = cand[fits >= 1]
        if cand.size == 0:
            return None
        u = cols.usage[cols.col_t[cand]].astype(float)
        r = np.maximum(rem_[cols.col_r[cand]], _TOL)
        share = np.max(np.where(u > 0, u / r, 0.0), axis=1)  # of the scarcest resource it uses
        return int(cand[np.argmax(theta[cand] / np.maximum(share, _TOL))])

    def apply(j: int, k: int) -> None:
        nonlocal frac
        rem[cols.col_r[j]] -= cols.usage[cols.col_t[j]] * k
        nu[j] += k
        frac[grp[j]] += k * theta[j] / demand[grp[j]]
        if cross[j] >= 0:  # a colocated instance serves its model's decode demand too
            frac[cross[j]] += k * cross_theta[j] / demand[cross[j]]

    if seed_groups:
        _seed_groups(cols, nu, ub, rem, by_group, demand, apply)

    for _ in range(max_steps):
        low = int(np.argmin(frac))
        if not np.isfinite(demand[low]):
            break  # nothing is demanded
        j = best_add(low, rem)
        if j is not None:
            apply(j, 1)
            continue
        # make room: one instance out of the group with the most slack, if that lets `low` grow
        alpha = float(frac.min())
        order = np.argsort(-frac)
        moved = False
        for donor in order[: max(1, len(order) // 2)]:
            if donor == low:
                continue
            held = by_group[donor][nu[by_group[donor]] > 0]
            held = held[frac[donor] - theta[held] / demand[donor] > alpha + _TOL]
            for k in held[np.argsort(theta[held])]:  # the smallest instance first
                trial = rem.copy()
                trial[cols.col_r[k]] += cols.usage[cols.col_t[k]]
                j = best_add(low, trial)
                if j is None:
                    continue
                new_low = frac[low] + theta[j] / demand[low]
                second = np.min(np.delete(frac, [low, donor])) if len(frac) > 2 else np.inf
                if min(new_low, frac[donor] - theta[k] / demand[donor], second) > alpha + _TOL:
                    apply(int(k), -1)
                    apply(j, 1)
                    moved = True
                    break
            if moved:
                break
        if not moved:
            break
    return nu


def min_cost_incumbent(cols: Columns, nu_lp: np.ndarray, cost: np.ndarray, *, alpha: float = 1.0,
                       ub: np.ndarray | None = None) -> np.ndarray | None:
    """An integer `ν` within the availability that meets `alpha` × every group's demand, cheaply.

    From `⌊ν_LP⌋` (feasible for the availability: usage is non-negative), each group short of its
    demand gets one more instance at a time: the column, among those that still fit, with the
    least cost per useful throughput (`cost_j / min(Θ_j, shortfall)`), until its demand is met.
    The LP's fractional instances are where the cost ILP's optimum differs from the LP's, so the
    result is close to the LP bound when instances are small against the demand.

    Args:
        cols: the candidate columns (availability in `cols.avail`).
        nu_lp: the cost LP relaxation's `ν`.
        cost: per column, what one more instance costs in the objective.
        alpha: the demand fraction to meet.
        ub: per-column upper bounds (default `cols.ub`).

    Returns:
        Instances per column (a new array), or None when some group cannot be covered.
    """
    ub = cols.ub if ub is None else ub
    nu = np.minimum(np.floor(np.maximum(nu_lp, 0.0) + _TOL), ub).astype(np.int64)
    rem = cols.avail.copy()
    nz = np.flatnonzero(nu)
    np.add.at(rem, cols.col_r[nz], -(cols.usage[cols.col_t[nz]].astype(float) * nu[nz, None]))
    theta = cols.col_theta()
    grp = cols.group[cols.col_t]
    cap = group_capacity(cols, np.arange(cols.num_cols), nu)
    cross, cross_theta = _cross(cols)
    need = alpha * cols.demand
    for g in np.flatnonzero(cap < need):
        cand = np.flatnonzero(grp == g)
        while cap[g] < need[g]:
            open_ = cand[nu[cand] < ub[cand]]
            open_ = open_[_fits(cols, open_, rem) >= 1] if open_.size else open_
            if open_.size == 0:
                return None
            short = need[g] - cap[g]
            j = int(open_[np.argmin(cost[open_] / np.minimum(theta[open_], short))])
            rem[cols.col_r[j]] -= cols.usage[cols.col_t[j]]
            nu[j] += 1
            cap[g] += theta[j]
            if cross[j] >= 0:
                cap[cross[j]] += cross_theta[j]
    return nu


def _cross(cols: Columns) -> tuple[np.ndarray, np.ndarray]:
    """Per column: the second demand row a colocated template serves (-1: none) and its `Θ_D` there."""
    if cols.cross_group is None or cols.cross_throughput is None:
        return np.full(cols.num_cols, -1, dtype=np.int64), np.zeros(cols.num_cols)
    return cols.cross_group[cols.col_t], cols.col_cross_theta()
