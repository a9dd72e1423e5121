"""The online allocation ILP (DESIGN §4): formulate as sparse matrices, solve through
`coral.solver`, decode into a `Plan`; the cost pass and the MIP on reduced columns (`polish`)
that goodput mode (`coral.allocator.goodput`) shares. `coral.allocator.search` runs the passes."""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

import numpy as np

from coral.allocator.bounds import (
    lagrangian_cost_bound,
)
from coral.allocator.incumbent import max_alpha_incumbent, min_cost_incumbent, served
from coral.allocator.inputs import AllocationInputs, Columns, group_capacity
from coral.allocator.plan import DemandLine, Instance, NodeUse, Plan
from coral.allocator.spot import base_region, is_spot_region
from coral.allocator.spot_caps import spot_cap_rows
from coral.solver import CsrMatrix, MilpModel, SolveOptions, SolveResult, Status, solve

Mode = Literal["cost", "goodput"]
ALPHA_RESOLUTION = 1e-7  # CP-SAT grid step of the continuous alpha
LAGRANGIAN_SHARE = 0.25  # of the time left, what one Lagrangian bound (`coral.allocator.bounds`) may use
FINISH_RESERVE_S = 0.3  # the solves stop this long before the limit: HiGHS overruns it slightly (more on a busy host)
REDUCE_COLUMNS = 20_000  # from this many columns, cost mode starts from a rounded LP plan + reduced-cost fixing
MIP_COLUMNS = 1_200  # the most columns a MIP of goodput / reduced-cost mode gets (see `polish`)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Formulation:
    """A formulated allocation model and how to read its columns.

    Columns `[0, n)` are `ν_j` (one per `Columns` column `j`), then one `δ` per running column
    (`running[k]` is its `ν` index), then one `ε` per running column, then `α` in goodput mode.
    """

    model: MilpModel
    mode: Mode
    n: int
    running: np.ndarray
    alpha_col: int | None
    penalty: np.ndarray  # `π_j` per ν column
    # per ν column, the bound the rounding heuristics (`coral.allocator.incumbent`) keep to: its
    # upper bound, 0 for a column under a spot share cap (C5), so a rounded plan keeps every cap
    incumbent_ub: np.ndarray


def prev_counts(inputs: AllocationInputs, cols: Columns,
                prev: dict[tuple[str, str], int] | None) -> np.ndarray:
    """`ν^prev_j` per column from {(region, template key): count} (unknown keys are ignored:
    a running template that is no longer a candidate is simply shut down)."""
    out = np.zeros(cols.num_cols)
    if not prev or cols.num_cols == 0:
        return out
    r_of = {r: i for i, r in enumerate(inputs.regions)}
    T = len(cols.templates)
    code = cols.col_r * T + cols.col_t
    order = np.argsort(code, kind="stable")
    for (r, key), count in prev.items():
        t, ri = cols.template_index(key), r_of.get(r)  # a lookup: no template object is made
        if t is None or ri is None or count <= 0:
            continue
        pos = np.searchsorted(code, ri * T + t, sorter=order)
        if pos < code.shape[0] and code[order[pos]] == ri * T + t:
            out[order[pos]] = count
    return out


