"""Spot in the allocation ILP (issue 30): hand-computed plans that mix spot and on-demand nodes,
the share cap, pools that are down, and the marks a plan carries."""
from __future__ import annotations

from dataclasses import replace

import pytest
from allocator_helpers import D, P, demand_of, make_library, make_scenario, make_template

from coral.allocator import allocate
from coral.allocator.allocate import verify_plan
from coral.catalog import SpotOffer, SpotProcess
from coral.errors import CoralError
from coral.scenario import load_scenario, with_spot

PROCESS = SpotProcess(preemption_per_node_h=0.4, co_loss_share=0.5, availability=0.6, recovery_s=3600.0, source="test")
SHARE_1 = 0.948064  # exp(-0.4 x (360 + 120) / 3600): a 1-node template's survival (test_spot_discount)


def _spot_scenario(cap: float = 1.0):
    """One model, region r1, one shape A: on-demand 1.00 $/h, spot 0.30 $/h, 10 nodes."""
    sc = make_scenario(["m"], {("r1", "A"): 1.0}, {("r1", "A"): 10})
    offer = SpotOffer(region="r1", config="A", instance_type="a.xlarge", spot_usd_per_h=0.3, on_demand_usd_per_h=1.0,
                      process=PROCESS)
    return replace(sc, spot={("r1", "A"): offer}, spot_share_cap={("r1", "m"): cap})


LIB = make_library([make_template("m", P, ["A"], 100.0), make_template("m", D, ["A"], 100.0)])


def _plan(sc, prefill_tok_per_s: float, **kw):
    return allocate(sc, LIB, demand=demand_of({("m", P): prefill_tok_per_s}, ["m"]), **kw)


def _counts(plan):
    return sorted((i.region, i.spot, i.count) for i in plan.instances)


def test_spot_wins_at_its_discounted_capacity():
    """250 tok/s: on-demand needs 3 instances (3.00 $/h); a spot one counts 94.81 tok/s, so 3 spot
    instances (284.4 tok/s) cost 0.90 $/h: the plan is all spot."""
    sc = _spot_scenario()
    plan = _plan(sc, 250.0)
    assert [("r1", True, 3)] == _counts(plan)
    assert pytest.approx(0.9) == plan.cost_usd_per_h
    assert pytest.approx(SHARE_1, abs=1e-6) == plan.instances[0].capacity_share
    assert pytest.approx(3 * 100 * SHARE_1, abs=1e-3) == plan.demand[0].capacity_tok_per_s
    assert [] == verify_plan(plan, sc, LIB, demand=demand_of({("m", P): 250.0}, ["m"]))


def test_discount_decides_the_count():
    """285 tok/s: 3 on-demand instances would do (300), but 3 spot ones count only 284.4, so the
    plan takes 4 spot instances (1.20 $/h), still cheaper than 3 on-demand ones."""
    plan = _plan(_spot_scenario(), 285.0)
    assert [("r1", True, 4)] == _counts(plan)
    assert pytest.approx(1.2) == plan.cost_usd_per_h


def test_share_cap_mixes_spot_and_on_demand():
    """Cap 0.5 of 250 tok/s: spot may count 125 tok/s, so 1 spot instance (94.8); the other 155.2
    tok/s take 2 on-demand ones: 0.30 + 2.00 = 2.30 $/h (against 3.00 all on-demand)."""
    sc = _spot_scenario(cap=0.5)
    demand = demand_of({("m", P): 250.0}, ["m"])
    plan = allocate(sc, LIB, demand=demand)
    assert [("r1", False, 2), ("r1", True, 1)] == _counts(plan)
    assert pytest.approx(2.3) == plan.cost_usd_per_h
    assert [] == verify_plan(plan, sc, LIB, demand=demand)
    homo = allocate(sc, LIB, demand=demand, method="homo")  # the baselines keep a cap by renting no spot there
    assert [("r1", False, 3)] == _counts(homo)


def test_a_pool_that_is_down_falls_back_to_on_demand():
    plan = _plan(_spot_scenario(), 250.0, spot_down=[("r1", "A")])
    assert [("r1", False, 3)] == _counts(plan)
    assert pytest.approx(3.0) == plan.cost_usd_per_h


def test_a_down_pool_keeps_what_runs_there_and_starts_nothing():
    """Two spot instances run in r1's pool A when it goes down. 250 tok/s still needs 284.4 tok/s of
    spot or 300 of on-demand: the two keep running (189.6 tok/s) and one on-demand instance is
    added (100 tok/s), 0.60 + 1.00 = 1.60 $/h; no third spot instance starts there. Homo too."""
    sc = _spot_scenario()
    demand = demand_of({("m", P): 250.0}, ["m"])
    prev = {("r1#spot", "m/prefill/A"): 2}
    for method in ("coral", "homo"):
        plan = allocate(sc, LIB, demand=demand, prev=prev, spot_down=[("r1", "A")], method=method)
        assert [("r1", False, 1), ("r1", True, 2)] == _counts(plan), method
        assert pytest.approx(1.6) == plan.cost_usd_per_h


def test_plan_json_and_prev_mark_spot():
    plan = _plan(_spot_scenario(), 250.0)
    doc = plan.to_json()
    assert 4 == doc["plan_version"]
    assert [(True, pytest.approx(SHARE_1, abs=1e-6))] == [(i["spot"], i["capacity_share"]) for i in doc["instances"]]
    assert [("r1", "A", 3, True)] == [(n["region"], n["config"], n["count"], n["spot"]) for n in doc["nodes"]]
    assert {("r1#spot", "m/prefill/A"): 3} == plan.counts()
    # the next epoch keeps them: no start-up penalty for what runs
    again = _plan(_spot_scenario(), 250.0, prev=plan)
    assert 0.0 == again.init_penalty_usd_per_h


def test_spot_off_changes_nothing():
    sc = _spot_scenario()
    plain = replace(sc, spot={}, spot_share_cap={})
    assert [("r1", False, 3)] == _counts(_plan(plain, 250.0))


@pytest.mark.parametrize(("kw", "message"), [
    ({"rate_multiplier": -1.0}, r"spot rate multiplier must be a finite number >= 0"),
    ({"share_cap": 0.0}, r"spot share cap must be in \(0, 1\]"),
])
def test_with_spot_bad_input(kw, message):
    with pytest.raises(CoralError, match=message):
        with_spot(load_scenario("core"), **kw)


def test_with_spot_scales_the_fitted_rate():
    core = load_scenario("core")
    on, x4 = with_spot(core), with_spot(core, rate_multiplier=4.0)
    key = ("aws:us-east-2", "1xL40S")
    assert pytest.approx(4 * on.spot[key].process.preemption_per_node_h) == x4.spot[key].process.preemption_per_node_h
    assert {} == dict(with_spot(on, on=False).spot)
