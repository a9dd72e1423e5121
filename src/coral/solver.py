"""The one adapter between Coral's MILPs and solver libraries (HiGHS, CP-SAT, Gurobi).

Formulations build a backend-neutral `MilpModel` (sparse CSR rows, bounds, integrality) and
call `solve(model, options)`; nothing else in Coral imports `highspy`, `ortools` or `gurobipy`.

CP-SAT works on integers only. The adapter maps a `MilpModel` onto it as follows:

* every continuous variable `x_i` must carry a grid step `resolution[i] > 0` and finite
  bounds; it becomes `x_i = resolution[i] · n_i` with an integer `n_i` in
  `[ceil(lb/res), floor(ub/res)]`. The caller states the step, so the caller owns the
  discretization error (the placement ILP uses 1e-12 of each variable's range);
* integer variables need finite bounds (CP-SAT has no infinite domains);
* every row (and the objective) is multiplied by about `f = 2^53 / M`, where `M` is the
  row's largest possible |activity| over the (grid-index) bounds (CP-SAT's own MIP import
  uses the same 2^53), and its coefficients are rounded to integers; `f` is nudged so the
  coefficient of the variable with the widest grid range is exactly integral, and a row
  with integer coefficients is kept exact. Rounding coefficient `j` by at most 1/2 moves
  the activity by at most `span_j / 2` units (`span_j`: the largest |grid index| of `j`),
  so a row is exact to `(Σ_j span_j - max_j span_j) · 2^-54` of `M`, usually far better
  (`SolveResult.stats["cpsat_row_error"]` reports the worst row's actual figure): keep wide
  grids (many steps) to one per row or give them equal coefficients, as the placement ILP
  does. Row bounds are rounded outward by at
  most one unit (2^-53 of `M`).

The reported objective and `x` are in the model's own units (`x = resolution · n`), and the
objective is recomputed as `c·x` in floating point; the best bound is divided back.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

import numpy as np

from coral.errors import CoralError

Backend = Literal["highs", "cpsat", "gurobi"]
BACKENDS: tuple[str, ...] = ("highs", "cpsat", "gurobi")

# A row's largest |activity| after scaling to integers. CP-SAT's own MIP import uses 2^53
# (`mip_max_activity_exponent`); at 2^60 its presolve returned a wrong "optimal" answer on a
# placement instance, so stay at 2^53.
_CPSAT_SCALE = float(2**53)
_BIG = 2**62  # CP-SAT's stand-in for an infinite row bound


class Status(StrEnum):
    """How a solve ended. `OPTIMAL` means proved optimal within `SolveOptions.mip_gap`;
    `TIME_LIMIT` may still carry an incumbent in `SolveResult.x`; `FEASIBLE` is an
    incumbent without proof that stopped for another reason; `ERROR` covers unbounded
    models and solver failures (see `SolveResult.message`)."""

    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    INFEASIBLE = "infeasible"
    TIME_LIMIT = "time_limit"
    ERROR = "error"


def _frozen_array(a: Any, n: int, what: str, dtype: type = float) -> np.ndarray:
    arr: np.ndarray = np.array(a, dtype=dtype, copy=True).reshape(-1)
    if arr.shape != (n,):
        raise ValueError(f"{what} needs {n} entries, got {arr.shape[0]}")
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, slots=True, eq=False)
class CsrMatrix:
    """A read-only sparse matrix in compressed sparse rows (the layout HiGHS reads): row `r` holds
    `data[indptr[r]:indptr[r + 1]]` in the columns `indices[...]`, sorted, without duplicates.

    Coral's own rather than scipy's, so that building and solving a model never imports scipy
    (about 0.1 s of every `coral plan`). Build one with `from_coo` or `of`.
    """

    data: np.ndarray
    indices: np.ndarray
    indptr: np.ndarray
    shape: tuple[int, int]

    @classmethod
    def from_coo(cls, values: Any, rows: Any, cols: Any, shape: tuple[int, int]) -> CsrMatrix:
        """The matrix with `values[k]` at `(rows[k], cols[k])`; duplicates are summed (as scipy's
        `csr_matrix((values, (rows, cols)))` does).

        Raises:
            ValueError: entries outside `shape`, or arrays of different lengths.
        """
        v = np.asarray(values, dtype=np.float64).reshape(-1)
        r = np.asarray(rows, dtype=np.int64).reshape(-1)
        c = np.asarray(cols, dtype=np.int64).reshape(-1)
        m, n = int(shape[0]), int(shape[1])
        if not (v.shape == r.shape == c.shape):
            raise ValueError(f"values, rows and cols differ in length ({v.size}, {r.size}, {c.size})")
        if v.size and (r.min() < 0 or r.max() >= m or c.min() < 0 or c.max() >= n):
            raise ValueError(f"an entry lies outside the {m} x {n} matrix")
        order = np.lexsort((c, r))
        r, c, v = r[order], c[order], v[order]
        if v.size:
            first = np.flatnonzero(np.concatenate([[True], (r[1:] != r[:-1]) | (c[1:] != c[:-1])]))
            v, r, c = np.add.reduceat(v, first), r[first], c[first]
        indptr = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(np.bincount(r, minlength=m), out=indptr[1:])
        return cls._frozen(v, c, indptr, (m, n))

    @classmethod
    def of(cls, a: Any) -> CsrMatrix:
        """`a` as a CsrMatrix: a CsrMatrix (returned as is: it is read-only), a scipy sparse matrix
        or anything `np.asarray` makes 2-D."""
        if isinstance(a, CsrMatrix):
            return a
        if hasattr(a, "tocoo"):  # scipy.sparse, without importing it
            coo = a.tocoo()
            return cls.from_coo(coo.data, coo.row, coo.col, coo.shape)
        dense = np.asarray(a, dtype=np.float64)
        if dense.ndim != 2:
            raise ValueError(f"A must be 2-D, got shape {dense.shape}")
        r, c = np.nonzero(dense)
        return cls.from_coo(dense[r, c], r, c, dense.shape)

    @classmethod
    def _frozen(cls, data: np.ndarray, indices: np.ndarray, indptr: np.ndarray, shape: tuple[int, int]) -> CsrMatrix:
        for arr in (data, indices, indptr):
            arr.setflags(write=False)
        return cls(data, indices, indptr, shape)

    @property
    def nnz(self) -> int:
        return int(self.data.size)

    def row_of(self) -> np.ndarray:
        """The row of each stored entry."""
        return np.repeat(np.arange(self.shape[0]), np.diff(self.indptr))

    def toarray(self) -> np.ndarray:
        """The dense matrix."""
        out = np.zeros(self.shape)
        out[self.row_of(), self.indices] = self.data
        return out

    def __getitem__(self, ij: tuple[int, int]) -> float:
        """One entry, `A[i, j]` (0.0 where none is stored)."""
        i, j = ij
        lo, hi = self.indptr[i], self.indptr[i + 1]
        k = lo + int(np.searchsorted(self.indices[lo:hi], j))
        return float(self.data[k]) if k < hi and self.indices[k] == j else 0.0

    def rows(self, mask: np.ndarray) -> CsrMatrix:
        """The rows where `mask` is true."""
        keep = np.flatnonzero(mask)
        counts = np.diff(self.indptr)[keep]
        indptr = np.zeros(keep.size + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        take = np.arange(indptr[-1]) + np.repeat(self.indptr[keep] - indptr[:-1], counts)
        return CsrMatrix._frozen(self.data[take], self.indices[take], indptr, (int(keep.size), self.shape[1]))


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class MilpModel:
    """`optimize c·x` s.t. `row_lower ≤ A x ≤ row_upper`, `col_lower ≤ x ≤ col_upper`,
    `x_i` integer where `integrality[i]`.

    Infinite bounds are `±inf`. `resolution[i]` is the grid step CP-SAT may use for a
    continuous `x_i` (`nan`: none given; CP-SAT then refuses the model). Arrays are
    copied and made read-only, so a model never aliases its caller's buffers.
    """

    c: np.ndarray
    A: CsrMatrix
    row_lower: np.ndarray
    row_upper: np.ndarray
    col_lower: np.ndarray
    col_upper: np.ndarray
    integrality: np.ndarray
    sense: Literal["min", "max"] = "min"
    offset: float = 0.0
    resolution: np.ndarray | None = None
    names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.sense not in ("min", "max"):
            raise ValueError(f"sense must be 'min' or 'max', got {self.sense!r}")
        n = np.asarray(self.c).reshape(-1).shape[0]
        a = CsrMatrix.of(self.A)
        if a.shape[1] != n:
            raise ValueError(f"A has {a.shape[1]} columns but c has {n} entries")
        m = a.shape[0]
        set_ = object.__setattr__
        set_(self, "A", a)
        set_(self, "c", _frozen_array(self.c, n, "c"))
        set_(self, "row_lower", _frozen_array(self.row_lower, m, "row_lower"))
        set_(self, "row_upper", _frozen_array(self.row_upper, m, "row_upper"))
        set_(self, "col_lower", _frozen_array(self.col_lower, n, "col_lower"))
        set_(self, "col_upper", _frozen_array(self.col_upper, n, "col_upper"))
        set_(self, "integrality", _frozen_array(self.integrality, n, "integrality", bool))
        if self.resolution is not None:
            set_(self, "resolution", _frozen_array(self.resolution, n, "resolution"))
        if self.names is not None and len(self.names) != n:
            raise ValueError(f"names needs {n} entries, got {len(self.names)}")
        for what, v in (("c", self.c), ("A", a.data)):
            if not np.all(np.isfinite(v)):
                raise ValueError(f"{what} has non-finite entries")
        if np.any(self.row_lower > self.row_upper):
            raise ValueError("some row has lower bound > upper bound")
        if np.any(self.col_lower > self.col_upper):
            raise ValueError("some variable has lower bound > upper bound")

    @property
    def num_cols(self) -> int:
        return int(self.c.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.A.shape[0])

    def name(self, i: int) -> str:
        return self.names[i] if self.names is not None else f"x{i}"


@dataclass(frozen=True, slots=True, kw_only=True)
class SolveOptions:
    """How to solve: backend, wall-clock limit, relative MIP gap, threads (None: the
    backend's default), seed."""

    backend: Backend = "highs"
    time_limit_s: float = 60.0
    mip_gap: float = 1e-9
    threads: int | None = None
    seed: int = 0
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise CoralError(f"unknown solver backend {self.backend!r}; valid: {', '.join(BACKENDS)}")
        if not self.time_limit_s > 0:
            raise CoralError(f"time_limit_s must be > 0, got {self.time_limit_s}")
        if not 0 <= self.mip_gap < 1:
            raise CoralError(f"mip_gap must be in [0, 1), got {self.mip_gap}")
        if self.threads is not None and self.threads < 1:
            raise CoralError(f"threads must be >= 1, got {self.threads}")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SolveResult:
    """The outcome of one solve. `objective` / `bound` are in the model's sense and units
    (`nan` when absent); `gap` is `|objective - bound| / max(|objective|, 1e-12)` (`inf`
    without an incumbent); `x` is the incumbent (read-only) or None. `reduced_costs`: for an LP
    solved to optimality by HiGHS, each column's reduced cost `c_j − A_jᵀy` in the model's sense
    (≥ 0 at its lower bound when minimizing, ≤ 0 when maximizing); None otherwise."""

    status: Status
    objective: float
    bound: float
    gap: float
    wall_s: float
    x: np.ndarray | None
    backend: str
    message: str = ""
    stats: dict[str, float] = field(default_factory=dict)
    reduced_costs: np.ndarray | None = None

    @property
    def has_solution(self) -> bool:
        return self.x is not None


def available_backends() -> tuple[str, ...]:
    """Backends that can run here (Gurobi only when `gurobipy` is importable)."""
    return tuple(b for b in BACKENDS if b != "gurobi" or importlib.util.find_spec("gurobipy") is not None)


def solve(model: MilpModel, options: SolveOptions | None = None, *, start: np.ndarray | None = None) -> SolveResult:
    """Solve `model` with the backend of `options`.

    Args:
        model: the MILP; never modified.
        options: backend and limits (defaults: HiGHS, 60 s, gap 1e-9).
        start: a known feasible point (one value per column) the backend starts from as its
            incumbent (HiGHS `setSolution`, CP-SAT hints, Gurobi `Start`); a point that is not
            feasible is ignored by the backend, never trusted.

    Returns:
        A `SolveResult` with an explicit status.

    Raises:
        CoralError: the backend is not installed (Gurobi), or the model cannot be expressed
            for it (CP-SAT: a continuous variable without a resolution or infinite bounds).
    """
    options = options or SolveOptions()
    began = time.perf_counter()
    duals = None
    if options.backend == "highs":
        res, duals = _solve_highs(model, options, start)
    elif options.backend == "cpsat":
        res = _solve_cpsat(model, options, start)
    else:
        res = _solve_gurobi(model, options, start)
    status, obj, bound, x, message, stats = res
    if x is not None:
        x = np.array(x, dtype=float)
        x.setflags(write=False)
    gap = _gap(obj, bound) if x is not None else math.inf
    return SolveResult(status=status, objective=obj, bound=bound, gap=gap, wall_s=time.perf_counter() - began,
                       x=x, backend=options.backend, message=message, stats=stats, reduced_costs=duals)


def _gap(obj: float, bound: float) -> float:
    if math.isnan(obj) or math.isnan(bound):
        return math.inf
    return abs(obj - bound) / max(abs(obj), 1e-12)


_Raw = tuple[Status, float, float, np.ndarray | None, str, dict[str, float]]


# -- HiGHS -----------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Silence C-level writes to stdout (file descriptor 1) for the block."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no real stdout (captured): nothing to do
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            try:
                yield
            finally:
                os.dup2(saved, fd)
    finally:
        os.close(saved)


def _solve_highs(model: MilpModel, options: SolveOptions,
                 start: np.ndarray | None = None) -> tuple[_Raw, np.ndarray | None]:
    """HiGHS; also the reduced costs of an LP solved to optimality (None otherwise)."""
    # lazy: solver backend (only the one asked for)
    import highspy

    h = _highs_instance(highspy, options)
    is_mip = bool(model.integrality.any())
    duals = None
    status = h.passModel(_highs_lp(highspy, model, is_mip))
    if status == highspy.HighsStatus.kError:
        return (Status.ERROR, math.nan, math.nan, None, "HiGHS rejected the model", {}), None
    if start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = np.asarray(start, dtype=np.float64).tolist()
        h.setSolution(sol)
    run_status = h.run()
    if run_status == highspy.HighsStatus.kError and h.getModelStatus() == highspy.HighsModelStatus.kNotset:
        # HiGHS refuses a thread count other than the one its process-wide scheduler was
        # started with; restart the scheduler once and retry.
        h.resetGlobalScheduler(True)
        run_status = h.run()
    ms = h.getModelStatus()
    info = h.getInfo()
    has_x = info.primal_solution_status == 2  # kSolutionStatusFeasible
    x = np.asarray(h.getSolution().col_value, dtype=float) if has_x else None
    obj = float(info.objective_function_value) if has_x else math.nan
    if is_mip:
        bound = float(info.mip_dual_bound)
        stats = {"nodes": float(info.mip_node_count)}
    else:
        bound = obj
        stats = {"iterations": float(info.simplex_iteration_count)}
        if ms == highspy.HighsModelStatus.kOptimal and info.dual_solution_status == 2:
            duals = np.array(h.getSolution().col_dual, dtype=float)
            duals.setflags(write=False)
    st, x, obj, bound = _highs_status(highspy.HighsModelStatus, ms, model, has_x, x, obj, bound)
    if not is_mip and st is not Status.OPTIMAL:
        bound = math.nan
    text = h.modelStatusToString(ms)
    return (st, obj, bound, x, text, stats), (duals if not is_mip and st is Status.OPTIMAL else None)


def _highs_instance(highspy: Any, options: SolveOptions) -> Any:
    """A `highspy.Highs` with the options set (its start-up banner silenced unless verbose)."""
    if options.verbose:
        h = highspy.Highs()
    else:
        with _quiet_stdout():  # the constructor prints a banner before any option can be set
            h = highspy.Highs()
    h.setOptionValue("output_flag", bool(options.verbose))
    h.setOptionValue("time_limit", float(options.time_limit_s))
    h.setOptionValue("mip_rel_gap", float(options.mip_gap))
    h.setOptionValue("mip_abs_gap", 0.0)
    h.setOptionValue("random_seed", int(options.seed))
    if options.threads is not None:
        h.setOptionValue("threads", int(options.threads))
    return h


def _highs_lp(highspy: Any, model: MilpModel, is_mip: bool) -> Any:
    """`model` as a `highspy.HighsLp` (row-wise matrix; infinite bounds as HiGHS's infinity)."""
    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    lp.num_col_ = model.num_cols
    lp.num_row_ = model.num_rows
    lp.sense_ = highspy.ObjSense.kMaximize if model.sense == "max" else highspy.ObjSense.kMinimize
    lp.offset_ = float(model.offset)
    lp.col_cost_ = model.c.astype(np.float64)
    lp.col_lower_ = np.where(np.isinf(model.col_lower), -inf, model.col_lower)
    lp.col_upper_ = np.where(np.isinf(model.col_upper), inf, model.col_upper)
    lp.row_lower_ = np.where(np.isinf(model.row_lower), -inf, model.row_lower)
    lp.row_upper_ = np.where(np.isinf(model.row_upper), inf, model.row_upper)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = model.num_cols
    lp.a_matrix_.num_row_ = model.num_rows
    lp.a_matrix_.start_ = model.A.indptr.astype(np.int32)
    lp.a_matrix_.index_ = model.A.indices.astype(np.int32)
    lp.a_matrix_.value_ = model.A.data.astype(np.float64)
    if is_mip:
        kint, kcont = highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous
        lp.integrality_ = [kint if flag else kcont for flag in model.integrality]
    return lp


def _highs_status(M: Any, ms: Any, model: MilpModel, has_x: bool, x: np.ndarray | None, obj: float,
                  bound: float) -> tuple[Status, np.ndarray | None, float, float]:
    """HiGHS's model status `ms` (of enum `M`) as a `Status`, with the solution, objective and bound it leaves."""
    if ms == M.kOptimal:
        return Status.OPTIMAL, x, obj, bound
    if ms == M.kInfeasible:
        return Status.INFEASIBLE, None, math.nan, bound
    if ms == M.kTimeLimit:
        return Status.TIME_LIMIT, x, obj, bound
    if ms == M.kModelEmpty:
        # No rows and no columns: the objective is the offset.
        return Status.OPTIMAL, np.zeros(model.num_cols), float(model.offset), float(model.offset)
    if has_x and ms in (M.kIterationLimit, M.kSolutionLimit, M.kInterrupt, M.kObjectiveBound,
                        M.kObjectiveTarget, M.kMemoryLimit):
        return Status.FEASIBLE, x, obj, bound
    return Status.ERROR, None, obj, bound


# -- CP-SAT ----------------------------------------------------------------------------------
def _cpsat_columns(model: MilpModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each column's grid step (1 for integers) and integer bounds of its grid index."""
    n = model.num_cols
    step = np.ones(n)
    cont = ~model.integrality
    if cont.any():
        res = model.resolution if model.resolution is not None else np.full(n, np.nan)
        bad = np.flatnonzero(cont & ~(res > 0))
        if bad.size:
            names = ", ".join(model.name(int(i)) for i in bad[:5])
            raise CoralError(f"CP-SAT needs a resolution > 0 for every continuous variable; missing for {names}"
                             " (set MilpModel.resolution, or use backend 'highs')")
        step[cont] = res[cont]
    lo, hi = model.col_lower / step, model.col_upper / step
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        bad = np.flatnonzero(~(np.isfinite(lo) & np.isfinite(hi)))
        names = ", ".join(model.name(int(i)) for i in bad[:5])
        raise CoralError(f"CP-SAT needs finite bounds on every variable; unbounded: {names}")
    lo_i = np.ceil(lo - 1e-9)
    hi_i = np.floor(hi + 1e-9)
    if np.any(np.abs(np.concatenate([lo_i, hi_i])) > 2.0**53):
        raise CoralError("CP-SAT: a variable's grid range exceeds 2^53 steps; use a coarser resolution")
    return step, lo_i, hi_i


def _scale_row(coef: np.ndarray, span: np.ndarray) -> tuple[float, np.ndarray]:
    """Factor that maps the row's largest |activity| to about 2^53, and its integer coefficients.

    The factor is nudged down so that the coefficient of the variable with the widest grid
    range becomes an exact integer (its rounding error would be multiplied by that range); a
    row with integer coefficients and a small activity is kept as is (exact).
    """
    m = float(np.sum(np.abs(coef) * span))
    if m == 0.0:
        return 1.0, np.zeros(coef.shape[0], dtype=np.int64)
    if m < _CPSAT_SCALE and np.all(coef == np.rint(coef)):
        return 1.0, coef.astype(np.int64)
    f = _CPSAT_SCALE / m
    w = int(np.argmax(np.where(coef != 0, span, -1)))
    target = math.floor(abs(coef[w]) * f)
    if target >= 1:
        f = target / abs(coef[w])
    icoef = np.rint(coef * f).astype(np.int64)
    icoef[w] = int(math.copysign(target, coef[w])) if target >= 1 else icoef[w]
    return f, icoef


def _row_error(coef: np.ndarray, icoef: np.ndarray, f: float, span: np.ndarray) -> float:
    """The most rounding can move the row's activity, relative to its largest |activity|."""
    m = float(np.sum(np.abs(coef) * span))
    return float(np.sum(np.abs(icoef - coef * f) * span) / (f * m)) if m > 0 else 0.0


def _cpsat_model(model: MilpModel) -> tuple[Any, np.ndarray, float, float] | str:
    """The CP-SAT model, each column's grid step, the objective's scale factor and the worst
    row error; or the reason the model is trivially infeasible."""
    # lazy: solver backend (only the one asked for)
    from ortools.sat.python import cp_model

    step, lo_i, hi_i = _cpsat_columns(model)
    empty = lo_i > hi_i
    if empty.any():
        return "a variable's grid has no point inside its bounds"
    span = np.maximum(np.abs(lo_i), np.abs(hi_i))
    cp = cp_model.CpModel()
    proto = cp.proto
    for a, b in zip(lo_i.astype(np.int64).tolist(), hi_i.astype(np.int64).tolist(), strict=True):
        proto.variables.add().domain.extend([a, b])
    A = model.A
    worst = 0.0
    for r in range(model.num_rows):
        lo, hi = A.indptr[r], A.indptr[r + 1]
        cols = A.indices[lo:hi]
        coef = A.data[lo:hi] * step[cols]
        f, icoef = _scale_row(coef, span[cols])
        if f != 1.0:
            worst = max(worst, _row_error(coef, icoef, f, span[cols]))
        keep = icoef != 0
        rl, ru = model.row_lower[r], model.row_upper[r]
        if not keep.any():
            # An empty (or all-negligible) row: feasible iff 0 lies within its bounds.
            if rl > 0 or ru < 0:
                return f"row {r} is empty and excludes 0"
            continue
        ilo = -_BIG if np.isinf(rl) else int(max(math.floor(rl * f), -_BIG))
        ihi = _BIG if np.isinf(ru) else int(min(math.ceil(ru * f), _BIG))
        ct = proto.constraints.add().linear
        ct.vars.extend(cols[keep].tolist())
        ct.coeffs.extend(icoef[keep].tolist())
        ct.domain.extend([ilo, ihi])
    obj_cols = np.flatnonzero(model.c)
    f_obj = 1.0
    if obj_cols.size:
        coef = model.c[obj_cols] * step[obj_cols]
        if model.sense == "max":
            coef = -coef
        f_obj, icoef = _scale_row(coef, span[obj_cols])
        keep = icoef != 0
        proto.objective.vars.extend(obj_cols[keep].tolist())
        proto.objective.coeffs.extend(icoef[keep].tolist())
    return cp, step, f_obj, worst


def _solve_cpsat(model: MilpModel, options: SolveOptions, start: np.ndarray | None = None) -> _Raw:
    # lazy: solver backend (only the one asked for)
    from ortools.sat.python import cp_model

    built = _cpsat_model(model)
    if isinstance(built, str):
        return Status.INFEASIBLE, math.nan, math.nan, None, built, {}
    cp, step, f_obj, worst = built
    if start is not None:
        hint = np.rint(np.asarray(start, dtype=float) / step).astype(np.int64).tolist()
        cp.proto.solution_hint.vars.extend(range(model.num_cols))
        cp.proto.solution_hint.values.extend(hint)
    obj_cols = np.flatnonzero(model.c)
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.max_time_in_seconds = float(options.time_limit_s)
    prm.relative_gap_limit = float(options.mip_gap)
    prm.random_seed = int(options.seed)
    prm.log_search_progress = bool(options.verbose)
    if options.threads is not None:
        prm.num_workers = int(options.threads)
    code = solver.solve(cp)
    name = solver.status_name(code)
    stats = {"branches": float(solver.num_branches), "conflicts": float(solver.num_conflicts),
             "cpsat_row_error": worst}
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        n = np.asarray(list(solver.response_proto.solution), dtype=float)
        x = n * step
        obj = float(model.c @ x) + model.offset
        sign = -1.0 if model.sense == "max" else 1.0
        bound = sign * float(solver.best_objective_bound) / f_obj + model.offset if obj_cols.size else obj
        if code == cp_model.OPTIMAL:
            return Status.OPTIMAL, obj, bound, x, name, stats
        hit_limit = solver.wall_time >= 0.95 * options.time_limit_s
        return (Status.TIME_LIMIT if hit_limit else Status.FEASIBLE), obj, bound, x, name, stats
    if code == cp_model.INFEASIBLE:
        return Status.INFEASIBLE, math.nan, math.nan, None, name, stats
    if code == cp_model.UNKNOWN:
        return Status.TIME_LIMIT, math.nan, math.nan, None, name, stats
    return Status.ERROR, math.nan, math.nan, None, f"{name}: {cp.validate()}", stats


# -- Gurobi ----------------------------------------------------------------------------------
def _solve_gurobi(model: MilpModel, options: SolveOptions, start: np.ndarray | None = None) -> _Raw:
    if importlib.util.find_spec("gurobipy") is None:
        raise CoralError("solver backend 'gurobi' needs the gurobipy package (and a licence); "
                         "install it or use backend 'highs' or 'cpsat'")
    # lazy: solver backend (only the one asked for)
    import gurobipy as gp
    from gurobipy import GRB

    env = gp.Env(empty=True)
    env.setParam("OutputFlag", 1 if options.verbose else 0)
    env.start()
    m = gp.Model(env=env)
    m.Params.TimeLimit = float(options.time_limit_s)
    m.Params.MIPGap = float(options.mip_gap)
    m.Params.Seed = int(options.seed)
    if options.threads is not None:
        m.Params.Threads = int(options.threads)
    vtype = np.where(model.integrality, GRB.INTEGER, GRB.CONTINUOUS)
    lb = np.where(np.isinf(model.col_lower), -GRB.INFINITY, model.col_lower)
    ub = np.where(np.isinf(model.col_upper), GRB.INFINITY, model.col_upper)
    x = m.addMVar(model.num_cols, lb=lb, ub=ub, obj=model.c, vtype=vtype)
    m.ObjCon = float(model.offset)
    m.ModelSense = GRB.MAXIMIZE if model.sense == "max" else GRB.MINIMIZE
    A, rl, ru = model.A, model.row_lower, model.row_upper
    eq = rl == ru
    up = ~eq & np.isfinite(ru)
    low = ~eq & np.isfinite(rl)
    for mask, sense, rhs in ((eq, "=", ru), (up, "<", ru), (low, ">", rl)):
        if mask.any():
            m.addMConstr(_scipy(A.rows(mask)), x, sense, rhs[mask])
    if start is not None:
        x.Start = np.asarray(start, dtype=float)
    m.optimize()
    has_x = m.SolCount > 0
    xv = np.asarray(x.X, dtype=float) if has_x else None
    obj = float(m.ObjVal) if has_x else math.nan
    bound = float(m.ObjBound) if has_x and model.integrality.any() else obj
    s = m.Status
    if s == GRB.OPTIMAL:
        st = Status.OPTIMAL
    elif s == GRB.INFEASIBLE:
        st, xv = Status.INFEASIBLE, None
    elif s == GRB.TIME_LIMIT:
        st = Status.TIME_LIMIT
    elif has_x:
        st = Status.FEASIBLE
    else:
        st = Status.ERROR
    m.dispose()
    env.dispose()
    return st, obj, bound, xv, f"gurobi status {s}", {}


def _scipy(a: CsrMatrix) -> Any:
    """`a` as a scipy CSR matrix (Gurobi's matrix API takes scipy's)."""
    # lazy: scipy.sparse (only for a sparse solver model)
    import scipy.sparse as sp

    return sp.csr_matrix((a.data, a.indices, a.indptr), shape=a.shape)
