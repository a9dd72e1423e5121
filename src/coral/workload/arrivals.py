"""Synthetic arrival processes (Poisson, Gamma renewal with a burstiness knob) and traces built on them."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from coral.workload.lengths import LengthModel
from coral.workload.trace import FloatArray, Trace

ARRIVAL_PROCESSES = ("poisson", "gamma")


def _check_rate_duration(rate_per_s: float, duration_s: float) -> None:
    if not (math.isfinite(rate_per_s) and rate_per_s >= 0):
        raise ValueError(f"rate_per_s must be a finite number >= 0, got {rate_per_s}")
    if not (math.isfinite(duration_s) and duration_s >= 0):
        raise ValueError(f"duration_s must be a finite number >= 0, got {duration_s}")


def _renewal(draw_gaps: Callable[[int], FloatArray], rate_per_s: float, duration_s: float) -> FloatArray:
    """Arrival times in [0, duration_s) of a renewal process whose gaps `draw_gaps(k)` returns."""
    expected = rate_per_s * duration_s
    chunk = int(expected + 6 * math.sqrt(expected) + 16)
    times: list[FloatArray] = []
    now = 0.0
    while now < duration_s:
        cumulative = now + np.cumsum(draw_gaps(chunk))
        times.append(cumulative)
        now = float(cumulative[-1])
    if not times:
        return np.zeros(0)
    arrival = np.concatenate(times)
    return arrival[arrival < duration_s]


def poisson_arrivals(rate_per_s: float, duration_s: float, rng: np.random.Generator) -> FloatArray:
    """Arrival times of a Poisson process (exponential gaps) over `[0, duration_s)`.

    Args:
        rate_per_s: mean arrivals per second, >= 0.
        duration_s: length of the window, >= 0.
        rng: the random generator (same state, same result).

    Returns:
        Sorted float64 arrival times.

    Raises:
        ValueError: a negative or non-finite rate or duration.
    """
    _check_rate_duration(rate_per_s, duration_s)
    if rate_per_s == 0 or duration_s == 0:
        return np.zeros(0)
    return _renewal(lambda k: rng.exponential(1.0 / rate_per_s, size=k), rate_per_s, duration_s)


def gamma_arrivals(rate_per_s: float, duration_s: float, cv: float, rng: np.random.Generator) -> FloatArray:
    """Arrival times of a Gamma renewal process over `[0, duration_s)`.

    Gaps are Gamma with mean `1/rate_per_s` and coefficient of variation `cv` (shape `1/cv^2`):
    `cv > 1` is burstier than Poisson, `cv < 1` more regular. `cv == 1` is exactly
    `poisson_arrivals` (same draws); `cv == 0` gives evenly spaced arrivals at `k/rate_per_s`,
    k = 1, 2, ...

    Args:
        rate_per_s: mean arrivals per second, >= 0.
        duration_s: length of the window, >= 0.
        cv: coefficient of variation of the gaps, >= 0.
        rng: the random generator.

    Returns:
        Sorted float64 arrival times.

    Raises:
        ValueError: a negative or non-finite rate, duration or cv.
    """
    _check_rate_duration(rate_per_s, duration_s)
    if not (math.isfinite(cv) and cv >= 0):
        raise ValueError(f"cv must be a finite number >= 0, got {cv}")
    if cv == 1:
        return poisson_arrivals(rate_per_s, duration_s, rng)
    if rate_per_s == 0 or duration_s == 0:
        return np.zeros(0)
    if cv == 0:
        arrival = np.arange(1, math.ceil(rate_per_s * duration_s) + 1) / rate_per_s
        return arrival[arrival < duration_s]
    shape = 1.0 / cv**2
    scale = 1.0 / (rate_per_s * shape)
    return _renewal(lambda k: rng.gamma(shape, scale, size=k), rate_per_s, duration_s)


def synthesize(
    *,
    name: str,
    rate_per_s: float,
    duration_s: float,
    lengths: LengthModel,
    rng: np.random.Generator,
    arrival: str = "poisson",
    cv: float = 1.0,
) -> Trace:
    """A synthetic trace: arrivals from a Poisson or Gamma process, lengths from `lengths`.

    Arrival times are drawn first, then the lengths, from the same generator.

    Args:
        name: the trace's name.
        rate_per_s: mean arrivals per second.
        duration_s: the trace's window; arrivals fall in `[0, duration_s)`.
        lengths: where (prompt, output) lengths come from.
        rng: the random generator.
        arrival: `poisson` or `gamma`.
        cv: the Gamma process's coefficient of variation (ignored for `poisson`).

    Returns:
        A trace with `window_s == duration_s`.

    Raises:
        ValueError: an unknown arrival process or bad numbers.
    """
    if arrival == "poisson":
        arrival_s = poisson_arrivals(rate_per_s, duration_s, rng)
    elif arrival == "gamma":
        arrival_s = gamma_arrivals(rate_per_s, duration_s, cv, rng)
    else:
        raise ValueError(f"unknown arrival process {arrival!r}; use one of {', '.join(ARRIVAL_PROCESSES)}")
    prompt, output = lengths.sample(len(arrival_s), rng)
    return Trace(name=name, arrival_s=arrival_s, prompt_tokens=prompt, output_tokens=output, window_s=duration_s)
