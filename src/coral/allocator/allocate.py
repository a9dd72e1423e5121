"""The allocator's entry points: `allocate` (Coral's ILP or a baseline), `tight_availability`
(DESIGN §7's scarce setting) and `verify_plan` (an independent re-check of any plan)."""
from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import replace

import numpy as np

from coral.allocator.baselines import cauchy, greedy_per_group
from coral.allocator.ilp import build_plan, prev_counts, sub_columns
from coral.allocator.inputs import (
    AllocationInputs,
    Columns,
    _table,
    build_columns,
    build_inputs,
    find_template,
)
from coral.allocator.plan import Plan
from coral.allocator.search import Allocated, solve_allocation
from coral.allocator.spot import is_spot_region, spot_discount, spot_region
from coral.allocator.spot_caps import spot_cap_rows
from coral.errors import CoralError
from coral.perf.model import Phase
from coral.scenario import Scenario
from coral.solver import SolveOptions, Status
from coral.templates.planning import plan_inputs
from coral.templates.template import Template, TemplateLibrary

METHODS: tuple[str, ...] = ("coral", "homo", "cauchy", "template-greedy")
DEFAULT_OPTIONS = SolveOptions(backend="highs", time_limit_s=60.0, mip_gap=1e-4)
TIGHT_MARGIN = {"core": 0.25, "extended": 0.75}  # DESIGN §7; any other scenario: 0.25
_REL_TOL = 1e-6

PrevPlan = Plan | Mapping[tuple[str, str], int]


def _prev_dict(prev: PrevPlan | None) -> dict[tuple[str, str], int] | None:
    if prev is None:
        return None
    items = prev.counts() if isinstance(prev, Plan) else dict(prev)
    out: dict[tuple[str, str], int] = {}
    for key, n in items.items():
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
            raise CoralError(f"prev[{key}] must be a whole number of instances >= 0, got {n!r}")
        out[key] = int(n)
    return out


def allocate(scenario: Scenario, library: TemplateLibrary, *, method: str = "coral",
             demand: Mapping[tuple[str, Phase | str], float] | None = None,
             availability: Mapping[tuple[str, str], int] | None = None,
             prev: PrevPlan | None = None, options: SolveOptions | None = None,
             nearest_latency_ms: Mapping[tuple[str, Phase | str], float] | None = None,
             mode: str = "auto", spot_down: Collection[tuple[str, str]] = ()) -> Plan:
    """Plan which templates to run where, at least cost (or most goodput when nodes are short).

    Args:
        scenario: models (order, SLOs, region restrictions, nominal demand), prices, availability,
            planner settings (`init_s`, `epoch_s`).
        library: the serving templates.
        method: "coral" (the joint ILP, DESIGN §4), "homo", "cauchy" or "template-greedy".
        demand: tokens/s per (model, phase) replacing the nominal demand (e.g. observed demand
            from the simulator); pairs not given keep the nominal value.
        availability: nodes per (region, config) replacing the scenario's; pairs not given keep it.
        prev: the running plan (a `Plan`, or {(region, template key): count}); instances beyond
            it pay the start-up penalty `p·init_s/3600` (coral optimizes it, the baselines only
            report it).
        options: solver backend, time limit (covering the solve: the columns and every solve;
            not building the inputs, whose capacity targets replay the traffic whatever the
            limit) and MIP gap; default HiGHS, 60 s, gap 1e-4.
        nearest_latency_ms: per (model, phase), the latency of the closest template that missed
            the SLO, quoted in the error when a model has no template (the library may know it).
        mode: "auto" (disaggregated or colocated, the cheaper per model), "disagg" or
            "colocated" (every model so); the baselines always plan disaggregated.
        spot_down: (region, config) spot pools that cannot be had now (a preemption took them
            and the capacity is not back): no spot instance using one starts; those running there
            (`prev`) may stay. Spot offers come
            from the scenario (`regions[].spot`); with none, nothing about spot changes.

    Returns:
        A `Plan`. Its status is the solver's; on a time-out or solver failure without any plan
        the `coral` method falls back to `template-greedy` (status TIME_LIMIT / ERROR and a note).

    Raises:
        CoralError: unknown method; negative / NaN / infinite demand, price or availability (the
            field named); a (model, phase) with demand but no usable template (model, phase, SLO
            and the closest template's latency when known).
    """
    if method not in METHODS:
        raise CoralError(f"unknown allocation method {method!r}; valid: {', '.join(METHODS)}")
    inputs = build_inputs(scenario, library, demand=demand, availability=availability,
                          nearest_latency_ms=nearest_latency_ms, mode=mode, spot_down=spot_down)
    # the time limit is the solve's: a first run that spends it replaying the traffic for the
    # capacity targets (cached afterwards) would otherwise stop the solve early on its first run only
    plan = allocate_inputs(inputs, method=method, prev=prev, options=options)
    return replace(plan, first_token={m.model: m.kv.first_token for m in plan_inputs(scenario)})


