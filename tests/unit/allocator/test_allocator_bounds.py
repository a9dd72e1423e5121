"""The Lagrangian bounds of `coral.allocator.bounds`: the knapsack covers against brute force, the
cost bound and the α bound against the exact ILP on seeded small scarce instances (never past the
optimum, never weaker than the LP), and a hand case where the integer covers beat the LP."""
from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from allocator_helpers import D, P, demand_of, make_library, make_scenario, make_template
from test_allocator_reduced import instance

from coral.allocator.bounds import (
    alpha_out_of_reach,
    availability_duals,
    column_generation_alpha_bound,
    cover,
    cover_min,
    lagrangian_alpha_bound,
    lagrangian_cost_bound,
)
from coral.allocator.ilp import decode_counts, formulate, relaxed
from coral.allocator.incumbent import served
from coral.allocator.inputs import build_columns, build_inputs
from coral.solver import SolveOptions, Status, solve

EXACT = SolveOptions(backend="highs", time_limit_s=30, mip_gap=1e-9)


def _brute_cover(w, theta, ub, need):
    best = math.inf
    for nu in itertools.product(*(range(int(u) + 1) for u in ub)):
        nu = np.array(nu, dtype=float)
        if theta @ nu >= need - 1e-9:
            best = min(best, float(w @ nu))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_cover_min_equals_brute_force(seed):
    rng = random.Random(seed)
    m = rng.randint(1, 5)
    w = np.array([round(rng.uniform(0.0, 5.0), 2) for _ in range(m)])
    theta = np.array([round(rng.uniform(1.0, 10.0), 1) for _ in range(m)])
    ub = np.array([float(rng.randint(0, 4)) for _ in range(m)])
    need = round(rng.uniform(0.5, 1.0) * float(theta @ ub) + rng.choice([0.0, 5.0]), 1)
    expected = _brute_cover(w, theta, ub, need)
    bound, x = cover(w, theta, ub, need)
    assert bound == pytest.approx(expected, rel=1e-9, abs=1e-9)
    if math.isinf(expected):
        assert x is None
    else:
        # the cover returned is a cover, within the bounds, at the optimal cost
        assert x is not None and theta @ x >= need - 1e-9 and (x <= ub).all() and (x >= 0).all()
        assert float(w @ x) == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_cover_min_out_of_nodes_is_still_a_lower_bound():
    rng = random.Random(7)
    w = np.array([rng.uniform(1, 2) for _ in range(8)])
    theta = np.array([rng.uniform(1, 2) for _ in range(8)])
    ub = np.full(8, 2.0)
    expected = _brute_cover(w, theta, ub, 11.3)
    assert cover_min(w, theta, ub, 11.3) == pytest.approx(expected, rel=1e-9)
    starved = cover_min(w, theta, ub, 11.3, max_nodes=1)
    assert starved <= expected + 1e-12


def test_integer_covers_beat_the_lp_by_hand():
    # one region, config A (10 nodes at $1/h), one model: prefill on two A nodes at Θ 100, decode on
    # one A node at Θ 100; demand 150 each. The LP covers prefill with 1.5 instances (3 nodes) and
    # decode with 1.5 (1.5 nodes): $4.5/h. Whole instances: 2 + 2, $6/h (times the start-up factor).
    scenario = make_scenario(["m1"], {("r1", "A"): 1.0}, {("r1", "A"): 10})
    library = make_library([make_template("m1", P, ("A", "A"), 100.0), make_template("m1", D, ("A",), 100.0)])
    inputs = build_inputs(scenario, library, demand=demand_of({("m1", P): 150.0, ("m1", D): 150.0}, ["m1"]))
    cols = build_columns(inputs)
    form = formulate(inputs, cols, np.zeros(cols.num_cols))
    lp = solve(relaxed(form).model)
    factor = 1 + inputs.init_s / inputs.horizon_s
    assert lp.objective == pytest.approx(4.5 * factor)
    bound, covers = lagrangian_cost_bound(cols, form.model.c[:form.n], form.model.col_upper[:form.n], 1.0, lp)
    assert bound == pytest.approx(6.0 * factor)
    assert covers.tolist() == [2.0, 2.0]


