"""The solver adapter on tiny known MILPs: both backends, statuses, CP-SAT scaling, no aliasing."""
from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
import scipy.sparse as sp

from coral.errors import CoralError
from coral.solver import CsrMatrix, MilpModel, SolveOptions, Status, available_backends, solve

BACKENDS = ["highs", "cpsat"]
INF = np.inf


def knapsack(integrality=(True, True), resolution=None) -> MilpModel:
    # max 5x + 4y  s.t.  6x + 4y <= 24,  x + 2y <= 6,  0 <= x, y <= 10.
    # LP optimum (3, 1.5) = 15 + 6 = 21. Integers: (4, 0) = 20 (6·4 = 24 ok); (3, 1) = 19;
    # (2, 2) = 18; (0, 3) = 12 -> 20 at (4, 0).
    return MilpModel(c=[5, 4], A=sp.csr_matrix([[6.0, 4.0], [1.0, 2.0]]), row_lower=[-INF, -INF],
                     row_upper=[24, 6], col_lower=[0, 0], col_upper=[10, 10], integrality=list(integrality),
                     sense="max", resolution=resolution, names=("x", "y"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_knapsack(backend):
    res = solve(knapsack(), SolveOptions(backend=backend))
    assert res.status is Status.OPTIMAL
    assert res.objective == pytest.approx(20.0)
    assert res.bound == pytest.approx(20.0)
    assert res.gap == pytest.approx(0.0, abs=1e-9)
    np.testing.assert_allclose(res.x, [4.0, 0.0], atol=1e-9)
    assert res.wall_s > 0 and res.backend == backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_integer_with_continuous_y(backend):
    # y continuous: x = 3, y = 1.5 gives 21 (both rows tight); x = 4 forces y = 0 (20).
    # CP-SAT puts y on a 0.5 grid, which contains 1.5, so it is exact.
    res = solve(knapsack((True, False), resolution=[np.nan, 0.5]), SolveOptions(backend=backend))
    assert res.status is Status.OPTIMAL
    assert res.objective == pytest.approx(21.0)
    np.testing.assert_allclose(res.x, [3.0, 1.5], atol=1e-9)


def test_cpsat_grid_error_is_the_callers_resolution():
    # On a grid of 0.4 for y, 6x + 4y <= 24 with x = 3 allows y <= 1.5 -> y = 1.2 (grid), 15 + 4.8 = 19.8;
    # x = 4, y = 0 gives 20 -> 20. x = 2: y <= 2 -> 2.0 is on the grid: 10 + 8 = 18.
    res = solve(knapsack((True, False), resolution=[np.nan, 0.4]), SolveOptions(backend="cpsat"))
    assert res.status is Status.OPTIMAL
    assert res.objective == pytest.approx(20.0)


def test_minimize_with_equality_and_offset():
    # min 2a + 3b + 1 s.t. a + b = 3, a <= 2 (bound), integers: a = 2, b = 1 -> 4 + 3 + 1 = 8.
    m = MilpModel(c=[2, 3], A=sp.csr_matrix([[1.0, 1.0]]), row_lower=[3], row_upper=[3], col_lower=[0, 0],
                  col_upper=[2, 5], integrality=[True, True], offset=1.0)
    for backend in BACKENDS:
        res = solve(m, SolveOptions(backend=backend))
        assert res.status is Status.OPTIMAL
        assert res.objective == pytest.approx(8.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_infeasible(backend):
    # x + y >= 3 with two binaries.
    m = MilpModel(c=[1, 1], A=sp.csr_matrix([[1.0, 1.0]]), row_lower=[3], row_upper=[INF], col_lower=[0, 0],
                  col_upper=[1, 1], integrality=[True, True])
    res = solve(m, SolveOptions(backend=backend))
    assert res.status is Status.INFEASIBLE
    assert res.x is None and res.gap == np.inf


def market_split(rows: int = 4, cols: int = 40, seed: int = 1) -> MilpModel:
    """Cornuéjols-Dawande market split: Σ_j a_ij x_j = ⌊Σ_j a_ij / 2⌋, x binary. Notoriously hard
    for branch and bound at this size, so a tiny time limit ends without an answer."""
    rng = random.Random(seed)
    a = np.array([[rng.randint(0, 99) for _ in range(cols)] for _ in range(rows)], dtype=float)
    rhs = np.floor(a.sum(axis=1) / 2)
    return MilpModel(c=np.zeros(cols), A=sp.csr_matrix(a), row_lower=rhs, row_upper=rhs, col_lower=np.zeros(cols),
                     col_upper=np.ones(cols), integrality=np.ones(cols, dtype=bool))


@pytest.mark.parametrize("backend", BACKENDS)
def test_time_limit(backend):
    res = solve(market_split(), SolveOptions(backend=backend, time_limit_s=0.2, threads=1))
    assert res.status is Status.TIME_LIMIT
    assert res.wall_s < 5


def test_highs_takes_a_large_model_in_one_call():
    # 100,000 columns in pairs: x_{2i} + x_{2i+1} = 1, cost 1 on even and 2 on odd columns -> every
    # pair picks its even column: objective n/2. Guards the bulk (CSR) path: no per-column Python.
    n = 100_000
    rows = np.repeat(np.arange(n // 2), 2)
    a = sp.csr_matrix((np.ones(n), (rows, np.arange(n))), shape=(n // 2, n))
    c = np.tile([1.0, 2.0], n // 2)
    m = MilpModel(c=c, A=a, row_lower=np.ones(n // 2), row_upper=np.ones(n // 2), col_lower=np.zeros(n),
                  col_upper=np.ones(n), integrality=np.ones(n, dtype=bool))
    res = solve(m, SolveOptions(backend="highs"))
    assert res.status is Status.OPTIMAL
    assert res.objective == pytest.approx(n / 2, rel=1e-9)
    assert res.wall_s < 10


def test_model_copies_and_freezes_its_arrays():
    c = np.array([5.0, 4.0])
    upper = np.array([10.0, 10.0])
    a = sp.csr_matrix([[6.0, 4.0], [1.0, 2.0]])
    m = MilpModel(c=c, A=a, row_lower=[-INF, -INF], row_upper=[24, 6], col_lower=[0, 0], col_upper=upper,
                  integrality=[True, True], sense="max")
    c[0] = 100.0
    upper[0] = 0.0
    a.data[:] = 0.0
    assert m.c[0] == 5.0 and m.col_upper[0] == 10.0 and m.A[0, 0] == 6.0
    with pytest.raises(ValueError, match="read-only"):
        m.c[0] = 1.0
    before = m.A.toarray().copy()
    solve(m, SolveOptions(backend="cpsat"))
    solve(m, SolveOptions(backend="highs"))
    np.testing.assert_array_equal(before, m.A.toarray())


def test_model_validation():
    with pytest.raises(ValueError, match="columns"):
        MilpModel(c=[1, 2, 3], A=sp.csr_matrix((1, 2)), row_lower=[0], row_upper=[1], col_lower=[0, 0],
                  col_upper=[1, 1], integrality=[True, True])
    with pytest.raises(ValueError, match="lower bound > upper bound"):
        MilpModel(c=[1], A=sp.csr_matrix((0, 1)), row_lower=[], row_upper=[], col_lower=[2], col_upper=[1],
                  integrality=[True])
    with pytest.raises(ValueError, match="sense"):
        MilpModel(c=[1], A=sp.csr_matrix((0, 1)), row_lower=[], row_upper=[], col_lower=[0], col_upper=[1],
                  integrality=[True], sense="maximize")


def test_options_validation():
    with pytest.raises(CoralError, match="unknown solver backend 'glpk'"):
        SolveOptions(backend="glpk")
    with pytest.raises(CoralError, match="time_limit_s"):
        SolveOptions(time_limit_s=0)
    with pytest.raises(CoralError, match="mip_gap"):
        SolveOptions(mip_gap=-1e-3)


def test_cpsat_needs_a_resolution_and_finite_bounds():
    with pytest.raises(CoralError, match="resolution > 0 for every continuous variable; missing for y"):
        solve(knapsack((True, False)), SolveOptions(backend="cpsat"))
    m = MilpModel(c=[1], A=sp.csr_matrix((0, 1)), row_lower=[], row_upper=[], col_lower=[0], col_upper=[INF],
                  integrality=[True])
    with pytest.raises(CoralError, match="finite bounds"):
        solve(m, SolveOptions(backend="cpsat"))


@pytest.mark.skipif(importlib.util.find_spec("gurobipy") is not None, reason="gurobipy is installed")
def test_gurobi_missing_is_a_clear_error():
    assert "gurobi" not in available_backends()
    with pytest.raises(CoralError, match="needs the gurobipy package"):
        solve(knapsack(), SolveOptions(backend="gurobi"))


def test_cpsat_scaling_keeps_fractional_coefficients_precise():
    # max x s.t. 0.1·x + 1e-7·y <= 0.3 + 1e-7, y binary, x on a 1e-6 grid in [0, 10]:
    # y = 1 -> x <= 3; y = 0 -> x <= 3.000001 -> the optimum is x = 3.000001, y = 0.
    m = MilpModel(c=[1, 0], A=sp.csr_matrix([[0.1, 1e-7]]), row_lower=[-INF], row_upper=[0.3 + 1e-7],
                  col_lower=[0, 0], col_upper=[10, 1], integrality=[False, True], sense="max",
                  resolution=[1e-6, np.nan])
    res = solve(m, SolveOptions(backend="cpsat"))
    assert res.status is Status.OPTIMAL
    assert res.objective == pytest.approx(3.000001, rel=1e-12)
    assert res.stats["cpsat_row_error"] < 1e-8


@pytest.mark.parametrize("backend", ["highs", "cpsat"])
def test_start_point_is_used_and_never_trusted(backend):
    # max 3x + 2y, x + y <= 4, x + 3y <= 6, integers: optimum x=4, y=0 -> 12
    m = MilpModel(c=np.array([3.0, 2.0]), A=sp.csr_matrix(np.array([[1.0, 1.0], [1.0, 3.0]])),
                  row_lower=np.array([-np.inf, -np.inf]), row_upper=np.array([4.0, 6.0]),
                  col_lower=np.zeros(2), col_upper=np.array([10.0, 10.0]), integrality=np.array([True, True]),
                  sense="max")
    good = solve(m, SolveOptions(backend=backend), start=np.array([3.0, 1.0]))
    bad = solve(m, SolveOptions(backend=backend), start=np.array([9.0, 9.0]))  # infeasible: ignored
    assert good.objective == pytest.approx(12.0) and bad.objective == pytest.approx(12.0)


def test_csr_matrix_from_coo_equals_scipy_with_duplicates_summed():
    rng = np.random.default_rng(3)
    rows, cols = rng.integers(0, 7, 60), rng.integers(0, 5, 60)  # many repeated (row, col) pairs
    vals = rng.normal(size=60)
    ours = CsrMatrix.from_coo(vals, rows, cols, shape=(9, 5))  # rows 7 and 8 stay empty
    ref = sp.csr_matrix((vals, (rows, cols)), shape=(9, 5))
    ref.sum_duplicates()
    ref.sort_indices()
    np.testing.assert_array_equal(ref.indptr, ours.indptr)
    np.testing.assert_array_equal(ref.indices, ours.indices)
    np.testing.assert_allclose(ref.data, ours.data, rtol=1e-15)
    np.testing.assert_allclose(ref.toarray(), ours.toarray(), rtol=1e-15)
    assert ref.toarray()[2, 3] == pytest.approx(ours[2, 3], rel=1e-15)
    assert 0.0 == ours[8, 0]
    np.testing.assert_allclose(ours.toarray(), CsrMatrix.of(ref).toarray(), rtol=1e-15)


def test_csr_matrix_of_dense_rows_and_bad_entries():
    dense = np.array([[0.0, 2.0, 0.0], [1.0, 0.0, 3.0], [0.0, 0.0, 0.0], [4.0, 5.0, 6.0]])
    a = CsrMatrix.of(dense)
    assert (4, 3, 6) == (*a.shape, a.nnz)
    np.testing.assert_array_equal(dense, a.toarray())
    np.testing.assert_array_equal(dense[[False, True, True, True]], a.rows(np.array([False, True, True, True])).toarray())
    assert (0, 3) == a.rows(np.zeros(4, dtype=bool)).shape
    with pytest.raises(ValueError, match="outside the 2 x 2 matrix"):
        CsrMatrix.from_coo([1.0], [2], [0], shape=(2, 2))
    with pytest.raises(ValueError, match="differ in length"):
        CsrMatrix.from_coo([1.0, 2.0], [0], [0], shape=(2, 2))
    with pytest.raises(ValueError, match="must be 2-D"):
        CsrMatrix.of([1.0, 2.0])


def test_a_model_takes_dense_scipy_or_our_matrix_alike():
    dense = [[6.0, 4.0], [1.0, 2.0]]
    results = []
    for a in (dense, sp.csr_matrix(dense), CsrMatrix.of(dense)):
        m = MilpModel(c=[5, 4], A=a, row_lower=[-INF, -INF], row_upper=[24, 6], col_lower=[0, 0], col_upper=[INF, INF],
                      integrality=[False, False], sense="max")  # the LP optimum (3, 1.5)
        results.append(solve(m).objective)
    assert [21.0, 21.0, 21.0] == results
