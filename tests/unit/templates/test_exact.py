"""Exact fast search: hand-solved instances and agreement with the brute-force oracle."""
import random

import pytest

from coral.templates import kernel
from coral.templates.bruteforce import solve_bruteforce
from coral.templates.exact import solve_exact, solve_exact_jit, solve_exact_numpy
from coral.templates.multisets import stage_lists
from coral.templates.problem import PlacementProblem, evaluate


def problem(t, L, stages, budget_s, u=1.0, o=None, cap=None, comm_s=0.0, batch=1):
    n = len(t)
    return PlacementProblem(num_layers=L, stages=stages, batch=batch, nodes=tuple(f"n{i}" for i in range(n)), t=tuple(t),
                            o=tuple(o or [(0.0, 0.0, 0.0, 0.0)] * n), cap=tuple(cap or [(L, L, L, L)] * n), u=u,
                            budget_s=budget_s, comm_s=comm_s)


def test_two_unequal_nodes_hand_solved():
    # t = 1 ms and 3 ms per layer, L = 4, u = 1 token per micro-batch, two stages:
    # split (3,1): rates 1/3ms = 333.3 and 1/3ms = 333.3 -> Θ = 333.3, latency 3 + 3 = 6 ms
    # split (2,2): min(500, 166.7); split (1,3): min(1000, 111.1): both worse.
    got = solve_exact(problem([1e-3, 3e-3], 4, 2, budget_s=10e-3))
    assert got is not None
    assert got.throughput_tok_per_s == pytest.approx(1 / 3e-3)
    assert {s.nodes: s.layers for s in got.stages} == {("n0",): 3, ("n1",): 1}
    assert got.latency_s == pytest.approx(6e-3)
    # One stage (data parallel, each node holds all 4 layers): 1/4ms + 1/12ms = 333.3 too,
    # but its latency is the slow node's 12 ms: over a 10 ms SLO.
    assert solve_exact(problem([1e-3, 3e-3], 4, 1, budget_s=10e-3)) is None
    assert solve_exact(problem([1e-3, 3e-3], 4, 1, budget_s=12e-3)).throughput_tok_per_s == pytest.approx(1 / 4e-3 + 1 / 12e-3)
    # A 5 ms SLO: the fastest two-stage split is (3,1) at 6 ms -> infeasible.
    assert solve_exact(problem([1e-3, 3e-3], 4, 2, budget_s=5e-3)) is None


def test_memory_cap_and_comm():
    # Node 0 can hold only 1 layer: the split must be (1,3) with rates 1000 and 1/9ms = 111.1.
    got = solve_exact(problem([1e-3, 3e-3], 4, 2, budget_s=20e-3, cap=[(1, 1, 1, 1), (4, 4, 4, 4)]))
    assert {s.nodes: s.layers for s in got.stages} == {("n0",): 1, ("n1",): 3}
    # comm of 2 ms makes latency 1 + 9 + 2 = 12 ms
    got = solve_exact(problem([1e-3, 3e-3], 4, 2, budget_s=20e-3, cap=[(1, 1, 1, 1), (4, 4, 4, 4)], comm_s=2e-3))
    assert got.latency_s == pytest.approx(12e-3)


def test_floor_returns_only_better():
    p = problem([1e-3, 3e-3], 4, 2, budget_s=10e-3)
    assert solve_exact(p, floor=1 / 3e-3) is None
    assert solve_exact(p, floor=300.0) is not None


def test_stage_lists_counts():
    # 3 distinct nodes into 3 stages: first and last chosen (3*2), one middle: 6 lists
    assert len(stage_lists((1, 1, 1), 3)) == 6
    # 3 identical nodes into 2 stages: (1 | 2) and (2 | 1)
    assert stage_lists((3,), 2) == (((1,), (2,)), ((2,), (1,)))
    assert stage_lists((2,), 1) == (((2,),),)