def allocate_inputs(inputs: AllocationInputs, *, method: str = "coral", prev: PrevPlan | None = None,
                    options: SolveOptions | None = None) -> Plan:
    """`allocate` on already checked inputs (the simulator may build them once per epoch)."""
    start = time.perf_counter()
    options = options or DEFAULT_OPTIONS
    prev_d = _prev_dict(prev)
    if method == "coral":
        return _one_mode_per_model(inputs, prev_d, options, start)
    inputs = replace(inputs, mode="disagg")  # the baselines plan disaggregated serving, as the paper defines them
    if method in ("homo", "cauchy"):
        cols = build_columns(inputs, max_nodes=1)  # single-node templates only
    else:
        cols = build_columns(inputs)
    nu_prev = prev_counts(inputs, cols, prev_d)
    limit = cols.start_limit(nu_prev)
    nu = cauchy(inputs, cols, limit) if method == "cauchy" else greedy_per_group(inputs, cols, limit)
    plan = build_plan(inputs, cols, nu, nu_prev, method=method, status=Status.FEASIBLE,
                      solve_s=time.perf_counter() - start, gap=None)
    short = [f"{d.model}/{d.phase.value} {d.served_fraction:.3g}" for d in plan.demand if d.served_fraction < 1]
    if short:
        plan = replace(plan, notes=("ran out of nodes; served fraction: " + ", ".join(short),))
    return plan


def _one_mode_per_model(inputs: AllocationInputs, prev_d: dict[tuple[str, str], int] | None,
                        options: SolveOptions, start: float) -> Plan:
    """Coral's plan, with each model served in one mode.

    The ILP counts a colocated template's `Θ_P` and `Θ_D` in the same rows as the disaggregated
    templates', so in "auto" it may give a model both kinds ("mix"). Such a plan is only sound if
    the router sends each kind the share of the requests its capacity was sized for: a request
    decodes where it was prefilled when that is a colocated instance, so a mix whose disaggregated
    decode capacity is short of its prefill share (the ILP lets the colocated `Θ_D` cover it)
    misses the TPOT on that path (measured: Qwen3-32B at 68.6 % in `coral simulate core`). The
    least-work router balances prefill work only, so each mixed model is re-planned once forced
    to "disagg" and once to "colocated", keeping the cheaper (the one serving more of the demand
    first, in goodput mode), one model at a time. Each re-plan has the whole time limit.
    """
    plan = _coral_plan(inputs, prev_d, options, start)
    while mixed := [m for m, kind in plan.model_modes().items()
                    if kind == "mix" and m not in (inputs.model_modes or {})]:
        m = mixed[0]  # a re-plan may mix another model: each is fixed once, so this ends
        tries = []
        for forced in ("disagg", "colocated"):
            one = replace(inputs, model_modes={**(inputs.model_modes or {}), m: forced})
            try:
                tries.append((one, _coral_plan(one, prev_d, options, time.perf_counter())))
            except CoralError:
                continue  # no template of that kind for m: the other one stands
        if not tries:
            break  # neither kind alone plans m (it cannot happen when auto had columns of both)
        inputs, plan = min(tries, key=lambda ip: (-ip[1].alpha, ip[1].cost_usd_per_h))
    return replace(plan, solve_s=time.perf_counter() - start)


