"""The frontier fast path: with availability that does not bind, solving on the cost/throughput
frontier gives the same optimum as the full ILP over every column."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from allocator_helpers import (
    D,
    P,
    demand_of,
    make_library,
    make_scenario,
    make_template,
    random_instance,
)

from coral.allocator import allocate, verify_plan
from coral.allocator.allocate import frontier_columns
from coral.allocator.ilp import prev_counts
from coral.allocator.inputs import build_columns, build_inputs
from coral.allocator.search import Allocated, solve_allocation
from coral.solver import SolveOptions

EXACT = SolveOptions(backend="highs", time_limit_s=30, mip_gap=1e-9)


def instance(seed: int, avail: int):
    return random_instance(seed, tries=12, avail=avail, demand=(50, 400))


@pytest.mark.parametrize("seed", range(12))
def test_fast_path_matches_full_ilp(seed):
    scenario, library, demand = instance(seed, avail=1000)
    plan = allocate(scenario, library, demand=demand, options=EXACT)
    assert any("frontier" in n for n in plan.notes)
    assert verify_plan(plan, scenario, library, demand=demand) == []
    inputs = build_inputs(scenario, library, demand=demand)
    cols = build_columns(inputs)
    got = solve_allocation(inputs, cols, prev_counts(inputs, cols, None), EXACT)
    assert isinstance(got, Allocated)
    full = got.plan
    assert plan.cost_usd_per_h == pytest.approx(full.cost_usd_per_h, rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_binding_availability_falls_back_to_full_ilp(seed):
    scenario, library, demand = instance(seed, avail=3)
    plan = allocate(scenario, library, demand=demand, options=EXACT)
    assert not any("frontier" in n for n in plan.notes)
    assert verify_plan(plan, scenario, library, demand=demand) == []


def test_frontier_mask_hand_example():
    # one (model, phase), one region: costs (with the init penalty) 1, 2, 3 and throughputs
    # 10, 5, 20: the 2nd costs more than the 1st and serves less -> dropped.
    scenario = make_scenario(["m1"], {("r1", "A"): 1.0, ("r1", "B"): 2.0, ("r1", "C"): 3.0},
                             {("r1", "A"): 9, ("r1", "B"): 9, ("r1", "C"): 9})
    library = make_library([make_template("m1", P, ["A"], 10), make_template("m1", P, ["B"], 5),
                            make_template("m1", P, ["C"], 20)])
    inputs = build_inputs(scenario, library, demand=demand_of({("m1", P): 30}, ["m1"]))
    cols = build_columns(inputs)
    keep = frontier_columns(inputs, cols, np.zeros(cols.num_cols, dtype=np.int64))
    kept = sorted(cols.templates[int(cols.col_t[j])].nodes for j in np.flatnonzero(keep))
    assert kept == [("A",), ("C",)]


@pytest.mark.parametrize("seed", range(20))
def test_linear_frontier_equals_sorting_and_brute_force(seed):
    # coarse throughputs and prices, so ties in Θ, in cost and exact duplicates all occur;
    # columns built without Θ blocks take the sorting pass
    rng = random.Random(seed)
    regions, configs = ["r1", "r2", "r3"], ["A", "B", "C", "D"]
    prices = {(r, c): float(rng.randint(1, 3)) for r in regions for c in configs if rng.random() < 0.8}
    templates, seen = [], set()
    for m in ("m1", "m2"):
        for ph in (P, D):
            for _ in range(30):
                nodes = tuple(sorted(rng.choice(configs) for _ in range(rng.randint(1, 3))))
                if (m, ph, nodes) not in seen:
                    seen.add((m, ph, nodes))
                    templates.append(make_template(m, ph, nodes, float(rng.choice([10, 20, 30, 40]))))
    scenario = make_scenario(["m1", "m2"], prices, {k: 50 for k in prices})
    inputs = build_inputs(scenario, make_library(templates),
                          demand=demand_of({(m, ph): 100.0 for m in ("m1", "m2") for ph in (P, D)}, ["m1", "m2"]))
    cols = build_columns(inputs)
    prev = np.zeros(cols.num_cols)
    prev[rng.randrange(cols.num_cols)] = 2  # a running column is always kept
    fast = frontier_columns(inputs, cols, prev)
    assert cols.theta_block is not None
    assert (fast == frontier_columns(inputs, dataclasses.replace(cols, theta_block=None), prev)).all()
    theta = cols.throughput[cols.col_t]
    grp = cols.group[cols.col_t]
    cost = cols.price * (1 + inputs.init_s / inputs.horizon_s)
    for j in range(cols.num_cols):  # kept iff nothing earlier-or-better dominates it
        beaten = any(grp[k] == grp[j] and cost[k] <= cost[j] and theta[k] >= theta[j]
                     and (cost[k] < cost[j] or theta[k] > theta[j] or k < j) for k in range(cols.num_cols) if k != j)
        assert fast[j] == (not beaten or prev[j] > 0)
