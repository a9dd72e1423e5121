"""The online allocation ILP (DESIGN §4): formulate as sparse matrices, solve through
`coral.solver`, decode into a `Plan`; goodput mode when demand cannot be met."""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

import numpy as np

from coral.allocator.bounds import (
    column_generation_alpha_bound,
    lagrangian_alpha_bound,
    lagrangian_cost_bound,
)
from coral.allocator.incumbent import max_alpha_incumbent, min_cost_incumbent, served
from coral.allocator.inputs import AllocationInputs, Columns, group_capacity
from coral.allocator.plan import DemandLine, Instance, NodeUse, Plan
from coral.solver import CsrMatrix, MilpModel, SolveOptions, SolveResult, Status, solve

Mode = Literal["cost", "goodput"]
ALPHA_SLACK = 1e-6  # phase 2 of goodput mode keeps alpha >= alpha* - ALPHA_SLACK
ALPHA_RESOLUTION = 1e-7  # CP-SAT grid step of the continuous alpha
GOODPUT_GAP = 5e-3  # goodput mode solves α and the cost at α to this relative gap (or mip_gap, if looser)
GOODPUT_ALPHA_SHARE = 0.5  # of the time left, what the α search may use (the cost pass gets the rest)
GOODPUT_ALPHA_START = False  # the α ILP starts from HiGHS's own heuristics, not the rounded plan
PROBE_SHARE = 0.15  # of the time left, what those probes may use together
LAGRANGIAN_SHARE = 0.25  # of the time left, what one Lagrangian bound (`coral.allocator.bounds`) may use
DW_SHARE = 0.15  # of the time left, what the column-generation α bound may use (`bounds.column_generation_alpha_bound`)
PROBE_S = 0.6  # the most one feasibility MILP bounding goodput mode's α may take (`alpha_bound_probes`)
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
    """Build the allocation MILP.

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
             churning instances for a marginally cheaper mix.

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
    theta = cols.throughput[cols.col_t]
    grp = cols.group[cols.col_t]
    penalty = cols.price * (inputs.init_s / inputs.horizon_s)
    need = np.ceil(np.maximum(cols.demand[grp], 0.0) / theta - 1e-9)
    cross = cols.cross_group[cols.col_t] if cols.cross_group is not None else np.full(n, -1, dtype=np.int64)
    both = np.flatnonzero(cross >= 0)  # colocated columns: Θ_P in the prefill row, Θ_D in the decode row
    cross_theta = cols.cross_throughput[cols.col_t[both]] if cols.cross_throughput is not None else np.zeros(0)
    if both.size:
        need[both] = np.maximum(need[both], np.ceil(cols.demand[cross[both]] / cross_theta - 1e-9))
    ub = np.minimum(cols.ub, np.maximum(need, 0.0))

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
    return Formulation(model=model, mode=mode, n=n, running=running, alpha_col=n + 2 * k if use_alpha else None,
                       penalty=penalty)


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
    instances = tuple(Instance(region=inputs.regions[int(cols.col_r[j])], template=cols.templates[int(cols.col_t[j])],
                               count=int(nu[j]), price_usd_per_h=float(cols.price[j])) for j in nz)
    node_counts = np.zeros((R, C), dtype=np.int64)
    np.add.at(node_counts, cols.col_r[nz], cols.usage[cols.col_t[nz]] * nu[nz, None])
    nodes = []
    for ri, ci in zip(*np.nonzero(node_counts), strict=True):
        a = cols.avail[ri, ci]
        nodes.append(NodeUse(region=inputs.regions[ri], config=inputs.configs[ci], count=int(node_counts[ri, ci]),
                             available=None if math.isinf(a) else int(a)))
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


def _gap(result: SolveResult) -> float | None:
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


def alpha_on_ranked(inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray, cost_form: Formulation | None,
                     cost_lp: SolveResult, nu0: np.ndarray, run: Callable[..., SolveResult], gap: float,
                     limit: float) -> tuple[np.ndarray, Status, float, str]:
    """Goodput mode's α search when the cost LP meets every demand but no rounding of it does: the
    max-α MIP on the columns of least reduced cost in that LP per (model, phase), started from
    `nu0`. Returns (ν, status, α bound = 1, which columns, for the notes)."""
    assert cost_form is not None
    per_group = MIP_COLUMNS // max(len(cols.groups), 1)
    idx = np.flatnonzero(best_per_group(cols, cost_form, cost_lp, per_group) | (nu0 > 0) | (nu_prev > 0))
    sub_cols = sub_columns(cols, idx)
    sub = formulate(inputs, sub_cols, nu_prev[idx], mode="goodput")
    assert sub.alpha_col is not None
    alpha_0 = min(float(served(cols, nu0).min()), 1.0)
    x0 = start_vector(sub, nu0[idx], nu_prev[idx])
    x0[sub.alpha_col] = alpha_0
    res = run(sub, limit=limit, gap=gap, start_x=x0)
    got = decode_counts(sub, res)
    nu = nu0.copy()
    if got is not None and float(served(sub_cols, got).min()) > alpha_0:
        nu = np.zeros(cols.num_cols, dtype=np.int64)
        nu[idx] = got
    alpha = min(float(served(cols, nu).min()), 1.0)
    status = Status.OPTIMAL if alpha > 0 and (1.0 - alpha) / alpha <= gap else Status.TIME_LIMIT
    how = (f"{idx.size:,} of {cols.num_cols:,} columns, the {per_group} of least reduced cost in the cost LP per model "
           "and phase; bound 1: the cost LP meets every demand")
    return nu, status, 1.0, how


def alpha_bound_probes(inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray, g_form: Formulation,
                        g_lp: SolveResult, nu0: np.ndarray, alpha_lp: float, run: Callable[..., SolveResult],
                        gap: float, limit: float, hi0: float | None = None) -> tuple[np.ndarray, float, str]:
    """A tighter bound on goodput mode's α than the max-α LP's `alpha_lp`, and maybe a better plan
    than `nu0`, from feasibility MILPs at α fixed.

    The max-α MILP's LP bound is weak (`Σ Θ ν − D·α ≥ 0` with α a variable is no knapsack), but
    with α fixed the demand rows are knapsack covers HiGHS's presolve and cuts tighten: on the
    synthetic scarce seed 2 it proves α = 0.4862 infeasible in 0.1 s and 0.4845 in about 1 s,
    where the max-α MILP's bound is still 0.4868 after 30 s. Near the true optimum both the
    proofs and the plans get hard, so the probes go down from the bound, an eighth of the interval
    [α of `nu0`, bound] at a time, each for at most `PROBE_S`: an infeasibility proof lowers the
    bound to the probed α (valid: every plan serves less), a plan raises the incumbent (to the α
    it serves). After a time-out the probes bisect between it and the bound; they end at a second
    time-out, at a first one before any proof (the instance is hard right below its LP bound;
    that first probe gets half of `PROBE_S`),
    when the two are within an eighth of the gap, or when the time is up. Each probe has only the columns
    reduced-cost fixing keeps for its α (in the max-α LP, a column of reduced cost above
    `alpha_lp − α` is 0 in every plan serving α).

    `hi0`: a bound already proven (at most `alpha_lp`) the probes start from.

    Returns (ν, α bound, a summary of the probes for the notes)."""
    deadline = time.perf_counter() + limit
    d = -np.asarray(g_lp.reduced_costs, dtype=float)[:g_form.n]  # maximizing: reduced costs ≤ 0 at the bound
    used = np.asarray(g_lp.x, dtype=float)[:g_form.n] > 1e-9
    best, lo, hi = nu0, float(served(cols, nu0).min()), alpha_lp if hi0 is None else min(hi0, alpha_lp)
    hard = -math.inf  # the highest α a probe timed out at: no probe goes below it again
    timeouts = 0
    proved = False  # whether a probe has proved infeasibility yet
    log: list[str] = []
    while lo > 0 and (hi - lo) / lo > gap and (hi - hard) / lo > gap / 8:
        left = deadline - time.perf_counter()
        if left < 0.05:
            break
        a = max(hi - (hi - lo) / 8, lo * (1 + gap / 2), (hi + hard) / 2)
        keep = np.flatnonzero((d <= alpha_lp - a + 1e-9 * max(alpha_lp, 1.0)) | used | (nu_prev > 0))
        sub_cols = sub_columns(cols, keep)
        form = formulate(inputs, sub_cols, nu_prev[keep], mode="cost", alpha=a)
        feas = replace(form, model=replace(form.model, c=np.zeros_like(form.model.c)))
        res = run(feas, limit=min(left, PROBE_S if proved else PROBE_S / 2), gap=gap)
        got = decode_counts(feas, res)
        if res.status is Status.INFEASIBLE:
            hi, proved = a, True
            log.append(f"{a:.5g} infeasible ({res.wall_s:.1f} s)")
            continue
        if got is not None:
            nu = np.zeros(cols.num_cols, dtype=np.int64)
            nu[keep] = got
            alpha = float(served(cols, nu).min())
            if alpha > lo:
                best, lo = nu, alpha
            log.append(f"{a:.5g} feasible (alpha {alpha:.5g}, {res.wall_s:.1f} s)")
            continue
        log.append(f"{a:.5g} {res.status.value} ({res.wall_s:.1f} s)")
        hard, timeouts = a, timeouts + 1
        if timeouts >= 2 or not proved:
            break  # hard this close to the bound already: the time is better spent on plans
    how = "; ".join(log) if log else "none"
    return best, hi, how


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
class Allocated:
    """`solve_allocation` found a plan; `notes` say how (the plan may carry them or not)."""

    plan: Plan
    notes: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class NoPlan:
    """No solve of `solve_allocation` produced an incumbent; the caller falls back.

    `status`: `ERROR` when a note reports a solver error, else `TIME_LIMIT`."""

    status: Status
    notes: tuple[str, ...]


AllocationResult = Allocated | NoPlan


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


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class AlphaFound:
    """Goodput mode's phase 1: the max-α plan `nu`, its status and the bound on α."""

    nu: np.ndarray
    status: Status
    bound: float


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
        nu0 = min_cost_incumbent(cols, lp.x[:form.n], form.model.c[:form.n], ub=form.model.col_upper[:form.n])
    if nu0 is None:
        cost_round = max_alpha_incumbent(cols, lp.x[:form.n], ub=form.model.col_upper[:form.n])
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
                          gap=_gap(res), objective=res.objective)
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


