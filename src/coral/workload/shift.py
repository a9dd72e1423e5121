"""Demand shifts: per-model rate multipliers over time (step, diurnal, large-/small-heavy splits)."""
from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from coral.workload.trace import FloatArray, Trace
from coral.workload.transform import thin


class Shift(Protocol):
    """A rate multiplier `m(t) >= 0`: the model's request rate at time t is `rate_per_s * m(t)`."""

    def multiplier(self, t_s: FloatArray) -> FloatArray:
        """m(t) at each time in `t_s`."""
        ...

    def peak(self, duration_s: float) -> float:
        """An upper bound of m(t) over `[0, duration_s)`."""
        ...


def _check_factor(what: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} must be a finite number >= 0, got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ConstantShift:
    """m(t) = factor for all t (factor 1: no shift)."""

    factor: float = 1.0

    def __post_init__(self) -> None:
        _check_factor("constant shift factor", self.factor)

    def multiplier(self, t_s: FloatArray) -> FloatArray:
        return np.full(np.shape(t_s), self.factor, dtype=np.float64)

    def peak(self, duration_s: float) -> float:
        return self.factor


@dataclass(frozen=True, slots=True, kw_only=True)
class StepShift:
    """m(t) = `before` for t < `at_s`, then `factor`: "at t, the rate changes to x times"."""

    at_s: float
    factor: float
    before: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.at_s) and self.at_s >= 0):
            raise ValueError(f"step shift at_s must be a finite number >= 0, got {self.at_s}")
        _check_factor("step shift factor", self.factor)
        _check_factor("step shift before", self.before)

    def multiplier(self, t_s: FloatArray) -> FloatArray:
        return np.where(np.asarray(t_s) < self.at_s, self.before, self.factor).astype(np.float64)

    def peak(self, duration_s: float) -> float:
        if duration_s <= self.at_s:
            return self.before
        return max(self.before, self.factor) if self.at_s > 0 else self.factor


@dataclass(frozen=True, slots=True, kw_only=True)
class DiurnalShift:
    """m(t) = 1 + amplitude * sin(2 pi (t - phase_s) / period_s): a sinusoidal day/night swing.

    The mean over a whole period is 1, so the model's mean rate is unchanged; `amplitude` in
    [0, 1] keeps m(t) >= 0. With the default phase the rate starts at its mean and rises.
    """

    period_s: float
    amplitude: float
    phase_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.period_s) and self.period_s > 0):
            raise ValueError(f"diurnal shift period_s must be a finite number > 0, got {self.period_s}")
        if not 0 <= self.amplitude <= 1:
            raise ValueError(f"diurnal shift amplitude must be in [0, 1], got {self.amplitude}")
        if not math.isfinite(self.phase_s):
            raise ValueError(f"diurnal shift phase_s must be finite, got {self.phase_s}")

    def multiplier(self, t_s: FloatArray) -> FloatArray:
        angle = 2 * np.pi * (np.asarray(t_s, dtype=np.float64) - self.phase_s) / self.period_s
        return 1.0 + self.amplitude * np.sin(angle)

    def peak(self, duration_s: float) -> float:
        return 1.0 + self.amplitude


@dataclass(frozen=True, slots=True, kw_only=True)
class ProductShift:
    """m(t) = the product of the parts' multipliers (e.g. a diurnal swing times a heavy split)."""

    parts: tuple[Shift, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.parts, tuple):
            raise ValueError("ProductShift parts must be a tuple")

    def multiplier(self, t_s: FloatArray) -> FloatArray:
        out = np.ones(np.shape(t_s), dtype=np.float64)
        for part in self.parts:
            out = out * part.multiplier(t_s)
        return out

    def peak(self, duration_s: float) -> float:
        return math.prod(part.peak(duration_s) for part in self.parts)


def combine(first: Shift, second: Shift) -> Shift:
    """The product of two shifts, kept as a ConstantShift when both are constant.

    Args:
        first: a shift.
        second: another shift.

    Returns:
        A shift whose multiplier is the product of the two.
    """
    if isinstance(first, ConstantShift) and isinstance(second, ConstantShift):
        return ConstantShift(factor=first.factor * second.factor)
    if isinstance(first, ConstantShift) and first.factor == 1:
        return second
    if isinstance(second, ConstantShift) and second.factor == 1:
        return first
    return ProductShift(parts=(first, second))


def heavy_split_multipliers(
    rates_per_s: Mapping[str, float], heavy_models: Collection[str], heavy_share: float = 0.8
) -> dict[str, float]:
    """Rate multipliers that send `heavy_share` of the total traffic to a group of models.

    The total rate is kept. Within each group the rates keep their proportions, so with equal
    base rates the heavy models share `heavy_share` evenly and the others share the rest.
    The paper's large-heavy / small-heavy demand is `heavy_share = 0.8` with the large / small
    models as the heavy group.

    Args:
        rates_per_s: each model's base rate (> 0 in total for each group).
        heavy_models: the heavy group, a non-empty subset of the models.
        heavy_share: the heavy group's share of the total, in [0, 1].

    Returns:
        model -> multiplier (heavy models `share * total / heavy_total`, the others
        `(1 - share) * total / light_total`).

    Raises:
        ValueError: unknown or no heavy models, a share outside [0, 1], a group with zero rate,
            or every model heavy with a share below 1.
    """
    unknown_models = sorted(set(heavy_models) - set(rates_per_s))
    if unknown_models:
        raise ValueError(f"heavy models {unknown_models} are not among the models {sorted(rates_per_s)}")
    if not heavy_models:
        raise ValueError("the heavy group needs at least one model")
    if not 0 <= heavy_share <= 1:
        raise ValueError(f"heavy_share must be in [0, 1], got {heavy_share}")
    heavy = set(heavy_models)
    heavy_total = sum(rate for model, rate in rates_per_s.items() if model in heavy)
    light_total = sum(rate for model, rate in rates_per_s.items() if model not in heavy)
    total = heavy_total + light_total
    if heavy_total <= 0:
        raise ValueError("the heavy models' base rates sum to 0; give them a rate > 0")
    if light_total <= 0 and heavy_share < 1:
        raise ValueError(
            f"every model with traffic is in the heavy group, so it cannot get {heavy_share:.0%} of the traffic; "
            "leave at least one model with a rate > 0 out of the group"
        )
    light_factor = (1 - heavy_share) * total / light_total if light_total > 0 else 0.0
    return {
        model: heavy_share * total / heavy_total if model in heavy else light_factor for model in rates_per_s
    }


def apply_shift(trace: Trace, shift: Shift, rng: np.random.Generator) -> Trace:
    """Thin a trace generated at its peak rate down to the shifted rate.

    A trace of rate `lam * peak` (with `peak = shift.peak(duration)`) becomes one of rate
    `lam * m(t)`: each request at t is kept with probability `m(t) / peak`. So to shift a
    base rate `lam`, generate (or replay) at `lam * peak` first; a constant shift then keeps
    every request and draws no random numbers.

    Args:
        trace: the trace at the peak rate.
        shift: the multiplier.
        rng: the random generator.

    Returns:
        The thinned trace, same window.

    Raises:
        ValueError: a multiplier outside [0, peak].
    """
    peak = shift.peak(trace.duration_s)
    if isinstance(shift, ConstantShift):
        return trace
    if peak <= 0:
        return thin(trace, lambda t: np.zeros_like(t), rng)
    return thin(trace, lambda t: shift.multiplier(t) / peak, rng)