def formulate(inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray, *, mode: Mode = "cost",
              alpha: float = 1.0) -> Formulation:
    """Build the allocation MILP. One function on purpose (longer than 80 lines): it builds the
    constraint families below in order, each block labelled `# (C#)` to match this list.

    Sets:
        regions `r`, configurations `c`, groups `g = (m, φ)` with demand > 0, candidate columns
        `j = (r, τ)` (`τ ∈ T(m, φ)`, every config of `τ` sold in `r`, `r` allowed for `m`,
        at least one instance fits), running columns `J⁺ = {j : ν^prev_j > 0}`.
    Parameters:
        `p_j = p_r(τ)` $/h, `π_j = p_j · t_init / H` (H = 1 h), `σ_j = p_j · t_init / E` the price
        of stopping a running instance (it keeps serving, paid, for `t_init` while its replacement
        initializes: a cost borne within the epoch `E`), `Θ_j` tok/s, `U_c(τ)`,
        `A_r(c)` nodes, `D_g` tok/s, `ν^prev_j`, `α` (given, cost mode).
    Variables:
        `ν_j ∈ Z, 0 ≤ ν_j ≤ min(⌊A_r(c)/U_c(τ)⌋, ⌈D_g/Θ_j⌉)` instances;
        `δ_j ≥ 0` for `j ∈ J⁺` (newly started instances; for `j ∉ J⁺`, `δ_j = ν_j` at the
        optimum, so it is folded into the cost of `ν_j`); `ε_j ≥ 0` for `j ∈ J⁺` (instances
        stopped); goodput mode: `0 ≤ α ≤ 1`.
    Objective:
        cost mode: minimize `Σ_{j∉J⁺} (p_j + π_j)·ν_j + Σ_{j∈J⁺} (p_j·ν_j + π_j·δ_j + σ_j·ε_j)`;
        goodput mode: maximize `α`.
    Constraints:
        (C1) availability: `Σ_{j in r} U_c(τ_j)·ν_j ≤ A_r(c)` for every (r, c) with finite A;
        (C2) demand: `Σ_{j∈g} Θ_j·ν_j ≥ α·D_g` (cost mode, α given) or
             `Σ_{j∈g} Θ_j·ν_j − D_g·α ≥ 0` (goodput mode) for every group g, where a colocated
             column of model m counts `Θ_P` in `(m, prefill)` and `Θ_D` in `(m, decode)`;
        (C3) start-up: `ν_j − δ_j ≤ ν^prev_j` for `j ∈ J⁺` (cost mode only);
        (C4) stop: `ν_j + ε_j ≥ ν^prev_j` for `j ∈ J⁺` (cost mode only): a replacement must save
             more than the drain overlap and the start-up together, which keeps re-planning from
             churning instances for a marginally cheaper mix;
        (C5) spot share cap: `Σ_{j∈g, r_j = r} s_j·Θ_j·ν_j ≤ cap_{r,m}·D_g` for every spot market
             `r` and group `g` of a model `m` whose cap there is below 1 (`coral.allocator.spot_caps`);
        (C6) no start in a spot pool that is down: `ν_j ≤ ν^prev_j` for a spot column using a
             pool a preemption took (`AllocationInputs.spot_down`; a bound on the column).
        A spot market's columns count `s_j·Θ_j` in (C2) and (C5), `s_j` the survival discount of
        their template's node count (`coral.allocator.spot`); on-demand columns have `s_j = 1`.

    Args:
        inputs: checked inputs (for the start-up time).
        cols: candidate columns.
        nu_prev: `ν^prev_j` per column.
        mode: "cost" (minimize $/h at demand × alpha) or "goodput" (maximize alpha).
        alpha: the demand fraction to meet in cost mode.

    Returns:
        The formulation; inputs are not modified.
    """
    n = cols.num_cols
    G = len(cols.groups)
    R, C = cols.avail.shape
    theta = cols.col_theta()
    grp = cols.group[cols.col_t]
    penalty = cols.price * (inputs.init_s / inputs.horizon_s)
    need = np.ceil(np.maximum(cols.demand[grp], 0.0) / theta - 1e-9)
    cross = cols.cross_group[cols.col_t] if cols.cross_group is not None else np.full(n, -1, dtype=np.int64)
    both = np.flatnonzero(cross >= 0)  # colocated columns: Θ_P in the prefill row, Θ_D in the decode row
    cross_theta = cols.col_cross_theta()[both]
    if both.size:
        need[both] = np.maximum(need[both], np.ceil(cols.demand[cross[both]] / cross_theta - 1e-9))
    ub = np.minimum(np.minimum(cols.ub, np.maximum(need, 0.0)), cols.start_limit(nu_prev))

    running = np.flatnonzero(nu_prev > 0) if mode == "cost" else np.zeros(0, dtype=np.int64)
    k = running.shape[0]
    use_alpha = mode == "goodput"
    num = n + 2 * k + (1 if use_alpha else 0)

    c = np.zeros(num)
    if mode == "cost":
        c[:n] = cols.price + penalty
        c[running] = cols.price[running]
        c[n:n + k] = penalty[running]
        c[n + k:n + 2 * k] = cols.price[running] * (inputs.init_s / inputs.epoch_s)
    else:
        c[n + 2 * k] = 1.0

    row_parts, col_parts, val_parts, lo_parts, hi_parts = [], [], [], [], []
    next_row = 0

    # (C1) availability per (region, config) with a finite bound
    use = cols.usage[cols.col_t]  # (n, C)
    j_idx, c_idx = np.nonzero(use)
    rc = cols.col_r[j_idx] * C + c_idx
    finite = np.isfinite(cols.avail.reshape(-1))[rc]
    j_idx, c_idx, rc = j_idx[finite], c_idx[finite], rc[finite]
    rc_ids, rc_row = np.unique(rc, return_inverse=True)
    row_parts.append(next_row + rc_row)
    col_parts.append(j_idx)
    val_parts.append(use[j_idx, c_idx].astype(float))
    lo_parts.append(np.full(rc_ids.shape[0], -np.inf))
    hi_parts.append(cols.avail.reshape(-1)[rc_ids])
    next_row += rc_ids.shape[0]

    # (C2) demand per group; a colocated column also counts Θ_D in its model's decode row
    row_parts += [next_row + grp, next_row + cross[both]]
    col_parts += [np.arange(n), both]
    val_parts += [theta, cross_theta]
    if use_alpha:
        row_parts.append(next_row + np.arange(G))
        col_parts.append(np.full(G, n + 2 * k))
        val_parts.append(-cols.demand)
        lo_parts.append(np.zeros(G))
    else:
        lo_parts.append(alpha * cols.demand)
    hi_parts.append(np.full(G, np.inf))
    next_row += G

    # (C3) start-up of running templates: ν_j − δ_j ≤ ν^prev_j
    if k:
        row_parts += [next_row + np.arange(k), next_row + np.arange(k)]
        col_parts += [running, n + np.arange(k)]
        val_parts += [np.ones(k), -np.ones(k)]
        lo_parts.append(np.full(k, -np.inf))
        hi_parts.append(nu_prev[running].astype(float))
        next_row += k
        # (C4) stop of running templates: ν_j + ε_j ≥ ν^prev_j
        row_parts += [next_row + np.arange(k), next_row + np.arange(k)]
        col_parts += [running, n + k + np.arange(k)]
        val_parts += [np.ones(k), np.ones(k)]
        lo_parts.append(nu_prev[running].astype(float))
        hi_parts.append(np.full(k, np.inf))
        next_row += k

    # (C5) spot share caps: per (spot market, group) of a model with a cap below 1
    caps = spot_cap_rows(inputs, cols)
    if caps.num_rows:
        row_parts.append(next_row + caps.row)
        col_parts.append(caps.col)
        val_parts.append(caps.value)
        lo_parts.append(np.full(caps.num_rows, -np.inf))
        hi_parts.append(caps.limit)
        next_row += caps.num_rows

    A = CsrMatrix.from_coo(np.concatenate(val_parts), np.concatenate(row_parts), np.concatenate(col_parts),
                           shape=(next_row, num))
    col_lower = np.zeros(num)
    col_upper = np.concatenate([ub, ub[running], nu_prev[running].astype(float), [1.0] if use_alpha else []])
    integrality = np.zeros(num, dtype=bool)
    integrality[:n] = True
    resolution = np.ones(num)  # δ and ε are integral at the optimum; α gets a fine grid
    if use_alpha:
        resolution[n + 2 * k] = ALPHA_RESOLUTION
    model = MilpModel(c=c, A=A, row_lower=np.concatenate(lo_parts), row_upper=np.concatenate(hi_parts),
                      col_lower=col_lower, col_upper=col_upper, integrality=integrality,
                      sense="max" if use_alpha else "min", resolution=resolution)
    incumbent_ub = ub.copy()
    incumbent_ub[caps.col] = 0.0
    return Formulation(model=model, mode=mode, n=n, running=running, alpha_col=n + 2 * k if use_alpha else None,
                       penalty=penalty, incumbent_ub=incumbent_ub)