def alpha_by_probes(budget: SolveBudget, inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray,
                    g_form: Formulation, g_lp: SolveResult, nu_start: np.ndarray, alpha_0: float, alpha_lp: float,
                    gap: float, notes: list[str]) -> AlphaFound:
    """Goodput mode's α search when the max-α LP's rounding is short of its bound: a Lagrangian
    bound, feasibility MILPs at α fixed (`alpha_bound_probes`), the max-α MIP on the columns
    reduced-cost fixing keeps against the better plan, and, when a gap is left, the column
    generation bound against the α that would close it."""
    alpha_until = time.perf_counter() + budget.remaining() * GOODPUT_ALPHA_SHARE  # the probes are part of α's share
    t_lag = time.perf_counter()
    ub = g_form.model.col_upper[:g_form.n]
    lag_bound, tests = budget.timed(lambda: lagrangian_alpha_bound(cols, ub, g_lp, alpha_0, alpha_lp, tol=gap / 8,
                                                                   limit_s=budget.remaining() * LAGRANGIAN_SHARE))
    lag_s = time.perf_counter() - t_lag
    notes.append(f"alpha bound {lag_bound:.6g} from integer covers per model and phase at the LP's availability "
                 f"duals (LP {alpha_lp:.6g}; {tests} alpha tested, {lag_s:.1f} s)")
    nu0, probe_bound, probes = alpha_bound_probes(inputs, cols, nu_prev, g_form, g_lp, nu_start, alpha_lp, budget.run,
                                                  gap, budget.remaining() * PROBE_SHARE, hi0=lag_bound)
    notes.append(f"alpha bounds from feasibility MILPs at alpha fixed: {probes}")
    alpha_got = float(served(cols, nu0).min())
    if (probe_bound - alpha_got) / alpha_got <= gap:
        return AlphaFound(nu=nu0, status=Status.OPTIMAL, bound=probe_bound)
    got = polish(budget, inputs, cols, nu_prev, "goodput", 1.0, g_form, g_lp, nu0, gap=gap,
                 limit=max(alpha_until - time.perf_counter(), 0.05), use_start=GOODPUT_ALPHA_START,
                 alpha_cap=probe_bound)
    alpha_bound = min(got.bound, probe_bound)
    alpha_got = float(served(cols, got.nu).min())
    notes.append(f"alpha ILP on {got.how}")
    if (alpha_bound - alpha_got) / alpha_got > gap and alpha_got > 0:
        # the knapsacks' best multipliers (column generation) against the α that would
        # close the gap: a proof there ends phase 1 within it
        target = alpha_got * (1 + gap * (1 - 1e-6))
        t_dw = time.perf_counter()
        dw_bound, tests = budget.timed(lambda: column_generation_alpha_bound(
            cols, ub, g_lp, target, alpha_bound, tol=gap / 8, limit_s=budget.remaining() * DW_SHARE))
        notes.append(f"alpha bound {dw_bound:.6g} from column generation over the integer covers "
                     f"(from {target:.6g}; {tests} alpha tested, {time.perf_counter() - t_dw:.1f} s)")
        alpha_bound = min(alpha_bound, dw_bound)
    status = Status.OPTIMAL if (alpha_bound - alpha_got) / alpha_got <= gap else got.status
    return AlphaFound(nu=got.nu, status=status, bound=alpha_bound)


