"""The placement ILP of DESIGN §3 for one `PlacementProblem`: formulate, solve, decode.

Two variants of the same model: `"paper"` (McCormick linking, one latency row per
`(s, k, j)`) and `"tight"` (assignment linking `Σ_j z = y`, one latency row per `(s, k)`).
Both have the same integer solutions; `"tight"` has the stronger LP relaxation.
"""
from __future__ import annotations

from typing import Literal

import numpy as np

from coral.errors import CoralError
from coral.solver import CsrMatrix, MilpModel, SolveOptions, SolveResult, solve
from coral.templates.problem import Placement, PlacementProblem, evaluate, position

Formulation = Literal["paper", "tight"]
FORMULATIONS: tuple[str, ...] = ("paper", "tight")

# Same relative slack `evaluate` grants the latency budget, so the ILP and the checker agree.
BUDGET_SLACK = 1e-9
# CP-SAT grid for the two continuous variables, both normalized to [0, ~1]: θ = Θ/Θ_ub and
# λ'_s = λ_s/budget. 1e-9 of Θ_ub is ≤ 1e-9·(Θ_ub/Θ*) of the optimum, and Θ_ub is the
# balanced-pipeline bound Σ_k u/(L·t_k), within a small factor of Θ*; the decoded placement
# is re-timed by `evaluate` anyway.
RESOLUTION = 1e-9
# CP-SAT proved more placement instances, and found the best incumbent sooner, than HiGHS in
# bench/solver_bench.py (6 nodes, 64 layers, every S), so it is the placement default.
DEFAULT_OPTIONS = SolveOptions(backend="cpsat", time_limit_s=60.0, mip_gap=1e-9)


class _Index:
    """Column layout: x_{s,j} | y_{s,k} | z_{s,k,j} | θ | λ_s (j = 1..J, J = L - S + 1)."""

    def __init__(self, stages: int, nodes: int, layers: int) -> None:
        self.S, self.K, self.J = stages, nodes, layers - stages + 1
        self.y0 = self.S * self.J
        self.z0 = self.y0 + self.S * self.K
        self.theta = self.z0 + self.S * self.K * self.J
        self.lam0 = self.theta + 1
        self.n = self.lam0 + self.S

    def x(self, s: int, j: int) -> int:
        return s * self.J + (j - 1)

    def y(self, s: int, k: int) -> int:
        return self.y0 + s * self.K + k

    def z(self, s: int, k: int, j: int) -> int:
        return self.z0 + (s * self.K + k) * self.J + (j - 1)

    def lam(self, s: int) -> int:
        return self.lam0 + s


class _Rows:
    """Sparse rows collected as COO triplets."""

    def __init__(self) -> None:
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, terms: list[tuple[int, float]], lo: float, hi: float) -> None:
        row = len(self.lo)
        for col, val in terms:
            self.r.append(row)
            self.c.append(col)
            self.v.append(val)
        self.lo.append(lo)
        self.hi.append(hi)

    def matrix(self, n: int) -> CsrMatrix:
        return CsrMatrix.from_coo(self.v, self.r, self.c, shape=(len(self.lo), n))


