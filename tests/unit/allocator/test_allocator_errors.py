"""Bad input is refused naming the field; solver failures still give a plan with its status."""
from __future__ import annotations

import math

import pytest
from allocator_helpers import D, P, demand_of, make_library, make_scenario, make_template

import coral.allocator.ilp as ilp
from coral.allocator import allocate, tight_availability, verify_plan
from coral.errors import CoralError
from coral.solver import SolveResult, Status

PRICES = {("r1", "A"): 1.0, ("r1", "B"): 2.0}
AVAIL = {("r1", "A"): 4, ("r1", "B"): 4}
LIB = make_library([make_template("m1", P, ["A"], 10), make_template("m1", D, ["B"], 10)])
SCEN = make_scenario(["m1"], PRICES, AVAIL)
DEMAND = demand_of({("m1", P): 15.0, ("m1", D): 5.0}, ["m1"])


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "lots"])
def test_bad_demand_is_refused_naming_the_field(bad):
    with pytest.raises(CoralError, match=r"demand\[m1, prefill\]"):
        allocate(SCEN, LIB, demand={("m1", "prefill"): bad})


def test_unknown_model_or_phase_in_demand():
    with pytest.raises(CoralError, match="unknown model 'nope'"):
        allocate(SCEN, LIB, demand={("nope", P): 1.0})
    with pytest.raises(CoralError, match="unknown phase"):
        allocate(SCEN, LIB, demand={("m1", "train"): 1.0})


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_price_is_refused_naming_the_field(bad):
    scen = make_scenario(["m1"], {**PRICES, ("r1", "B"): bad}, AVAIL)
    with pytest.raises(CoralError, match=r"prices\[r1, B\]"):
        allocate(scen, LIB, demand=DEMAND)


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, 1.5])
def test_bad_availability_is_refused_naming_the_field(bad):
    with pytest.raises(CoralError, match=r"availability\[r1, A\]"):
        allocate(SCEN, LIB, demand=DEMAND, availability={("r1", "A"): bad})
    scen = make_scenario(["m1"], PRICES, {**AVAIL, ("r1", "A"): bad})
    with pytest.raises(CoralError, match=r"availability\[r1, A\]"):
        allocate(scen, LIB, demand=DEMAND)


def test_unknown_region_or_config_in_availability():
    with pytest.raises(CoralError, match="unknown region 'r9'"):
        allocate(SCEN, LIB, demand=DEMAND, availability={("r9", "A"): 1})
    with pytest.raises(CoralError, match="unknown configuration 'Z'"):
        allocate(SCEN, LIB, demand=DEMAND, availability={("r1", "Z"): 1})


def test_model_without_template_names_model_phase_slo_and_closest_latency():
    lib = make_library([make_template("m1", P, ["A"], 10)])
    with pytest.raises(CoralError, match=r"model m1, phase decode: no template meets the SLO \(SLO 100 ms"):
        allocate(SCEN, lib, demand=DEMAND)
    with pytest.raises(CoralError, match="closest template's latency is 131 ms"):
        allocate(SCEN, lib, demand=DEMAND, nearest_latency_ms={("m1", "decode"): 131.0})
    # no demand for the phase: no template needed
    plan = allocate(SCEN, lib, demand={("m1", P): 15.0, ("m1", D): 0.0})
    assert plan.alpha == 1.0


def test_template_not_sold_in_allowed_regions():
    scen = make_scenario([("m1", ("r2",))], {**PRICES, ("r2", "A"): 1.0}, {**AVAIL, ("r2", "A"): 2})
    with pytest.raises(CoralError, match=r"model m1, phase decode: none of its 1 templates can run in its regions \(r2\)"):
        allocate(scen, LIB, demand=DEMAND)


def test_unknown_method():
    with pytest.raises(CoralError, match="unknown allocation method 'magic'"):
        allocate(SCEN, LIB, method="magic")


def test_negative_margin_refused():
    with pytest.raises(CoralError, match="margin"):
        tight_availability(SCEN, LIB, margin=-0.1, demand=DEMAND)


def _fake(status, x=None):
    def solve(model, options=None):
        return SolveResult(status=status, objective=math.nan, bound=math.nan, gap=math.inf, wall_s=0.01, x=x,
                           backend="highs", message="fake")
    return solve


@pytest.mark.parametrize("status", [Status.TIME_LIMIT, Status.ERROR])
def test_solver_without_incumbent_falls_back_to_greedy_with_status(monkeypatch, status):
    monkeypatch.setattr(ilp, "solve", _fake(status))
    plan = allocate(SCEN, LIB, demand=DEMAND)
    assert plan.status is status
    assert plan.instances, "never a silent empty plan"
    assert plan.alpha == 1.0
    assert "fallback: template-greedy plan" in plan.notes
    assert verify_plan(plan, SCEN, LIB, demand=DEMAND) == []


def test_time_limit_with_incumbent_keeps_it_and_its_status(monkeypatch):
    real = ilp.solve

    def solve(model, options=None):
        res = real(model, options)
        return SolveResult(status=Status.TIME_LIMIT, objective=res.objective, bound=res.objective * 0.9,
                           gap=0.1, wall_s=res.wall_s, x=res.x, backend=res.backend)

    monkeypatch.setattr(ilp, "solve", solve)
    plan = allocate(SCEN, LIB, demand=DEMAND)
    assert plan.status is Status.TIME_LIMIT and plan.gap == pytest.approx(0.1)
    assert verify_plan(plan, SCEN, LIB, demand=DEMAND) == []


def test_inputs_are_not_modified():
    demand = dict(DEMAND)
    avail = {("r1", "A"): 3}
    prev = {("r1", "m1/prefill/A"): 1}
    allocate(SCEN, LIB, demand=demand, availability=avail, prev=prev)
    assert demand == DEMAND and avail == {("r1", "A"): 3} and prev == {("r1", "m1/prefill/A"): 1}
    assert dict(SCEN.availability) == AVAIL