def alpha_mip(budget: SolveBudget, cols: Columns, g_form: Formulation, start_x: np.ndarray | None, alpha_0: float,
              alpha_lp: float, gap: float, notes: list[str]) -> AlphaFound | None:
    """The max-α MIP on every column, from HiGHS's own heuristics: measured on the synthetic scarce
    cases, they find better plans from scratch than from the rounded plan, which is kept as a
    fallback. None (the note says why) without any plan."""
    g_res = budget.run(g_form, limit=budget.remaining() * GOODPUT_ALPHA_SHARE, gap=gap)
    got = decode_counts(g_form, g_res)
    if start_x is not None and (got is None or served(cols, got).min() < alpha_0):
        got = start_x[:g_form.n].astype(np.int64)
    if got is None:
        notes.append(f"goodput ILP ended {g_res.status.value} without a plan ({g_res.message})")
        return None
    status = g_res.status if g_res.x is not None else Status.TIME_LIMIT
    bound = min(alpha_lp, float(g_res.bound)) if math.isfinite(g_res.bound) else alpha_lp
    return AlphaFound(nu=got, status=status, bound=bound)


def alpha_pass(budget: SolveBudget, inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray,
               start: GoodputStart, gap: float, notes: list[str]) -> AlphaFound | None:
    """Goodput mode, phase 1: maximize α, from the max-α LP's bound and rounded plan (or, when the
    cost LP meets every demand, on the columns it ranks best). None without any plan."""
    g_form = formulate(inputs, cols, nu_prev, mode="goodput")
    assert g_form.alpha_col is not None
    alpha_lp = math.inf
    start_x = None
    use_lp = budget.options.backend == "highs" and start.cost_lp is None
    g_lp = budget.run(relaxed(g_form)) if use_lp else None
    if g_lp is not None and g_lp.x is not None and g_lp.status is Status.OPTIMAL:
        alpha_lp = min(float(g_lp.objective), 1.0)
        nu0 = max_alpha_incumbent(cols, g_lp.x[:g_form.n], ub=g_form.model.col_upper[:g_form.n])
        start_x = np.zeros(g_form.model.num_cols)
        start_x[:g_form.n] = nu0
        start_x[g_form.alpha_col] = min(float(served(cols, nu0).min()), 1.0)
    alpha_0 = float(start_x[g_form.alpha_col]) if start_x is not None else -math.inf
    if start.cost_lp is not None:
        # the cost LP meets every demand, so α's bound is 1 (its cap); the MIP gets the columns the
        # cost LP ranks best per (model, phase), from the LP's rounding
        nu, status, bound, how = alpha_on_ranked(inputs, cols, nu_prev, start.cost_form, start.cost_lp,
                                                 start.cost_round, budget.run, gap,
                                                 budget.remaining() * GOODPUT_ALPHA_SHARE)
        notes.append(f"alpha ILP on {how}")
        return AlphaFound(nu=nu, status=status, bound=bound)
    if start_x is not None and alpha_0 > 0 and (alpha_lp - alpha_0) / alpha_0 <= gap:
        # the LP bound proves the rounded plan
        return AlphaFound(nu=start_x[:g_form.n].astype(np.int64), status=Status.OPTIMAL, bound=alpha_lp)
    if start_x is not None and alpha_0 > 0 and g_lp is not None and g_lp.reduced_costs is not None:
        return alpha_by_probes(budget, inputs, cols, nu_prev, g_form, g_lp, start_x[:g_form.n].astype(np.int64),
                               alpha_0, alpha_lp, gap, notes)
    return alpha_mip(budget, cols, g_form, start_x, alpha_0, alpha_lp, gap, notes)


