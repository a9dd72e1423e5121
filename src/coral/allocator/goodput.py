"""Goodput mode of the allocation ILP (DESIGN §4): when the demand cannot be met, maximize the
served fraction α (`alpha_pass`: the max-α LP and its rounding, a Lagrangian bound, feasibility
MILPs at α fixed, the max-α MIP), then minimize the cost at α* (`cost_at_alpha_ranked` /
`cost_at_alpha_mip`). The formulation, its constraint labels and the shared passes are
`coral.allocator.ilp`'s; `coral.allocator.search` calls `goodput_mode` after the cost pass."""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from coral.allocator import ilp
from coral.allocator.bounds import (
    column_generation_alpha_bound,
    lagrangian_alpha_bound,
    lagrangian_cost_bound,
)
from coral.allocator.ilp import (
    LAGRANGIAN_SHARE,
    Formulation,
    GoodputStart,
    SolveBudget,
    best_per_group,
    build_plan,
    decode_counts,
    polish,
    relaxed,
    result_gap,
    start_vector,
    sub_columns,
    with_changes,
)
from coral.allocator.incumbent import max_alpha_incumbent, min_cost_incumbent, served
from coral.allocator.inputs import AllocationInputs, Columns
from coral.allocator.plan import Plan
from coral.solver import SolveResult, Status

ALPHA_SLACK = 1e-6  # phase 2 of goodput mode keeps alpha >= alpha* - ALPHA_SLACK
GOODPUT_GAP = 5e-3  # goodput mode solves α and the cost at α to this relative gap (or mip_gap, if looser)
GOODPUT_ALPHA_SHARE = 0.5  # of the time left, what the α search may use (the cost pass gets the rest)
GOODPUT_ALPHA_START = False  # the α ILP starts from HiGHS's own heuristics, not the rounded plan
PROBE_SHARE = 0.15  # of the time left, what those probes may use together
DW_SHARE = 0.15  # of the time left, what the column-generation α bound may use (`bounds.column_generation_alpha_bound`)
PROBE_S = 0.6  # the most one feasibility MILP bounding goodput mode's α may take (`alpha_bound_probes`)


def alpha_on_ranked(inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray, cost_form: Formulation | None,
                     cost_lp: SolveResult, nu0: np.ndarray, run: Callable[..., SolveResult], gap: float,
                     limit: float) -> tuple[np.ndarray, Status, float, str]:
    """Goodput mode's α search when the cost LP meets every demand but no rounding of it does: the
    max-α MIP on the columns of least reduced cost in that LP per (model, phase), started from
    `nu0`. Returns (ν, status, α bound = 1, which columns, for the notes)."""
    assert cost_form is not None
    per_group = ilp.MIP_COLUMNS // max(len(cols.groups), 1)
    idx = np.flatnonzero(best_per_group(cols, cost_form, cost_lp, per_group) | (nu0 > 0) | (nu_prev > 0))
    sub_cols = sub_columns(cols, idx)
    sub = ilp.formulate(inputs, sub_cols, nu_prev[idx], mode="goodput")
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
        form = ilp.formulate(inputs, sub_cols, nu_prev[keep], mode="cost", alpha=a)
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


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class AlphaFound:
    """Goodput mode's phase 1: the max-α plan `nu`, its status and the bound on α."""

    nu: np.ndarray
    status: Status
    bound: float


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
    g_form = ilp.formulate(inputs, cols, nu_prev, mode="goodput")
    assert g_form.alpha_col is not None
    alpha_lp = math.inf
    start_x = None
    use_lp = budget.options.backend == "highs" and start.cost_lp is None
    g_lp = budget.run(relaxed(g_form)) if use_lp else None
    if g_lp is not None and g_lp.x is not None and g_lp.status is Status.OPTIMAL:
        alpha_lp = min(float(g_lp.objective), 1.0)
        nu0 = max_alpha_incumbent(cols, g_lp.x[:g_form.n], ub=g_form.incumbent_ub)
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
    rounded = min_cost_incumbent(cols, c_lp.x[:c_form.n], price, alpha=c_alpha, ub=c_form.incumbent_ub)
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
        return with_changes(fallback, status=c_res.status if c_res.status is not Status.INFEASIBLE else Status.ERROR,
                     notes=notes, solve_s=budget.solve_s)
    status = c_res.status
    cost_gap = result_gap(c_res)
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
        return with_changes(fallback, status=Status.TIME_LIMIT, notes=notes)
    c_alpha = max(alpha_star - ALPHA_SLACK, 0.0)
    c_form = ilp.formulate(inputs, cols, nu_prev, mode="cost", alpha=c_alpha)
    cost_lp = start.cost_lp
    foreign = cost_lp is not None and cost_lp.reduced_costs is not None and cost_lp.x is not None
    if foreign:
        c_lp = cost_lp  # the cost LP at α = 1: it ranks the columns and prices the nodes (`polish`)
    else:
        large = budget.options.backend == "highs" and cols.num_cols >= ilp.REDUCE_COLUMNS
        c_lp = budget.run(relaxed(c_form)) if large else None
    if c_lp is not None and c_lp.status is Status.OPTIMAL and c_lp.reduced_costs is not None and c_lp.x is not None:
        return cost_at_alpha_ranked(budget, inputs, cols, nu_prev, c_form, c_lp, c_alpha, found, gap, foreign,
                                    method=method, notes=notes)
    return cost_at_alpha_mip(budget, inputs, cols, nu_prev, c_form, c_alpha, found, fallback, gap,
                             method=method, notes=notes)