def _scarce(seed):
    scenario, library, demand = instance(seed, avail_hi=3)
    inputs = build_inputs(scenario, library, demand=demand)
    cols = build_columns(inputs)
    return inputs, cols, np.zeros(cols.num_cols)


@pytest.mark.parametrize("seed", range(10))
def test_alpha_bound_brackets_the_optimal_alpha(seed):
    inputs, cols, prev = _scarce(seed)
    g_form = formulate(inputs, cols, prev, mode="goodput")
    lp = solve(relaxed(g_form).model)
    exact = solve(g_form.model, EXACT)
    assert lp.status is Status.OPTIMAL and exact.status is Status.OPTIMAL
    alpha_exact = float(served(cols, decode_counts(g_form, exact)).min())
    alpha_lp = min(float(lp.objective), 1.0)
    lo = alpha_exact / 2  # any α some plan serves
    bound, tests = lagrangian_alpha_bound(cols, g_form.model.col_upper[:g_form.n], lp, lo, alpha_lp, tol=1e-6,
                                          limit_s=30.0)
    assert alpha_exact <= bound + 1e-9  # valid: no plan serves more
    assert bound <= alpha_lp  # never weaker than the LP's


# draws of range(12) whose demand can be met in full at these availabilities, so the cost ILP at
# α = 1 has an optimum to compare with, and draws that need goodput mode at α = 0.6
@pytest.mark.parametrize("seed", range(12))
def test_cost_bound_between_lp_and_the_optimum(seed):
    inputs, cols, prev = _scarce(seed)
    g_form = formulate(inputs, cols, prev, mode="goodput")
    best = solve(g_form.model, EXACT)
    alpha = 0.9 * min(float(served(cols, decode_counts(g_form, best)).min()), 1.0)  # a fraction some plan serves
    form = formulate(inputs, cols, prev, mode="cost", alpha=alpha)
    lp = solve(relaxed(form).model)
    exact = solve(form.model, EXACT)
    assert lp.status is Status.OPTIMAL and exact.status is Status.OPTIMAL
    got = lagrangian_cost_bound(cols, form.model.c[:form.n], form.model.col_upper[:form.n], alpha, lp)
    assert got is not None
    bound, _ = got
    assert float(lp.objective) - 1e-9 <= bound <= float(exact.objective) * (1 + 1e-9) + 1e-9


def test_duals_recovered_from_reduced_costs_price_the_lp():
    # with the recovered duals and the knapsacks solved as LPs the Lagrangian is the LP's value
    inputs, cols, prev = _scarce(0)
    form = formulate(inputs, cols, prev, mode="cost", alpha=0.3)
    lp = solve(relaxed(form).model)
    lam = availability_duals(cols, form.model.c[:form.n], lp, maximize=False)
    assert lam is not None and (lam >= 0).all()
    w = np.einsum("jc,jc->j", cols.usage[cols.col_t].astype(float), lam[cols.col_r]) + form.model.c[:form.n]
    theta = cols.throughput[cols.col_t]
    grp = cols.group[cols.col_t]
    ub = form.model.col_upper[:form.n]
    total = -float(np.sum(lam[np.isfinite(cols.avail)] * cols.avail[np.isfinite(cols.avail)]))
    for g in range(len(cols.groups)):
        idx = np.flatnonzero(grp == g)
        need = 0.3 * float(cols.demand[g])
        order = idx[np.argsort(w[idx] / theta[idx])]
        for j in order:  # the LP of the knapsack: the greedy fill by ratio
            take = min(ub[j], need / theta[j])
            total += take * w[j]
            need -= take * theta[j]
            if need <= 1e-12:
                break
    assert total == pytest.approx(float(lp.objective), rel=1e-7)


def _hand_case():  # type: ignore[no-untyped-def]
    """Config A, 3 nodes: prefill on two A nodes at Θ 100 (demand 100), decode on one at Θ 100
    (demand 200). Returns (columns, the goodput formulation, its LP relaxation's solve)."""
    scenario = make_scenario(["m1"], {("r1", "A"): 1.0}, {("r1", "A"): 3})
    library = make_library([make_template("m1", P, ("A", "A"), 100.0), make_template("m1", D, ("A",), 100.0)])
    inputs = build_inputs(scenario, library, demand=demand_of({("m1", P): 100.0, ("m1", D): 200.0}, ["m1"]))
    cols = build_columns(inputs)
    g_form = formulate(inputs, cols, np.zeros(cols.num_cols), mode="goodput")
    return cols, g_form, solve(relaxed(g_form).model)