def cost_at_alpha_ranked(budget: SolveBudget, inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray,
                         c_form: Formulation, c_lp: SolveResult, c_alpha: float, found: AlphaFound, gap: float,
                         foreign: bool, *, method: str, notes: list[str]) -> Plan:
    """Goodput mode's cost pass on a large model: from the cheaper of the max-α plan and the rounded
    LP plan, the MIP on the columns that can beat it (`polish`)."""
    assert c_lp.x is not None
    nu0 = found.nu
    price = c_form.model.c[:c_form.n]
    rounded = min_cost_incumbent(cols, c_lp.x[:c_form.n], price, alpha=c_alpha, ub=c_form.model.col_upper[:c_form.n])
    if rounded is not None and float(price @ rounded) < float(price @ found.nu):
        nu0 = rounded
    got = polish(budget, inputs, cols, nu_prev, "cost", c_alpha, c_form, c_lp, nu0, gap=gap, foreign=foreign)
    notes.append(f"cost at alpha* on {got.how}; gap {got.gap:.2%}")
    status = found.status if found.status is not Status.OPTIMAL and got.status is Status.OPTIMAL else got.status
    return build_plan(inputs, cols, got.nu, nu_prev, method=method, status=status, solve_s=budget.solve_s,
                      gap=got.gap, objective=got.objective, goodput_mode=True, notes=tuple(notes))