def decode_counts(form: Formulation, result: SolveResult) -> np.ndarray | None:
    """`ν_j` rounded to integers, or None without an incumbent."""
    if result.x is None:
        return None
    return np.rint(np.maximum(result.x[:form.n], 0.0)).astype(np.int64)


def build_plan(inputs: AllocationInputs, cols: Columns, nu: np.ndarray, nu_prev: np.ndarray, *, method: str,
               status: Status, solve_s: float, gap: float | None, objective: float | None = None,
               goodput_mode: bool = False, notes: tuple[str, ...] = (), charge_init: bool = True) -> Plan:
    """Turn instance counts per column into a `Plan` (nodes, instances, demand vs capacity, α).

    `charge_init`: report the start-up penalty of instances beyond `ν^prev` (the ILP charges it;
    the baselines report it too so costs compare, but never optimize it).
    """
    nz = np.flatnonzero(nu > 0)
    R, C = cols.avail.shape
    share, spot = cols.col_share(), cols.col_spot()
    instances = tuple(Instance(region=base_region(inputs.regions[int(cols.col_r[j])]),
                               template=cols.templates[int(cols.col_t[j])], count=int(nu[j]),
                               price_usd_per_h=float(cols.price[j]), spot=bool(spot[j]),
                               capacity_share=float(share[j])) for j in nz)
    node_counts = np.zeros((R, C), dtype=np.int64)
    np.add.at(node_counts, cols.col_r[nz], cols.usage[cols.col_t[nz]] * nu[nz, None])
    nodes = []
    for ri, ci in zip(*np.nonzero(node_counts), strict=True):
        a = cols.avail[ri, ci]
        market = inputs.regions[ri]
        nodes.append(NodeUse(region=base_region(market), config=inputs.configs[ci], count=int(node_counts[ri, ci]),
                             available=None if math.isinf(a) else int(a), spot=is_spot_region(market)))
    cap = group_capacity(cols, nz, nu[nz])
    cap_of = {g: float(cap[i]) for i, g in enumerate(cols.groups)}
    demand = tuple(DemandLine(model=m, phase=ph, demand_tok_per_s=float(inputs.demand[(m, ph)]),
                              capacity_tok_per_s=cap_of.get((m, ph), 0.0)) for m, ph in inputs.groups)
    alpha = min((d.served_fraction for d in demand), default=1.0)
    cost = float(np.dot(cols.price[nz], nu[nz]))
    started = np.maximum(nu - np.rint(nu_prev).astype(np.int64), 0)
    init = float(np.dot(cols.price, started)) * inputs.init_s / inputs.horizon_s if charge_init else 0.0
    return Plan(method=method, status=status, instances=instances, nodes=tuple(nodes), demand=demand,
                cost_usd_per_h=cost, alpha=alpha, solve_s=solve_s, gap=gap, objective=objective,
                init_penalty_usd_per_h=init, goodput_mode=goodput_mode, notes=notes)