def _coral_plan(inputs: AllocationInputs, prev_d: dict[tuple[str, str], int] | None,
                options: SolveOptions, start: float) -> Plan:
    """The joint ILP's plan on `inputs` (no mix repair), or the greedy fallback without an incumbent."""
    method = "coral"
    cols = build_columns(inputs)
    nu_prev = prev_counts(inputs, cols, prev_d)
    if not cols.groups:
        nu = np.zeros(cols.num_cols, dtype=np.int64)
        return build_plan(inputs, cols, nu, nu_prev, method=method, status=Status.OPTIMAL,
                          solve_s=time.perf_counter() - start, gap=0.0, objective=0.0,
                          notes=("no demand",))
    fast = _frontier_plan(inputs, cols, nu_prev, options, method=method)
    if fast is not None:
        return replace(fast, solve_s=time.perf_counter() - start)
    # the time limit covers the whole call: what the columns and the fast path took is spent
    left = max(options.time_limit_s - (time.perf_counter() - start), 0.05)
    got = solve_allocation(inputs, cols, nu_prev, replace(options, time_limit_s=left), method=method)
    if isinstance(got, Allocated):
        return got.plan
    # no incumbent at all: fall back to the greedy heuristic, keeping the solver's verdict
    nu = greedy_per_group(inputs, cols, cols.start_limit(nu_prev))
    return build_plan(inputs, cols, nu, nu_prev, method=method, status=got.status,
                      solve_s=time.perf_counter() - start, gap=None,
                      notes=(*got.notes, "fallback: template-greedy plan"))


def frontier_columns(inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray) -> np.ndarray:
    """Columns on the cost/throughput frontier of their (model, phase), plus the running ones.

    Without availability limits a column `j` is never needed when another column `k` of the same
    (model, phase) has `Θ_k ≥ Θ_j` and `p_k + π_k ≤ p_j + π_j` (an instance of `j` can always be
    swapped for one of `k`); `p + π` bounds any column's marginal cost, running or not. Of exact
    duplicates (same Θ and cost) the first column is kept. Returns a boolean mask over columns.

    In O(columns): visit the columns by Θ descending; a column is on the frontier iff it costs
    less than every column visited before it. Templates of equal Θ form one block (numbered once
    per library, `Columns.theta_block`), of which only the cheapest column can be kept.

    With spot markets, a column's capacity is its template's `Θ` times the market's discount for
    its node count, so the blocks of equal `Θ` do not hold: the frontier is found by sorting, on
    the capacity each column counts. A column under a spot share cap (C5) is always kept (a cap
    can bind on the column that dominates it).
    """
    if cols.market_spot is not None and cols.market_spot.any():
        capped = np.zeros(cols.num_cols, dtype=bool)
        capped[spot_cap_rows(inputs, cols).col] = True
        free = np.flatnonzero(~capped)
        keep = capped.copy()
        keep[free] = _frontier_by_sort(inputs, sub_columns(cols, free), nu_prev[free])
        return keep
    if cols.theta_block is None:
        return _frontier_by_sort(inputs, cols, nu_prev)
    cost = cols.price * (1.0 + inputs.init_s / inputs.horizon_s)
    keep = nu_prev > 0
    n_blocks = int(cols.theta_block.max()) + 1 if cols.theta_block.size else 0
    block = cols.theta_block[cols.col_t]
    block_min = np.full(n_blocks, np.inf)
    np.minimum.at(block_min, block, cost)
    at_min = np.flatnonzero(cost == block_min[block])  # ascending: the first one per block is kept
    blocks_with, first = np.unique(block[at_min], return_index=True)
    winner = np.full(n_blocks, -1, dtype=np.int64)
    winner[blocks_with] = at_min[first]
    # the least cost over the blocks of higher Θ in the same table (blocks are table-major; a model's
    # colocated templates are a table of their own: they serve two rows, so only they dominate them)
    tables = cols.table if cols.table is not None else cols.group
    tmpl_group = np.full(n_blocks, -1, dtype=np.int64)
    tmpl_group[cols.theta_block] = tables
    before = np.full(n_blocks, np.inf)
    for gi in range(int(tables.max()) + 1 if tables.size else 0):
        sel = np.flatnonzero(tmpl_group == gi)
        if sel.size > 1:
            before[sel[1:]] = np.minimum.accumulate(block_min[sel])[:-1]
    win = (winner >= 0) & (block_min < before)
    keep[winner[win]] = True
    return _keep_colocated(cols, keep)


