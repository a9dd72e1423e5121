"""Plan JSON, verify_plan catching broken plans, the report tables, baselines' shapes,
region restrictions and tight availability."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from allocator_helpers import D, P, demand_of, make_library, make_scenario, make_template
from rich.console import Console

from coral.allocator import allocate, plan_tables, render_plan, tight_availability, verify_plan

PRICES = {("r1", "A"): 1.0, ("r1", "B"): 1.0, ("r2", "A"): 0.8, ("r2", "B"): 1.2}
AVAIL = {k: 10 for k in PRICES}
LIB = make_library([
    make_template("m1", P, ["A"], 100), make_template("m1", P, ["B"], 50), make_template("m1", P, ["A", "B"], 170),
    make_template("m1", D, ["A"], 30), make_template("m1", D, ["B"], 60),
    make_template("m2", P, ["A"], 40), make_template("m2", D, ["B"], 40),
])
DEMAND = demand_of({("m1", P): 200.0, ("m1", D): 240.0, ("m2", P): 50.0, ("m2", D): 30.0}, ["m1", "m2"])


def test_to_json_shape():
    scen = make_scenario(["m1", "m2"], PRICES, AVAIL)
    plan = allocate(scen, LIB, demand=DEMAND)
    doc = json.loads(json.dumps(plan.to_json()))
    for key in ("status", "cost_usd_per_h", "alpha", "solve_s", "gap", "method", "instances", "demand", "nodes"):
        assert key in doc
    inst = doc["instances"][0]
    assert set(inst) >= {"model", "phase", "region", "nodes", "count", "throughput_tok_per_s", "stages"}
    stage = inst["stages"][0]
    assert {"nodes": stage["nodes"], "layers": stage["layers"]} == {"nodes": inst["nodes"], "layers": 32}
    assert set(stage) == {"nodes", "layers", "node_index", "throughput_tok_per_s"}
    assert doc["plan_version"] == 4  # what coral.runtime.deploy.plan_file reads
    assert {(d["model"], d["phase"]) for d in doc["demand"]} == {(m, p) for m in ("m1", "m2")
                                                                  for p in ("prefill", "decode")}
    assert all(set(n) == {"region", "config", "count", "available", "spot"} for n in doc["nodes"])
    assert doc["cost_usd_per_h"] == pytest.approx(sum(i["count"] * i["price_usd_per_h"] for i in doc["instances"]))


def test_verify_plan_finds_broken_plans():
    scen = make_scenario(["m1", "m2"], PRICES, AVAIL)
    plan = allocate(scen, LIB, demand=DEMAND)
    assert verify_plan(plan, scen, LIB, demand=DEMAND) == []
    cheap = replace(plan, cost_usd_per_h=plan.cost_usd_per_h / 2)
    assert any("recomputed" in p for p in verify_plan(cheap, scen, LIB, demand=DEMAND))
    tight = {k: 0 for k in PRICES}
    assert any("available" in p for p in verify_plan(plan, scen, LIB, demand=DEMAND, availability=tight))
    more = {**DEMAND, ("m2", P): 1e6}
    assert any("capacity" in p for p in verify_plan(plan, scen, LIB, demand=more))
    dropped = replace(plan, instances=plan.instances[1:])
    assert verify_plan(dropped, scen, LIB, demand=DEMAND)
    foreign = replace(plan.instances[0], template=make_template("m1", P, ["A", "A", "B"], 999))
    assert any("not in the library" in p for p in verify_plan(replace(plan, instances=(foreign, *plan.instances[1:])),
                                                               scen, LIB, demand=DEMAND))


@pytest.mark.parametrize("method", ["coral", "homo", "cauchy", "template-greedy"])
def test_every_method_gives_a_verified_plan_that_meets_demand(method):
    scen = make_scenario(["m1", "m2"], PRICES, AVAIL)
    plan = allocate(scen, LIB, demand=DEMAND, method=method)
    assert plan.method == method and plan.alpha == 1.0
    assert verify_plan(plan, scen, LIB, demand=DEMAND) == []
    if method in ("homo", "cauchy"):
        assert all(len(i.template.nodes) == 1 for i in plan.instances)
    coral = allocate(scen, LIB, demand=DEMAND)
    assert coral.cost_usd_per_h <= plan.cost_usd_per_h + 1e-9


def test_cauchy_combo_of_one_prefill_feeding_k_decode_replicas():
    # m1 in r1 only: prefill best per $ is {A} (100/$ vs 50/$), decode best is {B} (60/$ vs 30/$).
    # Demand P 200, D 240: a combo 1 x {A} + k x {B} serves min(100/200, 60k/240) per $(1 + k):
    #   k=1: 0.25/2 = 0.125, k=2: 0.5/3 = 0.167, k=3: 0.5/4 = 0.125 -> k = 2.
    # Units: max(200/100, 240/120) = 2 -> 2 x {A} prefill + 4 x {B} decode, $6/h.
    scen = make_scenario([("m1", ("r1",))], PRICES, AVAIL)
    demand = demand_of({("m1", P): 200.0, ("m1", D): 240.0}, ["m1"])
    plan = allocate(scen, LIB, demand=demand, method="cauchy")
    assert sorted((i.phase.value, i.template.nodes, i.count) for i in plan.instances) == [
        ("decode", ("B",), 4), ("prefill", ("A",), 2)]
    assert plan.cost_usd_per_h == pytest.approx(6.0)
    assert {i.region for i in plan.instances} == {"r1"}
    # homo sizes the phases separately: the same here
    homo = allocate(scen, LIB, demand=demand, method="homo")
    assert homo.cost_usd_per_h == pytest.approx(6.0)


def test_region_restriction_is_respected():
    scen = make_scenario([("m1", ("r1",)), ("m2", ("r2",))], PRICES, AVAIL)
    for method in ("coral", "homo", "cauchy", "template-greedy"):
        plan = allocate(scen, LIB, demand=DEMAND, method=method)
        assert {(i.model, i.region) for i in plan.instances} <= {("m1", "r1"), ("m2", "r2")}
        assert verify_plan(plan, scen, LIB, demand=DEMAND) == []


def test_tight_availability_spreads_a_margin_above_the_fewest_gpus_over_every_offer():
    scen = make_scenario(["m1", "m2"], PRICES, AVAIL)  # named "core": margin 0.25
    # Fewest GPUs (A and B are 1-GPU nodes here): m1 prefill 200 = 2 x A (100 each), m1 decode
    # 240 = 4 x B (60), m2 prefill 50 = 2 x A (40), m2 decode 30 = 1 x B (40). Each group's
    # 1.25 x GPUs go evenly to the offers its templates can use (both regions):
    #   m1 prefill (A, B): 2.5 / 4 offers; m1 decode (A, B): 5 / 4; m2 prefill (A): 2.5 / 2; m2 decode (B): 1.25 / 2
    #   A offers: 0.625 + 1.25 + 1.25 = 3.125 -> 4 nodes; B offers: 0.625 + 1.25 + 0.625 = 2.5 -> 3
    tight = tight_availability(scen, LIB, demand=DEMAND)
    assert tight == {("r1", "A"): 4, ("r2", "A"): 4, ("r1", "B"): 3, ("r2", "B"): 3}
    plan = allocate(scen, LIB, demand=DEMAND, availability=tight)
    assert plan.alpha == 1.0 and any(n.binding for n in plan.nodes)  # it fits, and it binds
    wide = tight_availability(replace(scen, name="extended"), LIB, demand=DEMAND)  # x 1.75: A 4.375, B 3.5
    assert wide == {("r1", "A"): 5, ("r2", "A"): 5, ("r1", "B"): 4, ("r2", "B"): 4}
    assert tight_availability(scen, LIB, demand=DEMAND, floor=5) == {k: 5 for k in PRICES}


def test_report_renders_every_table():
    scen = make_scenario(["m1", "m2"], PRICES, AVAIL)
    plan = allocate(scen, LIB, demand=DEMAND)
    assert [t.title for t in plan_tables(plan)] == ["Plan (coral)", "Nodes per region", "Serving instances",
                                                     "Demand vs capacity", "Serving mode per model"]
    console = Console(record=True, width=160)
    render_plan(plan, console)
    text = console.export_text()
    assert "m1" in text and "m2" in text and "optimal" in text
