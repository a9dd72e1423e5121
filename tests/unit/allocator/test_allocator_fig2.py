"""The paper's Fig. 2: two models share 2 GPU-A and 3 GPU-B nodes; per-model greedy starves
one model, the joint ILP meets both with mixed (A+B) replicas."""
from __future__ import annotations

import pytest
from allocator_helpers import P, demand_of, make_library, make_scenario, make_template

from coral.allocator import allocate, verify_plan

# One region r1; A costs $3/h, B $1/h; 2 A and 3 B nodes available.
#   M1 (demand 70 tok/s):  {A}: 60 tok/s ($3, 20/$),  {A,B}: 75 ($4, 18.75/$)   (M1 does not fit on B alone)
#   M2 (demand 100 tok/s): {A,B}: 80 ($4, 20/$),  {B}: 20 ($1, 20/$),  {A}: 50 ($3, 16.7/$)
# Per-model greedy (model order M1, M2): M1 takes its best per $, {A}, ceil(70/60) = 2 times ->
#   both A nodes, 120 tok/s (over-served). M2 is left with 3 B: 3 x {B} = 60 < 100 -> alpha 0.6.
# Joint: M1 must use exactly one A (two A starve M2: 3 x 20 = 60 < 100; {A} alone is 60 < 70),
#   so M1 = {A,B} (75 >= 70). M2 gets 1 A + 2 B: {A,B} + {B} = 80 + 20 = 100 >= 100
#   ({A} + 2 {B} = 90 < 100). Cost 4 + 4 + 1 = $9/h, every node used, unique optimum.
PRICES = {("r1", "A"): 3.0, ("r1", "B"): 1.0}
AVAIL = {("r1", "A"): 2, ("r1", "B"): 3}
LIB = make_library([
    make_template("m1", P, ["A"], 60), make_template("m1", P, ["A", "B"], 75),
    make_template("m2", P, ["A", "B"], 80), make_template("m2", P, ["B"], 20), make_template("m2", P, ["A"], 50),
])
DEMAND = demand_of({("m1", P): 70.0, ("m2", P): 100.0}, ["m1", "m2"])
SCEN = make_scenario(["m1", "m2"], PRICES, AVAIL)


def _instances(plan):
    return sorted((i.model, i.template.nodes, i.count) for i in plan.instances)


def test_joint_ilp_meets_both_models_with_mixed_replicas():
    plan = allocate(SCEN, LIB, demand=DEMAND)
    assert plan.status.value == "optimal"
    assert plan.alpha == 1.0
    assert _instances(plan) == [("m1", ("A", "B"), 1), ("m2", ("A", "B"), 1), ("m2", ("B",), 1)]
    assert plan.cost_usd_per_h == pytest.approx(9.0)
    assert sorted(plan.binding) == [("r1", "A"), ("r1", "B")]
    assert verify_plan(plan, SCEN, LIB, demand=DEMAND) == []


@pytest.mark.parametrize("method", ["template-greedy", "homo"])
def test_per_model_greedy_starves_the_second_model(method):
    plan = allocate(SCEN, LIB, demand=DEMAND, method=method)
    assert _instances(plan) == [("m1", ("A",), 2), ("m2", ("B",), 3)]
    assert plan.alpha == pytest.approx(0.6)
    caps = {(d.model, d.phase): d.capacity_tok_per_s for d in plan.demand}
    assert caps[("m1", P)] == 120.0 and caps[("m2", P)] == 60.0
    assert verify_plan(plan, SCEN, LIB, demand=DEMAND) == []
