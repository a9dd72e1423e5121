"""One allocation's search (DESIGN §4): the cost ILP (`coral.allocator.ilp.cost_pass`), and when it
gives no plan, goodput mode (`coral.allocator.goodput.goodput_mode`), within one time limit."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coral.allocator.goodput import goodput_mode
from coral.allocator.ilp import SolveBudget, cost_pass
from coral.allocator.inputs import AllocationInputs, Columns
from coral.allocator.plan import Plan
from coral.solver import SolveOptions, Status

__all__ = ["AllocationResult", "Allocated", "NoPlan", "solve_allocation"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Allocated:
    """`solve_allocation` found a plan; `notes` say how (the plan may carry them or not)."""

    plan: Plan
    notes: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class NoPlan:
    """No solve of `solve_allocation` produced an incumbent; the caller falls back.

    `status`: `ERROR` when a note reports a solver error, else `TIME_LIMIT`."""

    status: Status
    notes: tuple[str, ...]


AllocationResult = Allocated | NoPlan


def solve_allocation(inputs: AllocationInputs, cols: Columns, nu_prev: np.ndarray, options: SolveOptions,
                     *, method: str = "coral") -> AllocationResult:
    """Cost ILP (`cost_pass`); when infeasible (or no incumbent), goodput mode (`goodput_mode`):
    maximize α, then minimize cost at α fixed (minus `goodput.ALPHA_SLACK`). The time limit covers all
    solves together.

    How goodput mode stays inside an epoch on large, scarce instances:
    - the cost ILP's LP relaxation is solved first; when it is infeasible so is the ILP, and
      goodput mode starts without a branch-and-bound proof of infeasibility;
    - the α search solves its LP relaxation first: its optimum bounds α, and its rounding
      (`incumbent.max_alpha_incumbent`) is an incumbent that ends the search when it is within
      the gap, and the answer when the ILP finds nothing better; the ILP stops at a relative gap
      of `max(mip_gap, GOODPUT_GAP)` or after `goodput.GOODPUT_ALPHA_SHARE` of the time left;
    - the cost pass starts from the α search's plan (feasible for it by construction), so it
      always has an incumbent and stops at the same gap or when the time is up.
    The notes report α, its bound and both gaps.

    Returns:
        `Allocated` (the plan and the notes), or `NoPlan` when no solve produced an incumbent
        (the caller falls back).
    """
    budget = SolveBudget(options)
    notes: list[str] = []
    got = cost_pass(budget, inputs, cols, nu_prev, method=method, notes=notes)
    if isinstance(got, Plan):
        return Allocated(plan=got, notes=tuple(notes))
    plan = goodput_mode(budget, inputs, cols, nu_prev, got, method=method, notes=notes)
    if plan is None:
        status = Status.ERROR if any("error" in n for n in notes) else Status.TIME_LIMIT
        return NoPlan(status=status, notes=tuple(notes))
    return Allocated(plan=plan, notes=tuple(notes))
