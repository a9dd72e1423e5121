"""Request routing: least outstanding work (the default), smooth weighted round-robin ∝ throughput, decode same region first."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotation only: the runtime's processes import the policies without the planner
    from coral.templates.template import Template


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceSpec:
    """One serving instance of a plan: a template placed in a region, on spot or on-demand nodes."""

    template: Template
    region: str
    spot: bool = False  # its nodes are spot nodes: paid at the spot price, preempted by the cloud

    def __post_init__(self) -> None:
        if not self.region:
            raise ValueError("InstanceSpec.region must be a non-empty region name")

    @property
    def key(self) -> str:
        """`template@region`, with `#spot` after a spot instance's (unique beside the on-demand one)."""
        return f"{self.template.key}@{self.region}#spot" if self.spot else f"{self.template.key}@{self.region}"


@dataclass(frozen=True, slots=True, kw_only=True)
class WrrState:
    """Smooth weighted round-robin state (nginx's algorithm): a weight and a running credit per item."""

    weights: tuple[float, ...]
    current: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("WRR needs at least one item")
        if len(self.weights) != len(self.current):
            raise ValueError("WRR weights and credits differ in length")
        if any(not w > 0 for w in self.weights):
            raise ValueError(f"WRR weights must be > 0, got {self.weights}")


def wrr_start(weights: Sequence[float]) -> WrrState:
    """The initial state for `weights` (all credits zero)."""
    return WrrState(weights=tuple(float(w) for w in weights), current=(0.0,) * len(weights))


def wrr_next(state: WrrState) -> tuple[int, WrrState]:
    """Pick the next item: every credit grows by its weight, the largest wins (lowest index on a tie)
    and pays back the total. Over any window of picks, item `i` is chosen `∝ w_i` and the picks
    are spread out (no bursts), deterministically.

    Args:
        state: the current state.

    Returns:
        (the chosen index, the next state).
    """
    total = 0.0
    best = -1
    best_c = 0.0
    cur = list(state.current)
    for i, w in enumerate(state.weights):
        c = cur[i] + w
        cur[i] = c
        total += w
        if best < 0 or c > best_c:
            best, best_c = i, c
    cur[best] -= total
    return best, WrrState(weights=state.weights, current=tuple(cur))


class SmoothWRR:
    """`wrr_next` held in place, for hot loops (same picks as the pure function, fewer allocations)."""

    __slots__ = ("_cur", "_total", "_weights", "n")

    def __init__(self, weights: Sequence[float]) -> None:
        wrr_start(weights)  # validates
        self._weights = [float(w) for w in weights]
        self._cur = [0.0] * len(self._weights)
        self._total = sum(self._weights)
        self.n = len(self._weights)

    def pick(self) -> int:
        if self.n == 1:
            return 0
        cur = self._cur
        best = -1
        best_c = 0.0
        for i, w in enumerate(self._weights):
            c = cur[i] + w
            cur[i] = c
            if best < 0 or c > best_c:
                best, best_c = i, c
        cur[best] -= self._total
        return best


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """A decode instance the router may send a KV cache to."""

    id: int
    region: str
    weight: float  # its template throughput, tok/s


def choose_decode(candidates: Sequence[Candidate], src_region: str,
                  states: dict[tuple[int, ...], WrrState]) -> tuple[int | None, dict[tuple[int, ...], WrrState]]:
    """Pick a decode instance for a request prefilled in `src_region`: same region first (WRR ∝
    throughput among them), else WRR over all candidates.

    Args:
        candidates: the accepting (active) decode instances of the request's model.
        src_region: where the prefill ran.
        states: WRR state per candidate group (keyed by the group's ids); not modified.

    Returns:
        (the chosen candidate's id, or None when there is none; the updated states).
    """
    if not candidates:
        return None, states
    group = [c for c in candidates if c.region == src_region] or list(candidates)
    key = tuple(c.id for c in group)
    state = states.get(key) or wrr_start([c.weight for c in group])
    i, state = wrr_next(state)
    out = dict(states)
    out[key] = state
    return group[i].id, out


ROUTERS = ("least-work", "wrr")


def least_work(outstanding: Sequence[float], rates: Sequence[float], new_work: float) -> int:
    """Pick the instance that would finish a new request first: the least `(outstanding + new) /
    rate` (lowest index on a tie). With prefill's queued prompt tokens over the template's
    throughput this is least outstanding work, which sends a burst where it clears soonest
    instead of in fixed proportions; with decode's held sequences over its slots, the least
    occupied instance.

    Args:
        outstanding: per instance, work queued or running (tokens, or sequences).
        rates: per instance, how fast it clears that work (> 0).
        new_work: the new request's work, in the same unit.

    Returns:
        The chosen index.

    Raises:
        ValueError: no instances, mismatched lengths, or a rate that is not > 0.
    """
    if not outstanding or len(outstanding) != len(rates):
        raise ValueError("least_work needs one outstanding figure and one rate per instance, at least one")
    best, best_t = -1, math.inf
    for i, (w, r) in enumerate(zip(outstanding, rates, strict=True)):
        if not r > 0:
            raise ValueError(f"least_work rates must be > 0, got {r}")
        t = (w + new_work) / r
        if t < best_t:
            best, best_t = i, t
    return best