def cost_at_alpha_mip(budget: SolveBudget, inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray,
                      c_form: Formulation, c_alpha: float, found: AlphaFound, fallback: Plan, gap: float, *,
                      method: str, notes: list[str]) -> Plan:
    """Goodput mode's cost pass: the MIP on every column from the max-α plan, its gap against the
    better of its own bound and the Lagrangian one (integer covers per model and phase, from the
    LP: a few hundredths of a second at this size). The max-α plan when the MIP finds none."""
    lag = None
    if budget.options.backend == "highs":
        c_lp = budget.run(relaxed(c_form))
        if c_lp.status is Status.OPTIMAL:
            got_lag = budget.timed(lambda: lagrangian_cost_bound(
                cols, c_form.model.c[:c_form.n], c_form.model.col_upper[:c_form.n], c_alpha, c_lp,
                skip=nu_prev > 0, limit_s=budget.remaining() * LAGRANGIAN_SHARE))
            lag = got_lag[0] if got_lag is not None and math.isfinite(got_lag[0]) else None
    c_res = budget.run(c_form, gap=gap, start_x=start_vector(c_form, found.nu, nu_prev))
    c_got = decode_counts(c_form, c_res)
    if c_got is None:
        notes.append(f"cost at alpha* ended {c_res.status.value} without a plan; plan is the max-alpha solution")
        return _with(fallback, status=c_res.status if c_res.status is not Status.INFEASIBLE else Status.ERROR,
                     notes=notes, solve_s=budget.solve_s)
    status = c_res.status
    cost_gap = _gap(c_res)
    if lag is not None and (not math.isfinite(c_res.bound) or lag > c_res.bound):
        cost_gap = max((c_res.objective - lag) / max(abs(c_res.objective), 1e-12), 0.0)
        notes.append(f"cost at alpha*: bound {lag:.6g} from integer covers per model and phase (the MIP's "
                     f"{c_res.bound:.6g}); gap {cost_gap:.2%}")
        if cost_gap <= gap:
            status = Status.OPTIMAL
    if found.status is not Status.OPTIMAL and status is Status.OPTIMAL:
        status = found.status  # alpha* itself was not proved optimal
    return build_plan(inputs, cols, c_got, nu_prev, method=method, status=status, solve_s=budget.solve_s,
                      gap=cost_gap, objective=c_res.objective, goodput_mode=True, notes=tuple(notes))


