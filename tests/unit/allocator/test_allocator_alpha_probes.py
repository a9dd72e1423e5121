"""Goodput mode's α bounds from feasibility MILPs at α fixed (`alpha_bound_probes`), held to the
exact max-α ILP on seeded small scarce instances: the bound is never below the optimum, the plan
never above it, and the plan fits the availability."""
from __future__ import annotations

import numpy as np
import pytest
from test_allocator_reduced import instance

from coral.allocator.goodput import alpha_bound_probes
from coral.allocator.ilp import decode_counts, formulate, relaxed
from coral.allocator.incumbent import max_alpha_incumbent, served
from coral.allocator.inputs import build_columns, build_inputs
from coral.solver import SolveOptions, Status, solve

EXACT = SolveOptions(backend="highs", time_limit_s=30, mip_gap=1e-9)


def _run(form, *, limit=None, gap=None, start_x=None):
    return solve(form.model, SolveOptions(backend="highs", time_limit_s=limit or 30, mip_gap=gap or 1e-9))


# the draws of range(10) where the rounded LP plan is short of the LP bound (5, 7 and 9 leave nothing to probe)
PROBE_SEEDS = (0, 1, 2, 3, 4, 6, 8)


@pytest.mark.parametrize("seed", PROBE_SEEDS)
def test_probe_bound_brackets_the_optimal_alpha(seed):
    scenario, library, demand = instance(seed, avail_hi=3)
    inputs = build_inputs(scenario, library, demand=demand)
    cols = build_columns(inputs)
    prev = np.zeros(cols.num_cols)
    g_form = formulate(inputs, cols, prev, mode="goodput")
    lp = solve(relaxed(g_form).model)
    exact = solve(g_form.model, EXACT)
    assert lp.status is Status.OPTIMAL and exact.status is Status.OPTIMAL
    alpha_exact = float(served(cols, decode_counts(g_form, exact)).min())
    alpha_lp = min(float(lp.objective), 1.0)
    nu0 = max_alpha_incumbent(cols, lp.x[:g_form.n], ub=g_form.model.col_upper[:g_form.n])
    alpha0 = float(served(cols, nu0).min())
    assert alpha0 > 0 and alpha_lp < 1.0 and (alpha_lp - alpha0) / alpha0 > 1e-3, "a draw with nothing to probe"
    nu, bound, how = alpha_bound_probes(inputs, cols, prev, g_form, lp, nu0, alpha_lp, _run, 1e-3, 20.0)
    assert how != "none"
    alpha = float(served(cols, nu).min())
    assert alpha0 <= alpha <= alpha_exact + 1e-9
    assert alpha_exact <= bound + 1e-9
    assert bound <= alpha_lp
    used = np.zeros_like(cols.avail)
    np.add.at(used, cols.col_r, cols.usage[cols.col_t] * nu[:, None])
    assert (used <= cols.avail + 1e-9).all()
    # with 20 s for a model this small the probes close the gap (not a timing claim: they end at it)
    assert (bound - alpha) / alpha <= 1e-3