def result_gap(result: SolveResult) -> float | None:
    return float(result.gap) if math.isfinite(result.gap) else None


def relaxed(form: Formulation) -> Formulation:
    """The same model with every integrality dropped (its LP relaxation)."""
    return replace(form, model=replace(form.model, integrality=np.zeros_like(form.model.integrality)))


def start_vector(form: Formulation, nu: np.ndarray, nu_prev: np.ndarray) -> np.ndarray:
    """A full point of `form` from instance counts: `δ` and `ε` at their least values for `ν`
    (instances started / stopped against `ν^prev`), `α` (goodput mode) the least served fraction.
    Feasible for the model whenever `ν` fits the availability and meets the demand rows."""
    x = np.zeros(form.model.num_cols)
    x[:form.n] = nu
    k = form.running.shape[0]
    if k:
        run_nu, run_prev = nu[form.running], nu_prev[form.running]
        x[form.n:form.n + k] = np.maximum(run_nu - run_prev, 0)
        x[form.n + k:form.n + 2 * k] = np.maximum(run_prev - run_nu, 0)
    return x


def reduced_cost_keep(form: Formulation, lp: SolveResult, incumbent_objective: float) -> np.ndarray | None:
    """The `ν` columns that can be non-zero in a solution better than the incumbent, by the LP
    relaxation's reduced costs (reduced-cost fixing, exact up to a 1e-6 relative tolerance).

    For an LP optimum `z` with reduced costs `d` (minimizing), every feasible point `x` of the
    model has `c·x ≥ z + Σ_j d_j·x_j` over the columns at their lower bound 0 (the others and the
    rows only add non-negative terms), so a column with `d_j > UB − z` is 0 in every solution
    cheaper than the incumbent's `UB`; maximizing, the same with the signs turned. Returns None
    when the LP has no reduced costs (another backend, or not solved to optimality)."""
    d = lp.reduced_costs
    if d is None or lp.x is None or not math.isfinite(lp.objective) or not math.isfinite(incumbent_objective):
        return None
    d = np.asarray(d[:form.n], dtype=float)
    if form.model.sense == "max":
        d = -d
    slack = abs(incumbent_objective - float(lp.objective))
    tol = 1e-6 * max(1.0, abs(incumbent_objective)) + 1e-9
    return (d <= slack + tol) | (np.asarray(lp.x[:form.n]) > 1e-9)


