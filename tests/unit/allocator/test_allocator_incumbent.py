"""Goodput mode's starting points: the rounded LP plan respects the availability, and the α
search with bounds agrees with a plain solve on small cases."""
from __future__ import annotations

import numpy as np
import pytest
from allocator_helpers import (
    random_instance,
)

from coral.allocator import allocate, verify_plan
from coral.allocator.ilp import formulate, relaxed
from coral.allocator.incumbent import max_alpha_incumbent, served
from coral.allocator.inputs import build_columns, build_inputs
from coral.solver import SolveOptions, solve

EXACT = SolveOptions(backend="highs", time_limit_s=30, mip_gap=1e-9)


def scarce(seed: int):
    return random_instance(seed, tries=10, avail_range=(0, 4), demand=(300, 900))


@pytest.mark.parametrize("seed", range(10))
def test_rounded_lp_plan_fits_and_is_no_better_than_the_lp(seed):
    scenario, library, demand = scarce(seed)
    inputs = build_inputs(scenario, library, demand=demand)
    cols = build_columns(inputs)
    form = formulate(inputs, cols, np.zeros(cols.num_cols), mode="goodput")
    lp = solve(relaxed(form).model)
    ub = form.model.col_upper[:form.n]
    nu = max_alpha_incumbent(cols, lp.x[:form.n], ub=ub)
    assert nu.dtype.kind == "i" and (nu >= 0).all() and (nu <= ub).all()
    used = np.zeros_like(cols.avail)
    np.add.at(used, cols.col_r, cols.usage[cols.col_t] * nu[:, None])
    assert (used <= cols.avail + 1e-9).all()
    assert served(cols, nu).min() <= lp.objective + 1e-9


@pytest.mark.parametrize("seed", range(10))
def test_goodput_alpha_matches_the_exact_max(seed):
    scenario, library, demand = scarce(seed)
    plan = allocate(scenario, library, demand=demand, options=EXACT)
    assert verify_plan(plan, scenario, library, demand=demand) == []
    if plan.alpha >= 1:
        return  # not scarce after all
    inputs = build_inputs(scenario, library, demand=demand)
    cols = build_columns(inputs)
    exact = solve(formulate(inputs, cols, np.zeros(cols.num_cols), mode="goodput").model, EXACT)
    # α to max(mip_gap, GOODPUT_GAP) = 0.5 %: never above the exact max, never far below it
    assert exact.objective * (1 - 5e-3) - 1e-9 <= plan.alpha <= exact.objective + 1e-6