def _keep_colocated(cols: Columns, keep: np.ndarray) -> np.ndarray:
    """Keep every colocated column: it serves two rows, so a higher `Θ_P` at a lower cost does not
    dominate it unless its `Θ_D` is higher too (a model's colocated templates are few)."""
    if cols.cross_group is not None:
        keep |= cols.cross_group[cols.col_t] >= 0
    return keep


def _frontier_by_sort(inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray) -> np.ndarray:
    """`frontier_columns` by sorting all columns (for Columns built without Θ blocks; also the
    reference the tests hold the linear pass to)."""
    theta = cols.col_theta()
    grp = (cols.table if cols.table is not None else cols.group)[cols.col_t]
    cost = cols.price * (1.0 + inputs.init_s / inputs.horizon_s)
    keep = nu_prev > 0
    order = np.lexsort((-theta, cost, grp))  # by group, then cost ascending, then throughput descending
    g_sorted, t_sorted = grp[order], theta[order]
    for gi in np.unique(g_sorted):
        sel = np.flatnonzero(g_sorted == gi)
        ts = t_sorted[sel]
        prior = np.concatenate([[-np.inf], np.maximum.accumulate(ts)[:-1]])
        keep[order[sel[ts > prior]]] = True
    return _keep_colocated(cols, keep)


def _frontier_plan(inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray, options: SolveOptions, *,
                   method: str) -> Plan | None:
    """Fast path: solve without availability limits on the frontier columns; when that plan
    happens to respect availability it is optimal for the full problem (the full feasible set is
    a subset of the relaxed one, and the frontier loses nothing without limits). Otherwise None.
    """
    keep = frontier_columns(inputs, cols, nu_prev)
    idx = np.flatnonzero(keep)
    if idx.size == cols.num_cols:
        return None  # nothing to gain
    unbounded = np.where(cols.sold, np.inf, 0.0)
    sub = replace(cols, col_t=cols.col_t[idx], col_r=cols.col_r[idx], price=cols.price[idx],
                  ub=np.full(idx.size, np.inf), avail=unbounded)
    got = solve_allocation(inputs, sub, nu_prev[idx], options, method=method)
    if not isinstance(got, Allocated) or got.plan.goodput_mode or got.plan.status is not Status.OPTIMAL:
        return None
    plan, notes = got.plan, got.notes
    nu = np.zeros(cols.num_cols, dtype=np.int64)
    nu[idx] = _sub_counts(inputs, plan, sub)
    used = np.zeros_like(cols.avail)
    nz = np.flatnonzero(nu)
    np.add.at(used, cols.col_r[nz], cols.usage[cols.col_t[nz]] * nu[nz, None])
    if np.any(used > cols.avail + 1e-9):
        return None  # availability binds: the full ILP decides
    return build_plan(inputs, cols, nu, nu_prev, method=method, status=plan.status, solve_s=plan.solve_s,
                      gap=plan.gap, objective=plan.objective,
                      notes=(*notes, f"solved on {idx.size} of {cols.num_cols} columns (cost/throughput frontier); "
                             "availability does not bind, so the plan is optimal for all columns"))