def goodput_mode(budget: SolveBudget, inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray,
                 start: GoodputStart, *, method: str, notes: list[str]) -> Plan | None:
    """Goodput mode: maximize α (`alpha_pass`), then minimize cost with α ≥ α* − `ALPHA_SLACK`
    from the max-α plan. None when phase 1 finds no plan at all."""
    gap = max(budget.options.mip_gap, GOODPUT_GAP)
    found = alpha_pass(budget, inputs, cols, nu_prev, start, gap, notes)
    if found is None:
        return None
    alpha_star = float(min(max(served(cols, found.nu).min(), 0.0), 1.0))
    alpha_bound = found.bound
    alpha_gap = (alpha_bound - alpha_star) / alpha_star if alpha_star > 0 and math.isfinite(alpha_bound) else None
    notes.append(f"max alpha = {alpha_star:.6g} ({found.status.value}"
                 + (f", bound {min(alpha_bound, 1.0):.6g}, gap {max(alpha_gap, 0.0):.2%}" if alpha_gap is not None else "")
                 + ")")
    fallback = build_plan(inputs, cols, found.nu, nu_prev, method=method,
                          status=Status.TIME_LIMIT if found.status is Status.TIME_LIMIT else Status.FEASIBLE,
                          solve_s=budget.solve_s, gap=None, goodput_mode=True)
    if budget.remaining() <= 0.05:
        notes.append("no time left to minimize cost at alpha*; plan is the max-alpha solution")
        return _with(fallback, status=Status.TIME_LIMIT, notes=notes)
    c_alpha = max(alpha_star - ALPHA_SLACK, 0.0)
    c_form = formulate(inputs, cols, nu_prev, mode="cost", alpha=c_alpha)
    cost_lp = start.cost_lp
    foreign = cost_lp is not None and cost_lp.reduced_costs is not None and cost_lp.x is not None
    if foreign:
        c_lp = cost_lp  # the cost LP at α = 1: it ranks the columns and prices the nodes (`polish`)
    else:
        large = budget.options.backend == "highs" and cols.num_cols >= REDUCE_COLUMNS
        c_lp = budget.run(relaxed(c_form)) if large else None
    if c_lp is not None and c_lp.status is Status.OPTIMAL and c_lp.reduced_costs is not None and c_lp.x is not None:
        return cost_at_alpha_ranked(budget, inputs, cols, nu_prev, c_form, c_lp, c_alpha, found, gap, foreign,
                                    method=method, notes=notes)
    return cost_at_alpha_mip(budget, inputs, cols, nu_prev, c_form, c_alpha, found, fallback, gap,
                             method=method, notes=notes)


def solve_allocation(inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray, options: SolveOptions,
                     *, method: str = "coral") -> AllocationResult:
    """Cost ILP (`cost_pass`); when infeasible (or no incumbent), goodput mode (`goodput_mode`):
    maximize α, then minimize cost at α fixed (minus `ALPHA_SLACK`). The time limit covers all
    solves together.

    How goodput mode stays inside an epoch on large, scarce instances:
    - the cost ILP's LP relaxation is solved first; when it is infeasible so is the ILP, and
      goodput mode starts without a branch-and-bound proof of infeasibility;
    - the α search solves its LP relaxation first: its optimum bounds α, and its rounding
      (`incumbent.max_alpha_incumbent`) is an incumbent that ends the search when it is within
      the gap, and the answer when the ILP finds nothing better; the ILP stops at a relative gap
      of `max(mip_gap, GOODPUT_GAP)` or after `GOODPUT_ALPHA_SHARE` of the time left;
    - the cost pass starts from the α search's plan (feasible for it by construction), so it
      always has an incumbent and stops at the same gap or when the time is up.
    The notes report α, its bound and both gaps.

    Returns:
        `Allocated` (the plan and the notes), or `NoPlan` when no solve produced an incumbent
        (the caller falls back).
    """
    budget = SolveBudget(options)
    notes: list[str] = []
    got = cost_pass(budget, inputs, cols, nu_prev, method=method, notes=notes)
    if isinstance(got, Plan):
        return Allocated(plan=got, notes=tuple(notes))
    plan = goodput_mode(budget, inputs, cols, nu_prev, got, method=method, notes=notes)
    if plan is None:
        status = Status.ERROR if any("error" in n for n in notes) else Status.TIME_LIMIT
        return NoPlan(status=status, notes=tuple(notes))
    return Allocated(plan=plan, notes=tuple(notes))


def _with(plan: Plan, **changes: object) -> Plan:
    if "notes" in changes:
        changes["notes"] = tuple(changes["notes"])  # type: ignore[arg-type]
    return replace(plan, **changes)  # type: ignore[arg-type]
