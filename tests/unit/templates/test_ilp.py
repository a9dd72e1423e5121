"""The placement ILP: hand-solved instances, both formulations × both backends against the
brute-force oracle and the exact search on seeded random tiny instances, and a real instance."""
from __future__ import annotations

import numpy as np
import pytest
from placement_instances import random_problem

from coral.catalog import builtin_catalog, builtin_model
from coral.errors import CoralError
from coral.perf import Phase, RooflinePerf
from coral.solver import SolveOptions, Status
from coral.templates.bruteforce import solve_bruteforce
from coral.templates.exact import solve_exact
from coral.templates.ilp import formulate, identical_groups, solve_placement_ilp, throughput_bound
from coral.templates.problem import Placement, PlacementProblem, build_problem, evaluate

VARIANTS = [(b, f) for b in ("highs", "cpsat") for f in ("tight", "paper")]
REL = 1e-6


def options(backend: str) -> SolveOptions:
    return SolveOptions(backend=backend, time_limit_s=30.0, mip_gap=1e-9, threads=1)


def reverify(problem: PlacementProblem, placement: Placement) -> None:
    """The decoded placement is feasible and its figures are `evaluate`'s."""
    again = evaluate(problem, [list(s.node_index) for s in placement.stages], [s.layers for s in placement.stages])
    assert again == placement


def fast_slow(stages: int, budget_s: float) -> PlacementProblem:
    # Node A: 1 ms/layer, node B: 3 ms/layer, L = 4, no overheads, no hop cost, u = 6.
    return PlacementProblem(num_layers=4, stages=stages, batch=6, nodes=("A", "B"), t=(1e-3, 3e-3),
                            o=((0.0,) * 4,) * 2, cap=((4,) * 4,) * 2, u=6.0, budget_s=budget_s, comm_s=0.0)


@pytest.mark.parametrize(("backend", "formulation"), VARIANTS)
def test_fast_and_slow_node(backend, formulation):
    # S = 2, one node per stage: A with j layers gives 6/(j ms) = 6000/j, B with 4 - j gives
    # 2000/(4 - j). j = 3: min(2000, 2000) = 2000; j = 2: min(3000, 1000); j = 1: min(6000, 666.7).
    # Either order (no overheads). Latency 3 + 3 = 6 ms: a 6 ms budget admits it exactly.
    got, res = solve_placement_ilp(fast_slow(2, 6e-3), options(backend), formulation)
    assert res.status is Status.OPTIMAL
    assert got.throughput_tok_per_s == pytest.approx(2000.0)
    assert {(s.nodes, s.layers) for s in got.stages} == {(("A",), 3), (("B",), 1)}
    assert got.latency_s == pytest.approx(6e-3)
    assert res.objective == pytest.approx(2000.0, rel=REL)
    reverify(fast_slow(2, 6e-3), got)
    # Every 2-stage split takes ≥ 6 ms (3+3, 2+6, 1+9): a 5.5 ms budget is infeasible.
    none, res = solve_placement_ilp(fast_slow(2, 5.5e-3), options(backend), formulation)
    assert none is None and res.status is Status.INFEASIBLE
    # S = 1: both hold 4 layers: 6/4 ms + 6/12 ms = 1500 + 500 = 2000 tok/s; latency 12 ms (B).
    one, res = solve_placement_ilp(fast_slow(1, 12e-3), options(backend), formulation)
    assert one.throughput_tok_per_s == pytest.approx(2000.0)
    assert one.latency_s == pytest.approx(12e-3)


@pytest.mark.parametrize(("backend", "formulation"), VARIANTS)
def test_two_identical_nodes(backend, formulation):
    # See test_bruteforce: L = 4, t = 1 ms, LM head 1 ms, u = 8, hop 0.5 ms.
    # S = 1: 2 · 8 / 5 ms = 3200 tok/s. S = 2: best split (2, 2) or (3, 1): 8 / 3 ms = 2666.7.
    def problem(stages: int) -> PlacementProblem:
        return PlacementProblem(num_layers=4, stages=stages, batch=8, nodes=("a", "a"), t=(1e-3, 1e-3),
                                o=((0.0, 0.0, 1e-3, 1e-3),) * 2, cap=((4,) * 4,) * 2, u=8.0, budget_s=1.0,
                                comm_s=0.5e-3)
    one, _ = solve_placement_ilp(problem(1), options(backend), formulation)
    two, _ = solve_placement_ilp(problem(2), options(backend), formulation)
    assert one.throughput_tok_per_s == pytest.approx(3200.0)
    assert two.throughput_tok_per_s == pytest.approx(8000 / 3)
    # symmetry breaking (C9): the lower-numbered identical node sits in the earlier stage
    assert [s.node_index for s in two.stages] == [(0,), (1,)]


