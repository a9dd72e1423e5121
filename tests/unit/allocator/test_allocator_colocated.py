"""Colocated columns in the allocation ILP: Θ_P in the prefill row, Θ_D in the decode row, one mode
per model (auto never costs more than either forced mode, and never mixes the two kinds)."""
import itertools
import random
from dataclasses import replace

import pytest
from allocator_helpers import D, P, demand_of, make_library, make_scenario, make_template

from coral.allocator import allocate
from coral.errors import CoralError
from coral.perf.model import Phase


def colocated(model, nodes, prefill, decode):
    t = make_template(model, P, nodes, prefill)
    return replace(t, phase=Phase.COLOCATED, decode_tok_per_s=decode, chunk_tokens=256)


def scenario(prices):
    return make_scenario(["m1"], prices, {k: 100 for k in prices})


def test_hand_instance_one_mode_per_model():
    # A $1/h, B $1.5/h. Disaggregated: prefill on A 100 tok/s, decode on A 50 tok/s. Colocated on
    # B: Θ_P 100, Θ_D 50. Demand: prefill 300, decode 100.
    #   disagg:    3 prefill + 2 decode on A           = 5 x $1          = $5.00
    #   colocated: max(300/100, 100/50) = 3 on B       = 3 x $1.5        = $4.50
    #   a mix:     2 colocated (200 P, 100 D) + 1 prefill = $3 + $1      = $4.00, but the prefill
    #              instance's third of the requests has no decode instance to go to: not a plan
    #   auto:      the cheaper single mode, colocated  = $4.50
    s = scenario({("r1", "A"): 1.0, ("r1", "B"): 1.5})
    lib = make_library([make_template("m1", P, ["A"], 100.0), make_template("m1", D, ["A"], 50.0),
                        colocated("m1", ["B"], 100.0, 50.0)])
    demand = demand_of({("m1", P): 300.0, ("m1", D): 100.0}, ["m1"])
    costs = {mode: allocate(s, lib, demand=demand, mode=mode) for mode in ("disagg", "colocated", "auto")}
    assert {"disagg": 5.0, "colocated": 4.5, "auto": 4.5} == {m: pytest.approx(p.cost_usd_per_h) for m, p in costs.items()}
    assert {"m1": "colocated"} == costs["auto"].model_modes()
    assert {"m1": "colocated"} == costs["colocated"].model_modes()
    # the colocated instances' Θ_D counts in the decode line
    assert {P: 300.0, D: 150.0} == {d.phase: pytest.approx(d.capacity_tok_per_s) for d in costs["auto"].demand}
    js = costs["auto"].to_json()
    assert [{"model": "m1", "first_token": "prefill", "mode": "colocated"}] == js["models"]
    coloc = [i for i in js["instances"] if i["phase"] == "colocated"]
    assert [(3, 256, 50.0)] == [(i["count"], i["chunk_tokens"], i["decode_tok_per_s"]) for i in coloc]


def test_every_model_gets_one_mode():
    # Two models, each the hand instance above: alone each would mix ($4.00), so each is re-planned
    # forced to one kind; colocated ($4.50) beats disaggregated ($5.00) for both: $9.00 in all.
    s = make_scenario(["m1", "m2"], {("r1", "A"): 1.0, ("r1", "B"): 1.5}, {("r1", "A"): 100, ("r1", "B"): 100})
    lib = make_library([t for m in ("m1", "m2") for t in (make_template(m, P, ["A"], 100.0), make_template(m, D, ["A"], 50.0),
                                                          colocated(m, ["B"], 100.0, 50.0))])
    demand = demand_of({(m, ph): v for m in ("m1", "m2") for ph, v in ((P, 300.0), (D, 100.0))}, ["m1", "m2"])
    plan = allocate(s, lib, demand=demand)
    assert {"m1": "colocated", "m2": "colocated"} == plan.model_modes()
    assert 9.0 == pytest.approx(plan.cost_usd_per_h)


def test_baselines_stay_disaggregated():
    s = scenario({("r1", "A"): 1.0, ("r1", "B"): 1.5})
    lib = make_library([make_template("m1", P, ["A"], 100.0), make_template("m1", D, ["A"], 50.0),
                        colocated("m1", ["B"], 100.0, 50.0)])
    demand = demand_of({("m1", P): 300.0, ("m1", D): 100.0}, ["m1"])
    for method in ("homo", "cauchy", "template-greedy"):
        assert {"m1": "disagg"} == allocate(s, lib, method=method, demand=demand).model_modes()


def test_forced_colocated_without_templates_says_why():
    s = scenario({("r1", "A"): 1.0})
    lib = make_library([make_template("m1", P, ["A"], 100.0), make_template("m1", D, ["A"], 50.0)])
    demand = demand_of({("m1", P): 300.0, ("m1", D): 100.0}, ["m1"])
    with pytest.raises(CoralError, match="model m1 has no colocated template"):
        allocate(s, lib, demand=demand, mode="colocated")
    with pytest.raises(CoralError, match="--mode must be one of auto, disagg, colocated"):
        allocate(s, lib, demand=demand, mode="both")
    assert {"m1": "disagg"} == allocate(s, lib, demand=demand).model_modes()  # auto without colocated templates


def brute_force(templates, prices, demand, limit=8):
    """The least cost over every count vector up to `limit` instances per template."""
    best = float("inf")
    for counts in itertools.product(range(limit + 1), repeat=len(templates)):
        cap = {P: 0.0, D: 0.0}
        cost = 0.0
        for t, n in zip(templates, counts, strict=True):
            for ph in (P, D):
                cap[ph] += n * t.serves_tok_per_s(ph)
            cost += n * sum(prices[("r1", c)] for c in t.nodes)
        if cap[P] >= demand[P] - 1e-9 and cap[D] >= demand[D] - 1e-9:
            best = min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_auto_is_the_cheapest_mode_against_brute_force(seed):
    rng = random.Random(seed)
    prices = {("r1", "A"): round(rng.uniform(0.5, 3), 2), ("r1", "B"): round(rng.uniform(0.5, 3), 2)}
    templates = [make_template("m1", P, ["A"], rng.uniform(50, 150)), make_template("m1", D, [rng.choice("AB")], rng.uniform(20, 80)),
                 colocated("m1", ["B"], rng.uniform(30, 120), rng.uniform(10, 60)),
                 colocated("m1", ["A", "B"], rng.uniform(60, 200), rng.uniform(20, 100))]
    demand = {P: rng.uniform(100, 400), D: rng.uniform(50, 200)}
    s = make_scenario(["m1"], prices, {k: 100 for k in prices}, init_s=0.0)
    lib = make_library(templates)
    got = {mode: allocate(s, lib, demand=demand_of({("m1", ph): v for ph, v in demand.items()}, ["m1"]),
                          mode=mode).cost_usd_per_h for mode in ("disagg", "colocated", "auto")}
    assert got["auto"] <= min(got["disagg"], got["colocated"]) + 1e-6
    # one mode per model: the cheaper of the two kinds alone
    assert min(brute_force(templates[:2], prices, demand), brute_force(templates[2:], prices, demand)) == pytest.approx(got["auto"])
    assert brute_force(templates[:2], prices, demand) == pytest.approx(got["disagg"])
    assert brute_force(templates[2:], prices, demand) == pytest.approx(got["colocated"])