def identical_groups(problem: PlacementProblem) -> list[list[int]]:
    """Nodes with the same configuration name and the same numbers (t, o, cap), ascending."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for k, name in enumerate(problem.nodes):
        groups.setdefault((name, problem.t[k], problem.o[k], problem.cap[k]), []).append(k)
    return [g for g in groups.values() if len(g) > 1]


def throughput_bound(problem: PlacementProblem) -> float:
    """Θ ≤ Σ_k u/(L·t_k): a node of stage s gives at most u/(j_s·t_k), so j_s·Θ ≤ Σ_{k∈s} u/t_k;
    summing over stages, L·Θ ≤ Σ_k u/t_k (overheads o ≥ 0 only lower it)."""
    p = problem
    return sum(p.u / (p.num_layers * tk) for tk in p.t)


def _check(problem: PlacementProblem, formulation: str) -> None:
    if formulation not in FORMULATIONS:
        raise CoralError(f"unknown placement formulation {formulation!r}; valid: {', '.join(FORMULATIONS)}")
    p = problem
    if not all(tk > 0 for tk in p.t):
        raise CoralError("every per-layer time t[k] must be > 0")
    if not all(ov >= 0 for row in p.o for ov in row):
        raise CoralError("every stage overhead o[k][pos] must be >= 0")
    if not p.u > 0:
        raise CoralError(f"u (work tokens per micro-batch) must be > 0, got {p.u}")
    if not p.budget_s > 0:
        raise CoralError(f"budget_s (the SLO) must be > 0, got {p.budget_s}")
    if not p.comm_s >= 0:
        raise CoralError(f"comm_s must be >= 0, got {p.comm_s}")


def formulate(problem: PlacementProblem, formulation: Formulation = "tight") -> MilpModel:
    """Build the placement MILP. One function on purpose (longer than 80 lines): it builds the
    constraint families below in order, each block labelled `# (C#)` to match this list.

    Sets: stages `s < S`, nodes `k < K`, layer counts `j ∈ [1, J]`, `J = L - S + 1` (every
    other stage holds ≥ 1 layer); `G`: groups of identical nodes.

    Parameters: `τ_{k,s}(j) = j·t_k + o_k[pos(s)]`, `cap_k[pos(s)]`, `u`, budget `B`,
    `comm`, `Θ_ub = Σ_k u/(L·t_k)` (see `throughput_bound`).

    Variables (all binary except θ, λ'):
      `x_{s,j}`: stage s holds j layers; `y_{s,k}`: node k is in stage s;
      `z_{s,k,j} = x_{s,j} ∧ y_{s,k}`, fixed to 0 where `j > cap_k[pos(s)]` (memory);
      `θ ∈ [0, 1]`: throughput in units of `Θ_ub`; `λ'_s ∈ [0, 1 + 1e-9]`: stage s's
      time in units of `B`.

    Objective: maximize `Θ_ub·θ` (tok/s).

    Constraints:
      (C1) `Σ_j x_{s,j} = 1` for every s.
      (C2) `Σ_s Σ_j j·x_{s,j} = L`.
      (C3) `Σ_s y_{s,k} = 1` for every k.
      (C4) `Σ_k y_{s,k} ≥ 1` for every s.
      (C5) linking. paper: `z ≤ x`, `z ≤ y`, `z ≥ x + y - 1` per (s,k,j);
           tight: `Σ_j z_{s,k,j} = y_{s,k}` per (s,k) and `z_{s,k,j} ≤ x_{s,j}`.
      (C6) throughput: `Θ_ub·θ ≤ Σ_k Σ_j (u/τ_{k,s}(j))·z_{s,k,j}` for every s.
      (C7) stage time. paper: `B·λ'_s ≥ τ_{k,s}(j)·z_{s,k,j}` per (s,k,j);
           tight: `B·λ'_s ≥ Σ_j τ_{k,s}(j)·z_{s,k,j}` per (s,k).
      (C8) latency: `Σ_s B·λ'_s ≤ B·(1 + 1e-9) - (S-1)·comm` (the slack `evaluate` grants).
      (C9) symmetry, identical nodes `k < k'` adjacent in a group of G:
           `Σ_s s·y_{s,k} ≤ Σ_s s·y_{s,k'}`.
      (C10) symmetry, middle stages `1 ≤ s < s+1 ≤ S-2`: `Σ_j j·x_{s,j} ≤ Σ_j j·x_{s+1,j}`.

    Why (C9) and (C10) keep an optimum: take any optimal solution. (i) Permute its middle
    stages, each keeping its nodes and layer count, into non-decreasing layer count: every
    node's position class stays MIDDLE, so each stage's τ values, memory checks and Σ u/τ
    are unchanged, and Θ (a min over stages) and latency (a sum over stages) are too; now
    (C10) holds. (ii) Within each group of identical nodes, hand the group's multiset of
    stage indices back to its nodes in ascending node order: every stage keeps the same
    multiset of node parameters, so again nothing changes, (C9) holds, and (C10) is
    untouched since no layer count moved. So an optimal solution satisfies both.

    Args:
        problem: the placement problem (read only).
        formulation: "paper" or "tight".

    Returns:
        The MILP (maximize, tok/s objective) with CP-SAT resolutions on θ and λ'.

    Raises:
        CoralError: unknown formulation, or non-positive t, u, budget, or negative o, comm.
    """
    _check(problem, formulation)
    p = problem
    ix = _Index(p.stages, len(p.nodes), p.num_layers)
    S, K, J, B = ix.S, ix.K, ix.J, p.budget_s
    theta_ub = throughput_bound(p)
    lam_ub = 1.0 + BUDGET_SLACK
    n = ix.n

    lower = np.zeros(n)
    upper = np.ones(n)
    upper[ix.lam0:] = lam_ub
    integrality = np.ones(n, dtype=bool)
    integrality[ix.theta:] = False
    resolution = np.full(n, np.nan)
    resolution[ix.theta:] = RESOLUTION
    names = ([f"x[{s},{j}]" for s in range(S) for j in range(1, J + 1)]
             + [f"y[{s},{k}]" for s in range(S) for k in range(K)]
             + [f"z[{s},{k},{j}]" for s in range(S) for k in range(K) for j in range(1, J + 1)]
             + ["theta"] + [f"lambda[{s}]" for s in range(S)])

    def cap(k: int, s: int) -> int:
        return min(J, p.cap[k][position(s, S)])

    for s in range(S):
        for k in range(K):
            for j in range(cap(k, s) + 1, J + 1):
                upper[ix.z(s, k, j)] = 0.0  # (memory) z_{s,k,j} = 0 where j breaks k's memory
            if cap(k, s) < 1:
                upper[ix.y(s, k)] = 0.0  # implied by the fixed z; stated for presolve

    rows = _Rows()
    inf = np.inf
    # (C1) one layer count per stage
    for s in range(S):
        rows.add([(ix.x(s, j), 1.0) for j in range(1, J + 1)], 1.0, 1.0)
    # (C2) the layer counts sum to L
    rows.add([(ix.x(s, j), float(j)) for s in range(S) for j in range(1, J + 1)], p.num_layers, p.num_layers)
    # (C3) every node in exactly one stage
    for k in range(K):
        rows.add([(ix.y(s, k), 1.0) for s in range(S)], 1.0, 1.0)
    # (C4) every stage has a node
    for s in range(S):
        rows.add([(ix.y(s, k), 1.0) for k in range(K)], 1.0, inf)
    # (C5) linking z = x ∧ y
    for s in range(S):
        for k in range(K):
            if formulation == "tight":
                rows.add([(ix.z(s, k, j), 1.0) for j in range(1, cap(k, s) + 1)] + [(ix.y(s, k), -1.0)], 0.0, 0.0)
                for j in range(1, cap(k, s) + 1):
                    rows.add([(ix.z(s, k, j), 1.0), (ix.x(s, j), -1.0)], -inf, 0.0)
            else:
                for j in range(1, J + 1):
                    if j <= cap(k, s):
                        rows.add([(ix.z(s, k, j), 1.0), (ix.x(s, j), -1.0)], -inf, 0.0)
                        rows.add([(ix.z(s, k, j), 1.0), (ix.y(s, k), -1.0)], -inf, 0.0)
                    # z ≥ x + y - 1; with z fixed at 0 this is the memory row x + y ≤ 1
                    rows.add([(ix.z(s, k, j), 1.0), (ix.x(s, j), -1.0), (ix.y(s, k), -1.0)], -1.0, inf)
    # (C6) Θ ≤ the stage's summed node rates, in units of Θ_ub
    for s in range(S):
        terms = [(ix.theta, 1.0)]
        terms += [(ix.z(s, k, j), -p.u / p.tau(k, s, j) / theta_ub) for k in range(K) for j in range(1, cap(k, s) + 1)]
        rows.add(terms, -inf, 0.0)
    # (C7) stage time ≥ every member's time, in units of B
    for s in range(S):
        for k in range(K):
            if formulation == "tight":
                terms = [(ix.lam(s), 1.0)] + [(ix.z(s, k, j), -p.tau(k, s, j) / B) for j in range(1, cap(k, s) + 1)]
                rows.add(terms, 0.0, inf)
            else:
                for j in range(1, cap(k, s) + 1):
                    rows.add([(ix.lam(s), 1.0), (ix.z(s, k, j), -p.tau(k, s, j) / B)], 0.0, inf)
    # (C8) latency budget
    rows.add([(ix.lam(s), 1.0) for s in range(S)], -inf, lam_ub - (S - 1) * p.comm_s / B)
    # (C9) identical nodes: non-decreasing stage index
    for group in identical_groups(p):
        for k, k2 in zip(group, group[1:], strict=False):
            rows.add([(ix.y(s, k), float(s)) for s in range(1, S)] + [(ix.y(s, k2), -float(s)) for s in range(1, S)],
                     -inf, 0.0)
    # (C10) middle stages: non-decreasing layer count
    for s in range(1, S - 2):
        rows.add([(ix.x(s, j), float(j)) for j in range(1, J + 1)] + [(ix.x(s + 1, j), -float(j)) for j in range(1, J + 1)],
                 -inf, 0.0)

    c = np.zeros(n)
    c[ix.theta] = theta_ub
    return MilpModel(c=c, A=rows.matrix(n), row_lower=np.array(rows.lo), row_upper=np.array(rows.hi),
                     col_lower=lower, col_upper=upper, integrality=integrality, sense="max",
                     resolution=resolution, names=tuple(names))


def decode(problem: PlacementProblem, result: SolveResult) -> Placement | None:
    """Read the stages' nodes and layer counts from a solution and re-verify them.

    Args:
        problem: the problem `formulate` was given.
        result: the solve's result.

    Returns:
        The placement as computed by `evaluate` (its Θ and latency, not the solver's), or
        None when the result has no solution or the solution fails `evaluate`.
    """
    if result.x is None:
        return None
    p = problem
    ix = _Index(p.stages, len(p.nodes), p.num_layers)
    if result.x.shape[0] != ix.n:
        raise CoralError(f"solution has {result.x.shape[0]} values, the model {ix.n}; wrong problem?")
    x = np.rint(result.x[:ix.y0]).reshape(ix.S, ix.J)
    y = np.rint(result.x[ix.y0:ix.z0]).reshape(ix.S, ix.K)
    layers = [int(round(float(x[s] @ np.arange(1, ix.J + 1)))) for s in range(ix.S)]
    stage_of = np.argmax(y, axis=0)
    assignment = [[k for k in range(ix.K) if stage_of[k] == s] for s in range(ix.S)]
    return evaluate(p, assignment, layers)


def solve_placement_ilp(problem: PlacementProblem, options: SolveOptions | None = None,
                        formulation: Formulation = "tight") -> tuple[Placement | None, SolveResult]:
    """Formulate, solve and decode one placement problem.

    Args:
        problem: the placement problem.
        options: backend and limits (default: `DEFAULT_OPTIONS`, CP-SAT).
        formulation: "tight" (default) or "paper".

    Returns:
        `(placement, result)`: the verified placement (None when infeasible, when no
        solution was found in time, or when the solution fails `evaluate`) and the raw
        solve result (status, objective, gap, wall time).

    Raises:
        CoralError: as `formulate` and `coral.solver.solve`.
    """
    model = formulate(problem, formulation)
    result = solve(model, options or DEFAULT_OPTIONS)
    return decode(problem, result), result