def best_per_group(cols: Columns, form: Formulation, lp: SolveResult, per_group: int) -> np.ndarray:
    """The `per_group` columns of each (model, phase) with the least reduced cost in the LP `lp`
    of `form` (the most promising ones), and every column the LP uses. A boolean mask."""
    assert lp.reduced_costs is not None and lp.x is not None
    d = np.asarray(lp.reduced_costs[:form.n], dtype=float)
    if form.model.sense == "max":
        d = -d
    grp = cols.group[cols.col_t]
    order = np.lexsort((d, grp))
    g_sorted = grp[order]
    first = np.searchsorted(g_sorted, g_sorted, side="left")
    rank = np.arange(order.size) - first
    keep = np.zeros(form.n, dtype=bool)
    keep[order[rank < per_group]] = True
    return keep | (np.asarray(lp.x[:form.n]) > 1e-9)


def sub_columns(cols: Columns, idx: np.ndarray) -> Columns:
    """`cols` restricted to the columns `idx` (the templates and regions stay)."""
    return replace(cols, col_t=cols.col_t[idx], col_r=cols.col_r[idx], price=cols.price[idx], ub=cols.ub[idx])


T = TypeVar("T")


class SolveBudget:
    """The time limit every solve of one `solve_allocation` call shares, and the solver time spent.

    The passes take it as an argument rather than sharing a closure: each pass's inputs and outputs
    stay visible in its signature, and the time it spends is counted in one place."""

    __slots__ = ("options", "start", "solve_s")

    def __init__(self, options: SolveOptions) -> None:
        self.options = options
        self.start = time.perf_counter()
        self.solve_s = 0.0

    def remaining(self) -> float:
        """Seconds left, less what decoding and returning the plan takes after the last solve."""
        return self.options.time_limit_s - (time.perf_counter() - self.start) - FINISH_RESERVE_S

    def run(self, form: Formulation, *, limit: float | None = None, gap: float | None = None,
            start_x: np.ndarray | None = None) -> SolveResult:
        """Solve `form` within `limit` (at most the time left) to `gap` (default: the options' gap)."""
        options = self.options
        budget = self.remaining() if limit is None else min(limit, self.remaining())
        opts = SolveOptions(backend=options.backend, time_limit_s=max(budget, 0.05),
                            mip_gap=options.mip_gap if gap is None else gap,
                            threads=options.threads, seed=options.seed, verbose=options.verbose)
        res = solve(form.model, opts) if start_x is None else solve(form.model, opts, start=start_x)
        self.solve_s += res.wall_s
        return res

    def timed(self, fn: Callable[[], T]) -> T:
        """`fn()`, its time counted as solver time (a bound computed between the solves)."""
        began = time.perf_counter()
        try:
            return fn()
        finally:
            self.solve_s += time.perf_counter() - began