def _sub_counts(inputs: AllocationInputs, plan: Plan, sub: Columns) -> np.ndarray:
    """Instances per sub-column, read back from the plan's instances (a lookup per instance: no
    other template object is made)."""
    out = np.zeros(sub.num_cols, dtype=np.int64)
    r_of = {r: i for i, r in enumerate(inputs.regions)}
    for i in plan.instances:
        t = sub.template_index(i.template.key)
        hit = (np.flatnonzero((sub.col_t == t) & (sub.col_r == r_of[i.market])) if t is not None
               else np.zeros(0, dtype=np.int64))
        if len(hit):
            out[hit[0]] = i.count
    return out


def tight_availability(scenario: Scenario, library: TemplateLibrary, *, margin: float | None = None,
                       demand: Mapping[tuple[str, Phase | str], float] | None = None,
                       options: SolveOptions | None = None, floor: int = 0) -> dict[tuple[str, str], int]:
    """DESIGN §7's scarce setting, as the paper sizes it: GPUs `margin` above the estimated
    minimum demand, spread over every offer that can serve it.

    The minimum is method-neutral: the fewest GPUs any mix of the library's templates needs to
    meet each (model, phase)'s demand (the allocation ILP with every node priced at its GPU count,
    availability unbounded). Each (model, phase)'s `(1 + margin)·G_min` GPUs are then spread evenly
    over every sold (region, config) some template of it can use (in a region the model may run
    in): `(1 + margin)·G_g / offers_g` GPUs per offer. An offer's nodes are the sum over groups,
    rounded up, at least `floor`. No single shape gets enough for one method's favourite plan, so
    the availability binds for every method, and nothing in it comes from Coral's cost-optimal plan.

    Args:
        scenario: the scenario (its name picks the default margin: core 0.25, extended 0.75,
            anything else 0.25).
        library: the templates.
        margin: override the margin (>= 0).
        demand: as for `allocate` (default: the planned capacity).
        options: solver options for the minimum-GPU plan.
        floor: the fewest nodes any sold (region, config) gets.

    Returns:
        {(region, config): nodes} for every sold pair.

    Raises:
        CoralError: a negative / non-finite margin or floor, or anything `allocate` raises.
    """
    m = TIGHT_MARGIN.get(scenario.name, 0.25) if margin is None else margin
    if not (isinstance(m, int | float) and math.isfinite(m) and m >= 0):
        raise CoralError(f"margin must be a finite number >= 0, got {margin!r}")
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 0:
        raise CoralError(f"floor must be a whole number >= 0, got {floor!r}")
    inputs = build_inputs(scenario, library, demand=demand, unbounded=True)
    gpus = {c.name: c.count for c in scenario.configs}
    by_gpus = dataclasses.replace(inputs, prices={k: float(gpus.get(k[1], 1)) for k in inputs.prices}, init_s=0.0)
    plan = allocate_inputs(by_gpus, method="coral", options=options)
    if plan.status not in (Status.OPTIMAL, Status.FEASIBLE, Status.TIME_LIMIT) or plan.alpha < 1 - _REL_TOL:
        raise CoralError(f"scenario {scenario.name}: the minimum-GPU plan behind tight_availability ended "
                         f"{plan.status.value} (alpha {plan.alpha:.3g}); {'; '.join(plan.notes)}")
    share: dict[tuple[str, str], float] = dict.fromkeys(inputs.prices, 0.0)
    used: dict[tuple[str, Phase], float] = {}
    for inst in plan.instances:
        g = (inst.template.model, inst.template.phase)
        used[g] = used.get(g, 0.0) + inst.count * sum(gpus.get(c, 1) for c in inst.template.nodes)
    for g, g_min in used.items():
        names, usage, _ = _table(inputs.templates.get(g, ())).arrays()  # the library's arrays, no objects
        shapes = {names[k] for k in range(len(names)) if usage[:, k].any()}
        offers = [(r, c) for (r, c) in inputs.prices if c in shapes and r in inputs.allowed_regions[g[0]]
                  and not is_spot_region(r)]  # a spot market has its region's on-demand count
        for key in offers:
            share[key] += (1 + m) * g_min / len(offers)
    return {key: max(floor, math.ceil(v / gpus.get(key[1], 1) - 1e-9)) for key, v in share.items()}