@pytest.mark.parametrize("seed", range(60))
def test_agrees_with_bruteforce(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    L = rng.randint(max(2, n), 10)
    kinds = [(rng.uniform(1e-3, 5e-3), tuple(rng.uniform(0, 2e-3) for _ in range(4)),
              tuple(rng.randint(1, L) for _ in range(4))) for _ in range(rng.randint(1, 3))]
    nodes = [rng.choice(kinds) for _ in range(n)]  # repeats make identical nodes
    for stages in range(1, n + 1):
        p = PlacementProblem(num_layers=L, stages=stages, batch=1, nodes=tuple(f"k{kinds.index(k)}" for k in nodes),
                             t=tuple(k[0] for k in nodes), o=tuple(k[1] for k in nodes), cap=tuple(k[2] for k in nodes),
                             u=rng.uniform(1, 100), budget_s=rng.uniform(5e-3, 40e-3), comm_s=rng.uniform(0, 2e-3))
        fast, oracle = solve_exact(p), solve_bruteforce(p)
        assert (fast is None) == (oracle is None)
        if fast is not None:
            assert fast.throughput_tok_per_s == pytest.approx(oracle.throughput_tok_per_s, rel=1e-9)
            # re-verify the answer from scratch
            again = evaluate(p, [list(s.node_index) for s in fast.stages], [s.layers for s in fast.stages])
            assert again is not None and again.throughput_tok_per_s == fast.throughput_tok_per_s
            assert sum(s.layers for s in fast.stages) == L


def test_decode_caps_hand_example():
    from coral.templates.problem import decode_caps

    # 100 ms TPOT over 2 stages: each stage may take 50 ms; a node with 4 ms/layer and 2 ms of
    # LM head (last position) holds at most floor((50 - 2) / 4) = 12 layers there, 12 in the
    # middle (floor(50/4) = 12); memory (10) binds first elsewhere.
    assert decode_caps(4e-3, (0.0, 0.0, 2e-3, 2e-3), (10, 20, 20, 20), 0.1, 2) == (10, 12, 12, 12)


needs_jit = pytest.mark.skipif(not kernel.HAVE_JIT, reason="numba is not installed")


@needs_jit
@pytest.mark.parametrize("seed", range(40))
def test_compiled_and_numpy_search_agree(seed):
    # Up to 6 nodes of up to 5 kinds, up to 94 layers, random floors: the compiled search and the
    # numpy one return the same optimum and the same placement (same tie-break), or both None.
    rng = random.Random(1000 + seed)
    for _ in range(10):
        n = rng.randint(1, 6)
        L = rng.randint(max(2, n), 94)
        kinds = [(rng.uniform(1e-3, 5e-3), tuple(rng.uniform(0, 4e-3) for _ in range(4)),
                  tuple(rng.randint(1, L) for _ in range(4))) for _ in range(rng.randint(1, 5))]
        nodes = [rng.choice(kinds) for _ in range(n)]
        p = PlacementProblem(num_layers=L, stages=rng.randint(1, n), batch=1,
                             nodes=tuple(f"k{kinds.index(k)}" for k in nodes), t=tuple(k[0] for k in nodes),
                             o=tuple(k[1] for k in nodes), cap=tuple(k[2] for k in nodes), u=rng.uniform(1, 100),
                             budget_s=rng.uniform(20e-3, 400e-3), comm_s=rng.uniform(0, 2e-3))
        floor = 0.0 if rng.random() < 0.5 else rng.uniform(0, 2000)
        jit, ref = solve_exact_jit(p, floor), solve_exact_numpy(p, floor)
        assert (jit is None) == (ref is None)
        if ref is not None:
            assert jit.throughput_tok_per_s == pytest.approx(ref.throughput_tok_per_s, rel=1e-12)
            assert [s.node_index for s in jit.stages] == [s.node_index for s in ref.stages]
            assert [s.layers for s in jit.stages] == [s.layers for s in ref.stages]
            assert jit.throughput_tok_per_s > floor


def test_no_jit_switch(monkeypatch):
    monkeypatch.setenv("CORAL_NO_JIT", "1")
    assert not kernel.enabled()
    monkeypatch.setenv("CORAL_NO_JIT", "0")
    assert kernel.enabled() == kernel.HAVE_JIT