@dataclass(frozen=True, slots=True, kw_only=True)
class Polished:
    """What `polish` returns: the plan's counts, its status, gap, objective and bound, and which
    columns the MIP had (for the notes)."""

    nu: np.ndarray
    status: Status
    gap: float
    objective: float
    bound: float
    how: str


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class GoodputStart:
    """The cost pass ended without a plan: what goodput mode starts from.

    `cost_lp` / `cost_form`: the cost LP and its model, when the LP is feasible but no rounding of
    it meets every demand (large models); `cost_round` its max-α rounding (zeros otherwise)."""

    cost_lp: SolveResult | None
    cost_form: Formulation | None
    cost_round: np.ndarray


def _start_point(form: Formulation, nu: np.ndarray, prev: np.ndarray, alpha_of: float) -> np.ndarray:
    x = start_vector(form, nu, prev)
    if form.alpha_col is not None:
        x[form.alpha_col] = alpha_of
    return x


def _polish_columns(cols: Columns, form: Formulation, lp: SolveResult, nu0: np.ndarray, nu_prev: np.ndarray,
                    inc: float, foreign: bool) -> tuple[np.ndarray, bool]:
    """The columns `polish`'s MIP gets, and whether the fixing is exact (reduced-cost fixing) rather
    than a ranking (the columns of least reduced cost per (model, phase))."""
    keep = None if foreign else reduced_cost_keep(form, lp, inc)
    keep = np.ones(form.n, dtype=bool) if keep is None else keep
    exact = True
    if keep.sum() > MIP_COLUMNS and cols.num_cols >= REDUCE_COLUMNS:
        # too many for the MIP inside the epoch (HiGHS's presolve does not watch the clock):
        # the columns of least reduced cost per (model, phase); the bound stays the LP's
        keep &= best_per_group(cols, form, lp, MIP_COLUMNS // max(len(cols.groups), 1))
        exact = False
    keep |= nu0 > 0
    keep |= nu_prev > 0
    return np.flatnonzero(keep), exact


def polish(budget: SolveBudget, inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray, mode: Mode,
           alpha: float, form: Formulation, lp: SolveResult, nu0: np.ndarray, *, gap: float,
           limit: float | None = None, use_start: bool = True, alpha_cap: float = 1.0,
           foreign: bool = False) -> Polished:
    """The MIP on the columns reduced-cost fixing keeps (`reduced_cost_keep`, from the LP `lp`
    of `form` and the incumbent `nu0`), started from `nu0` when `use_start`. The gap is against
    the better of the LP's and the reduced MIP's bound, both valid for the whole model (a column
    fixed at 0 is 0 in every solution better than the incumbent, which the reduced model
    contains); in cost mode also the Lagrangian bound (`bounds.lagrangian_cost_bound`).

    `foreign`: `lp` is the LP of another model of the same columns (cost mode at α = 1, for the
    cost pass at α* of a large model: re-solving it takes seconds the MIP needs). It then only
    ranks the columns and prices the availability: no fixing, the bound is the Lagrangian's
    alone (valid for any multipliers), never that LP's objective."""
    maxi = form.model.sense == "max"
    alpha_0 = min(float(served(cols, nu0).min()), 1.0)
    inc = float(form.model.c @ _start_point(form, nu0, nu_prev, alpha_0))
    assert not foreign or (mode == "cost" and cols.num_cols >= REDUCE_COLUMNS)
    lp_obj = 0.0 if foreign else float(lp.objective)  # costs are ≥ 0: 0 bounds any plan
    if form.alpha_col is not None:
        lp_obj = min(lp_obj, 1.0)  # the LP may have been solved with α uncapped (`_uncapped`)
    if mode == "cost":
        # integer covers per (model, phase) priced at the LP's availability duals: at least the LP's
        lag = budget.timed(lambda: lagrangian_cost_bound(cols, form.model.c[:form.n], form.model.col_upper[:form.n],
                                                         alpha, lp, skip=nu_prev > 0, floor_lp=not foreign,
                                                         limit_s=budget.remaining() * LAGRANGIAN_SHARE))
        if lag is not None and math.isfinite(lag[0]):
            lp_obj = max(lp_obj, lag[0])
    rel = abs(inc - lp_obj) / max(abs(inc), 1e-12)
    if rel <= gap:
        return Polished(nu=nu0, status=Status.OPTIMAL, gap=rel, objective=inc, bound=lp_obj,
                        how="no MIP: the rounded LP plan is within the gap")
    idx, exact = _polish_columns(cols, form, lp, nu0, nu_prev, inc, foreign)
    sub_form = formulate(inputs, sub_columns(cols, idx), nu_prev[idx], mode=mode, alpha=alpha)
    if sub_form.alpha_col is not None and alpha_cap < 1.0:  # a proven bound on α: no plan serves more
        upper = sub_form.model.col_upper.copy()
        upper[sub_form.alpha_col] = alpha_cap
        sub_form = replace(sub_form, model=replace(sub_form.model, col_upper=upper))
    res = budget.run(sub_form, limit=limit, gap=gap,
                     start_x=_start_point(sub_form, nu0[idx], nu_prev[idx], alpha_0) if use_start else None)
    got = decode_counts(sub_form, res)
    if got is not None and (res.objective < inc if maxi else res.objective > inc):
        got = None  # the incumbent is better than what the solver found from scratch
    if got is None:
        nu, obj, status = nu0, inc, Status.TIME_LIMIT
    else:
        nu = np.zeros(form.n, dtype=np.int64)
        nu[idx] = got
        obj, status = float(res.objective), res.status
    bound = float(res.bound) if exact and math.isfinite(res.bound) else lp_obj
    bound = min(bound, lp_obj) if maxi else max(bound, lp_obj)
    g = max(abs(obj - bound) / max(abs(obj), 1e-12), 0.0)
    if g <= gap:
        status = Status.OPTIMAL
    elif status is Status.OPTIMAL:
        status = Status.FEASIBLE  # optimal on the ranked columns only: not proved for all of them
    how = (f"{idx.size:,} of {form.n:,} columns, "
           + ("reduced-cost fixing: the others cannot beat the rounded LP plan" if exact else
              f"the {MIP_COLUMNS // max(len(cols.groups), 1)} of least reduced cost per model and phase"
              + ("; bound: the Lagrangian's (integer covers per model and phase)" if mode == "cost" else
                 "; bound: the LP's")))
    return Polished(nu=nu, status=status, gap=g, objective=obj, bound=bound, how=how)


def round_cost_lp(cols: Columns, form: Formulation, lp: SolveResult | None) -> tuple[np.ndarray | None, np.ndarray]:
    """The rounding pass of a large cost model (from `REDUCE_COLUMNS` columns): a plan that meets
    every demand from the cost LP, or None, and the LP's max-α rounding (zeros when not tried).

    `min_cost_incumbent` first (cheapest, needs the LP optimal); else `max_alpha_incumbent`, kept
    when it serves every demand in full."""
    cost_round = np.zeros(cols.num_cols, dtype=np.int64)
    nu0 = None
    if lp is None or lp.x is None or cols.num_cols < REDUCE_COLUMNS:
        return nu0, cost_round
    if lp.status is Status.OPTIMAL:
        nu0 = min_cost_incumbent(cols, lp.x[:form.n], form.model.c[:form.n], ub=form.incumbent_ub)
    if nu0 is None:
        cost_round = max_alpha_incumbent(cols, lp.x[:form.n], ub=form.incumbent_ub)
        if float(served(cols, cost_round).min()) >= 1.0:
            nu0 = cost_round
    return nu0, cost_round


def cost_mip(budget: SolveBudget, inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray, form: Formulation,
             *, method: str, notes: list[str]) -> Plan | None:
    """The full cost ILP (models below `REDUCE_COLUMNS` columns). Its plan, or None (the note
    says why) when goodput mode takes over."""
    res = budget.run(form)
    got = decode_counts(form, res)
    if got is not None and res.status is not Status.INFEASIBLE:
        return build_plan(inputs, cols, got, nu_prev, method=method, status=res.status, solve_s=budget.solve_s,
                          gap=result_gap(res), objective=res.objective)
    if res.status is Status.INFEASIBLE:
        notes.append("demand cannot be met with the available nodes: goodput mode (max alpha, then min cost)")
    else:
        notes.append(f"cost ILP ended {res.status.value} without a plan ({res.message}); trying goodput mode")
    return None


def cost_pass(budget: SolveBudget, inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray, *, method: str,
              notes: list[str]) -> Plan | GoodputStart:
    """The cost ILP: the cost LP first (when infeasible, so is the ILP), then on large models the
    LP's rounding and the MIP on the columns reduced-cost fixing keeps, else the full MIP. A plan
    that meets every demand, or what goodput mode starts from (the notes say why)."""
    none = GoodputStart(cost_lp=None, cost_form=None, cost_round=np.zeros(cols.num_cols, dtype=np.int64))
    covered = np.zeros(len(cols.groups), dtype=bool)
    covered[cols.group[cols.col_t]] = True
    if cols.cross_group is not None:
        covered[cols.cross_group[cols.col_t][cols.cross_group[cols.col_t] >= 0]] = True
    if not covered.all():
        # some demanded (model, phase) has no node left for any of its templates: the cost ILP is
        # infeasible on its face (and an ILP without columns would look "empty" to a solver)
        short = ", ".join(f"{m}/{ph.value}" for (m, ph), ok in zip(cols.groups, covered, strict=True) if not ok)
        notes.append(f"no available nodes for any template of {short}: goodput mode (max alpha, then min cost)")
        return none
    form = formulate(inputs, cols, nu_prev, mode="cost")
    lp = budget.run(relaxed(form)) if budget.options.backend == "highs" else None
    if lp is not None and lp.status is Status.INFEASIBLE:
        notes.append("demand cannot be met with the available nodes (not even fractionally): "
                     "goodput mode (max alpha, then min cost)")
        return none
    nu0, cost_round = round_cost_lp(cols, form, lp)
    if nu0 is not None:
        assert lp is not None
        got = polish(budget, inputs, cols, nu_prev, "cost", 1.0, form, lp, nu0, gap=budget.options.mip_gap)
        notes.append(f"cost ILP from a rounded LP plan on {got.how}; gap {got.gap:.2%}")
        return build_plan(inputs, cols, got.nu, nu_prev, method=method, status=got.status, solve_s=budget.solve_s,
                          gap=got.gap, objective=got.objective)
    if cols.num_cols >= REDUCE_COLUMNS and lp is not None and lp.status is Status.OPTIMAL:
        # the full ILP would search blind (and HiGHS's presolve of it overruns the limit);
        # goodput mode's α is capped at 1, so a plan that meets every demand still wins there
        notes.append("no rounding of the cost LP meets every demand within the available nodes: goodput mode "
                     "(max alpha, at most 1, then min cost)")
        return GoodputStart(cost_lp=lp, cost_form=form, cost_round=cost_round)
    plan = cost_mip(budget, inputs, cols, nu_prev, form, method=method, notes=notes)
    return none if plan is None else plan


def with_changes(plan: Plan, **changes: object) -> Plan:
    if "notes" in changes:
        changes["notes"] = tuple(changes["notes"])  # type: ignore[arg-type]
    return replace(plan, **changes)  # type: ignore[arg-type]