def _demand_problems(plan: Plan, inputs: AllocationInputs, cap: Mapping[tuple[str, Phase], float]) -> list[str]:
    """`verify_plan`'s demand checks: each (model, phase)'s demand line, capacity ≥ α·demand, α the least fraction."""
    problems: list[str] = []
    fractions = []
    lines = {(d.model, d.phase): d for d in plan.demand}
    for g in inputs.groups:
        d = inputs.demand[g]
        have = cap.get(g, 0.0)
        line = lines.get(g)
        if line is None:
            problems.append(f"{g[0]}/{g[1].value}: no demand line")
        else:
            if not math.isclose(line.demand_tok_per_s, d, rel_tol=1e-9, abs_tol=1e-9):
                problems.append(f"{g[0]}/{g[1].value}: demand line {line.demand_tok_per_s} != {d}")
            if not math.isclose(line.capacity_tok_per_s, have, rel_tol=1e-9, abs_tol=1e-9):
                problems.append(f"{g[0]}/{g[1].value}: capacity line {line.capacity_tok_per_s} != {have}")
        if have < plan.alpha * d * (1 - _REL_TOL) - 1e-9:
            problems.append(f"{g[0]}/{g[1].value}: capacity {have:.6g} < alpha {plan.alpha:.6g} x demand {d:.6g}")
        fractions.append(1.0 if d <= 0 else min(1.0, have / d))
    least = min(fractions, default=1.0)
    if not math.isclose(least, plan.alpha, rel_tol=1e-9, abs_tol=1e-9):
        problems.append(f"alpha {plan.alpha} != least served fraction {least}")
    return problems


def _cap_problems(plan: Plan, inputs: AllocationInputs) -> list[str]:
    """`verify_plan`'s spot share caps: per spot market and (model, phase), the capacity its spot
    instances count there (a colocated one in both phases) is at most the cap times the demand."""
    used: dict[tuple[str, str, Phase], float] = defaultdict(float)
    for i in plan.instances:
        if not i.spot:
            continue
        if i.phase is Phase.COLOCATED:
            used[(i.market, i.model, Phase.PREFILL)] += i.capacity_tok_per_s
            used[(i.market, i.model, Phase.DECODE)] += i.count * i.capacity_share * (i.template.decode_tok_per_s or 0.0)
        else:
            used[(i.market, i.model, i.phase)] += i.capacity_tok_per_s
    problems = []
    for (market, model, phase), have in sorted(used.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2].value)):
        cap = (inputs.spot_share_cap or {}).get((market, model), 1.0)
        limit = cap * inputs.demand.get((model, phase), 0.0)
        if cap < 1.0 and have > limit * (1 + _REL_TOL) + 1e-9:
            problems.append(f"{market}/{model}/{phase.value}: spot capacity {have:.6g} > cap {cap:g} x demand")
    return problems


