"""The brute-force placement oracle: its enumerations and hand-solved instances."""
from __future__ import annotations

import math

import pytest

from coral.errors import CoralError
from coral.templates.bruteforce import assignments, compositions, solve_bruteforce
from coral.templates.problem import PlacementProblem


def two_identical(stages: int, budget_s: float = 1.0, cap: int = 4) -> PlacementProblem:
    # Two identical nodes, L = 4, t = 1 ms/layer; the last stage (and a lone stage) pays a 1 ms LM
    # head; u = 8 tokens per micro-batch; one hop costs 0.5 ms.
    return PlacementProblem(num_layers=4, stages=stages, batch=8, nodes=("a", "a"), t=(1e-3, 1e-3),
                            o=((0.0, 0.0, 1e-3, 1e-3),) * 2, cap=((cap, cap, cap, cap),) * 2, u=8.0,
                            budget_s=budget_s, comm_s=0.5e-3)


def test_compositions_and_assignments_are_complete():
    assert sorted(compositions(4, 2)) == [(1, 3), (2, 2), (3, 1)]
    assert len(list(compositions(12, 4))) == math.comb(11, 3)
    # surjections of 4 nodes onto 3 stages: 3! · S(4, 3) = 6 · 6 = 36
    assert len(list(assignments(4, 3))) == 36
    assert list(assignments(2, 1)) == [[[0, 1]]]


def test_two_identical_nodes_one_stage():
    # S = 1: both nodes hold all 4 layers: τ = 4·1 + 1 = 5 ms each; Θ = 2 · 8 / 5 ms = 3200 tok/s;
    # latency 5 ms.
    got = solve_bruteforce(two_identical(1))
    assert got.throughput_tok_per_s == pytest.approx(3200.0)
    assert got.latency_s == pytest.approx(5e-3)
    assert [s.layers for s in got.stages] == [4]


def test_two_identical_nodes_two_stages():
    # S = 2, one node per stage, split (j0, j1): τ0 = j0 ms, τ1 = j1 + 1 ms, Θ = min(8/τ0, 8/τ1):
    # (1, 3): min(8000, 2000) = 2000; (2, 2): min(4000, 2666.7) = 2666.7; (3, 1): min(2666.7, 4000)
    # = 2666.7. Best 8000/3 tok/s, latency 2 + 3 + 0.5 = 3 + 2 + 0.5 = 5.5 ms. Pipelining loses
    # to data parallelism here (3200 above).
    got = solve_bruteforce(two_identical(2))
    assert got.throughput_tok_per_s == pytest.approx(8000 / 3)
    assert got.latency_s == pytest.approx(5.5e-3)
    assert tuple(s.layers for s in got.stages) in {(2, 2), (3, 1)}


def test_budget_and_memory_make_it_infeasible():
    # A 5.2 ms budget admits the 5 ms single stage but no 2-stage split (every one takes 5.5 ms:
    # j0 + (4 - j0 + 1) + 0.5).
    assert solve_bruteforce(two_identical(1, budget_s=5.2e-3)) is not None
    assert solve_bruteforce(two_identical(2, budget_s=5.2e-3)) is None
    # Memory for 3 layers: a single stage (4 layers) does not fit; two stages (2, 2) do.
    assert solve_bruteforce(two_identical(1, cap=3)) is None
    assert solve_bruteforce(two_identical(2, cap=3)).throughput_tok_per_s == pytest.approx(8000 / 3)


def test_refuses_large_instances():
    p = PlacementProblem(num_layers=13, stages=1, batch=1, nodes=("a",), t=(1e-3,), o=((0, 0, 0, 0),),
                         cap=((13, 13, 13, 13),), u=1.0, budget_s=1.0, comm_s=0.0)
    with pytest.raises(CoralError, match="brute force is for L <= 12"):
        solve_bruteforce(p)