def test_formulation_shape_and_errors():
    p = random_problem(3)
    ix_j = p.num_layers - p.stages + 1
    k, s = len(p.nodes), p.stages
    for f in ("tight", "paper"):
        m = formulate(p, f)
        assert m.num_cols == s * ix_j + s * k + s * k * ix_j + 1 + s
        assert m.sense == "max" and m.integrality.sum() == m.num_cols - 1 - s
    assert formulate(p, "paper").num_rows > formulate(p, "tight").num_rows
    with pytest.raises(CoralError, match="unknown placement formulation 'loose'"):
        formulate(p, "loose")
    bad = PlacementProblem(num_layers=2, stages=1, batch=1, nodes=("a",), t=(1e-3,), o=((0.0,) * 4,),
                           cap=((2,) * 4,), u=1.0, budget_s=0.0, comm_s=0.0)
    with pytest.raises(CoralError, match="budget_s"):
        formulate(bad, "tight")


def test_identical_groups_need_equal_numbers():
    p = PlacementProblem(num_layers=4, stages=2, batch=1, nodes=("a", "b", "a", "a"),
                         t=(1e-3, 1e-3, 1e-3, 2e-3), o=((0.0,) * 4,) * 4, cap=((4,) * 4,) * 4, u=1.0,
                         budget_s=1.0, comm_s=0.0)
    # node 3 shares the name but not t: not interchangeable
    assert identical_groups(p) == [[0, 2]]


def _theta(placement: Placement | None) -> float | None:
    return None if placement is None else placement.throughput_tok_per_s


def _agree(expected: float | None, got: float | None) -> bool:
    if expected is None or got is None:
        return expected is None and got is None
    return abs(expected - got) <= REL * expected


@pytest.mark.parametrize("seed", range(120))
def test_random_instances_agree_with_the_oracle(seed):
    p = random_problem(seed)
    oracle = solve_bruteforce(p)
    expected = _theta(oracle)
    for backend, formulation in VARIANTS:
        got, res = solve_placement_ilp(p, options(backend), formulation)
        assert _agree(expected, _theta(got)), (seed, backend, formulation, expected, _theta(got), res.status)
        if got is None:
            assert res.status is Status.INFEASIBLE
        else:
            assert res.status is Status.OPTIMAL
            reverify(p, got)
            assert got.throughput_tok_per_s <= throughput_bound(p) * (1 + 1e-12)
            # the solver's own objective matches the re-timed placement
            assert res.objective == pytest.approx(got.throughput_tok_per_s, rel=REL)
            if backend == "cpsat":
                assert res.stats["cpsat_row_error"] < 1e-8
    exact = solve_exact(p)
    assert _agree(expected, _theta(exact)), (seed, "exact", expected, _theta(exact))
    if exact is not None:
        reverify(p, exact)


def test_random_instances_include_infeasible_and_identical_nodes():
    problems = [random_problem(seed) for seed in range(120)]
    infeasible = sum(solve_bruteforce(p) is None for p in problems)
    assert 10 <= infeasible <= 80
    assert sum(bool(identical_groups(p)) for p in problems) >= 30
    assert {p.stages for p in problems} == {1, 2, 3, 4}


def test_real_instance_six_nodes_both_backends_agree():
    # Phi-4 (40 layers) decode, b = 8, 150 ms TPOT, on six nodes of five configurations, S = 2.
    catalog, model = builtin_catalog(), builtin_model("phi-4")
    configs = [catalog.config(n) for n in ("1xL40S", "1xL40S", "2xL4", "1xL4", "1xA10G", "1xT4")]
    p = build_problem(RooflinePerf(), model, Phase.DECODE, configs, stages=2, batch=8, prompt_tokens=1024,
                      output_tokens=256, budget_ms=150)
    assert p.num_layers == 40
    got = {}
    for backend in ("highs", "cpsat"):
        placement, res = solve_placement_ilp(p, SolveOptions(backend=backend, time_limit_s=30.0, mip_gap=1e-9))
        assert res.status is Status.OPTIMAL, (backend, res.status)
        reverify(p, placement)
        got[backend] = placement.throughput_tok_per_s
    assert got["highs"] == pytest.approx(got["cpsat"], rel=REL)
    exact = solve_exact(p)
    assert exact.throughput_tok_per_s == pytest.approx(got["highs"], rel=REL)
    assert np.isfinite(got["highs"]) and got["highs"] > 0