def verify_plan(plan: Plan, scenario: Scenario, library: TemplateLibrary, *,
                demand: Mapping[tuple[str, Phase | str], float] | None = None,
                availability: Mapping[tuple[str, str], int] | None = None,
                unbounded: bool = False) -> list[str]:
    """Re-check a plan from scratch against the scenario and library (independent of the solver).

    Checks: every instance's template is in the library with the same throughput, may run in its
    region (model's regions, every config priced there) and carries that region's price; nodes
    per (region, config) equal the instances' sum and fit the availability; the demand lines
    carry the demand the allocation was given and the instances' capacity; capacity ≥ α·demand
    per (model, phase); α equals the least served fraction; the cost equals Σ price × count.

    Args:
        plan: the plan.
        scenario, library: what it was planned for.
        demand, availability: the overrides `allocate` was given (same meaning).
        unbounded: skip the availability check (plans made with unbounded availability).

    Returns:
        A list of problems, empty when the plan is valid.
    """
    problems: list[str] = []
    inputs = build_inputs(scenario, library, demand=demand, availability=availability, unbounded=unbounded)

    def library_template(t: Template) -> Template | None:  # a lookup in the library's table
        group = inputs.templates.get((t.model, t.phase), ())
        row = find_template(group, t.nodes)
        return None if row is None else group[row]

    nodes: dict[tuple[str, str], int] = defaultdict(int)
    cap: dict[tuple[str, Phase], float] = defaultdict(float)
    cost = 0.0
    for i in plan.instances:
        t = i.template
        where = i.market  # the region, or its spot market
        tag = f"instance {where}/{t.key}"
        lib_t = library_template(t)
        if lib_t is None:
            problems.append(f"{tag}: template not in the library")
        elif not math.isclose(lib_t.throughput_tok_per_s, t.throughput_tok_per_s, rel_tol=1e-9):
            problems.append(f"{tag}: throughput {t.throughput_tok_per_s} != library {lib_t.throughput_tok_per_s}")
        if t.model not in inputs.allowed_regions:
            problems.append(f"{tag}: unknown model")
        elif where not in inputs.allowed_regions[t.model]:
            problems.append(f"{tag}: model may not run in {where}")
        missing = [c for c in t.counts if (where, c) not in inputs.prices]
        if missing:
            problems.append(f"{tag}: {', '.join(missing)} not sold in {where}")
            continue
        price = sum(inputs.prices[(where, c)] * n for c, n in t.counts.items())
        if not math.isclose(price, i.price_usd_per_h, rel_tol=1e-9, abs_tol=1e-9):
            problems.append(f"{tag}: price {i.price_usd_per_h} != {price} from the region's prices")
        share = 1.0
        if i.spot and where in (inputs.spot or {}):
            share = spot_discount(len(t.nodes), (inputs.spot or {})[where], inputs.epoch_s, inputs.init_s).factor
        if not math.isclose(share, i.capacity_share, rel_tol=1e-9):
            problems.append(f"{tag}: capacity share {i.capacity_share} != {share} (the spot discount)")
        for c, n in t.counts.items():
            nodes[(where, c)] += n * i.count
        if t.phase is Phase.COLOCATED:  # Θ_P in the prefill row, Θ_D in the decode row
            cap[(t.model, Phase.PREFILL)] += i.count * share * t.throughput_tok_per_s
            cap[(t.model, Phase.DECODE)] += i.count * share * (t.decode_tok_per_s or 0.0)
        else:
            cap[(t.model, t.phase)] += i.count * share * t.throughput_tok_per_s
        cost += price * i.count
    listed = {(spot_region(n.region) if n.spot else n.region, n.config): n.count for n in plan.nodes if n.count}
    if listed != dict(nodes):
        problems.append(f"nodes {listed} != the instances' {dict(nodes)}")
    if not unbounded:
        for key, n in nodes.items():
            a = inputs.availability.get(key)
            if a is not None and n > a:
                problems.append(f"{key[0]}/{key[1]}: {n} nodes > {a} available")
    problems += _cap_problems(plan, inputs)
    problems += _demand_problems(plan, inputs, cap)
    if not math.isclose(cost, plan.cost_usd_per_h, rel_tol=1e-9, abs_tol=1e-9):
        problems.append(f"cost {plan.cost_usd_per_h} != {cost} recomputed from the instances")
    if plan.status is Status.INFEASIBLE and plan.instances:
        problems.append("an INFEASIBLE plan carries instances")
    return problems