def test_alpha_bound_beats_the_lp_by_hand():
    # config A, 3 nodes: prefill on two A nodes at Θ 100 (demand 100), decode on one at Θ 100
    # (demand 200). The LP serves α with 2α + 2α ≤ 3 nodes: 0.75. Whole instances: one prefill and
    # one decode instance, α = 0.5; above 0.5 decode needs two, 4 nodes > 3, so the bound is 0.5.
    cols, g_form, lp = _hand_case()
    assert lp.objective == pytest.approx(0.75)
    bound, tests = lagrangian_alpha_bound(cols, g_form.model.col_upper[:g_form.n], lp, 0.25, 0.75, tol=1e-6,
                                          limit_s=30.0)
    assert tests > 0
    assert 0.5 < bound <= 0.5 * (1 + 2e-6)


@pytest.mark.parametrize("seed", range(12))
def test_cost_bound_from_another_models_lp_is_still_a_bound(seed):
    # the large-model cost pass at α* prices the nodes with the cost LP at another α (`foreign`)
    inputs, cols, prev = _scarce(seed)
    g_form = formulate(inputs, cols, prev, mode="goodput")
    best = min(float(served(cols, decode_counts(g_form, solve(g_form.model, EXACT))).min()), 1.0)
    other = formulate(inputs, cols, prev, mode="cost", alpha=0.9 * best)
    other_lp = solve(relaxed(other).model)
    alpha = 0.6 * best
    form = formulate(inputs, cols, prev, mode="cost", alpha=alpha)
    exact = solve(form.model, EXACT)
    assert other_lp.status is Status.OPTIMAL and exact.status is Status.OPTIMAL
    got = lagrangian_cost_bound(cols, form.model.c[:form.n], form.model.col_upper[:form.n], alpha, other_lp,
                                floor_lp=False)
    assert got is not None
    assert got[0] <= float(exact.objective) * (1 + 1e-9) + 1e-9


@pytest.mark.parametrize("seed", range(10))
def test_column_generation_never_rules_out_a_served_alpha(seed):
    # at the exact optimum α* a plan exists, so no Lagrangian test may hold there; the bound found
    # upward from a served α is at least the optimum and at most the bound it was given
    inputs, cols, prev = _scarce(seed)
    g_form = formulate(inputs, cols, prev, mode="goodput")
    lp = solve(relaxed(g_form).model)
    exact = solve(g_form.model, EXACT)
    alpha_exact = float(served(cols, decode_counts(g_form, exact)).min())
    ub = g_form.model.col_upper[:g_form.n]
    assert alpha_out_of_reach(cols, ub, lp, alpha_exact, limit_s=30.0) is not True  # never a false proof
    alpha_lp = min(float(lp.objective), 1.0)
    if alpha_lp > alpha_exact * (1 + 1e-6):
        bound, tests = column_generation_alpha_bound(cols, ub, lp, alpha_exact * (1 + 1e-6), alpha_lp, tol=1e-4,
                                                     limit_s=30.0)
        assert tests >= 1
        assert alpha_exact <= bound <= alpha_lp


def test_column_generation_rules_out_the_hand_case_above_its_optimum():
    # the hand case of test_alpha_bound_beats_the_lp_by_hand: α* = 0.5, LP 0.75
    cols, g_form, lp = _hand_case()
    ub = g_form.model.col_upper[:g_form.n]
    assert alpha_out_of_reach(cols, ub, lp, 0.51, limit_s=30.0) is True
    assert alpha_out_of_reach(cols, ub, lp, 0.5, limit_s=30.0) is False  # converged: within reach
    bound, _ = column_generation_alpha_bound(cols, ub, lp, 0.5, 0.75, tol=1e-6, limit_s=30.0)
    assert 0.5 < bound <= 0.5 * (1 + 2e-6)
