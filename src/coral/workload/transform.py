"""Trace transformations: rescaling to a rate, cutting, rotating, tiling, thinning, dataset assignment."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from coral.workload.trace import FloatArray, Trace


def _with(trace: Trace, keep: np.ndarray | slice, arrival_s: FloatArray, window_s: float | None) -> Trace:
    return Trace(
        name=trace.name,
        arrival_s=arrival_s,
        prompt_tokens=trace.prompt_tokens[keep],
        output_tokens=trace.output_tokens[keep],
        window_s=window_s,
    )


def scale_time(trace: Trace, factor: float) -> Trace:
    """Stretch (`factor > 1`) or compress (`factor < 1`) a trace's time axis.

    Args:
        trace: the trace.
        factor: multiplies every arrival time and the window, > 0.

    Returns:
        The same requests with the new timing; the rate is divided by `factor`.

    Raises:
        ValueError: `factor` is not a finite number > 0.
    """
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"time scale factor must be a finite number > 0, got {factor}")
    window = None if trace.window_s is None else trace.window_s * factor
    return _with(trace, slice(None), trace.arrival_s * factor, window)


def scale_to_rate(trace: Trace, rate_per_s: float) -> Trace:
    """Compress or stretch a trace's time axis so its mean rate is `rate_per_s`.

    Every request is kept; the burst structure scales with the time axis.

    Args:
        trace: a trace with a positive rate (at least one request and a duration > 0).
        rate_per_s: the target mean rate, > 0.

    Returns:
        The rescaled trace; its `rate_per_s` equals the target (up to rounding).

    Raises:
        ValueError: a target rate <= 0, or a trace with no rate to scale.
    """
    if not (math.isfinite(rate_per_s) and rate_per_s > 0):
        raise ValueError(f"target rate_per_s must be a finite number > 0, got {rate_per_s}")
    if trace.rate_per_s <= 0:
        raise ValueError(f"trace {trace.name} has no arrival rate to scale (requests {len(trace)}, duration 0 s)")
    return scale_time(trace, trace.rate_per_s / rate_per_s)


def cut(trace: Trace, start_s: float, end_s: float) -> Trace:
    """The requests arriving in `[start_s, end_s)`, with times rebased to start at 0.

    Args:
        trace: the trace.
        start_s: window start, >= 0.
        end_s: window end, >= start_s.

    Returns:
        A trace whose window is `min(end_s, trace.duration_s) - start_s` (at least 0).

    Raises:
        ValueError: a negative start or an end before the start.
    """
    if not (math.isfinite(start_s) and start_s >= 0):
        raise ValueError(f"cut start_s must be a finite number >= 0, got {start_s}")
    if not end_s >= start_s:
        raise ValueError(f"cut end_s ({end_s}) must be >= start_s ({start_s})")
    keep = (trace.arrival_s >= start_s) & (trace.arrival_s < end_s)
    window = max(0.0, min(end_s, trace.duration_s) - start_s)
    arrival = trace.arrival_s[keep] - start_s
    if len(arrival) and arrival[-1] > window:  # an arrival exactly at duration_s when window_s is None
        window = float(arrival[-1])
    return _with(trace, keep, arrival, window)


def rotate(trace: Trace, offset_s: float) -> Trace:
    """Start the trace at `offset_s` and wrap the part before it around to the end.

    The result has the same requests and window; its arrivals in `[0, D - offset)` are the
    source's arrivals from `offset` on, followed by the source's beginning.

    Args:
        trace: a trace with a duration > 0.
        offset_s: where the new trace starts, taken modulo the duration.

    Returns:
        The rotated trace (the window becomes explicit).

    Raises:
        ValueError: a trace of duration 0 or a non-finite offset.
    """
    period = trace.duration_s
    if period <= 0:
        raise ValueError(f"trace {trace.name} has duration 0 and cannot be rotated")
    if not math.isfinite(offset_s):
        raise ValueError(f"rotate offset_s must be finite, got {offset_s}")
    offset = offset_s % period
    late = trace.arrival_s >= offset
    order = np.concatenate([np.flatnonzero(late), np.flatnonzero(~late)])
    arrival = np.concatenate([trace.arrival_s[late] - offset, trace.arrival_s[~late] + (period - offset)])
    return _with(trace, order, arrival, period)


def tile(trace: Trace, duration_s: float) -> Trace:
    """Repeat a trace back to back (period = its duration) and cut it to `[0, duration_s)`.

    Args:
        trace: a trace with a duration > 0.
        duration_s: the length wanted, >= 0.

    Returns:
        A trace with `window_s == duration_s`.

    Raises:
        ValueError: a trace of duration 0 or a bad duration.
    """
    period = trace.duration_s
    if period <= 0:
        raise ValueError(f"trace {trace.name} has duration 0 and cannot be tiled")
    if not (math.isfinite(duration_s) and duration_s >= 0):
        raise ValueError(f"tile duration_s must be a finite number >= 0, got {duration_s}")
    copies = max(1, math.ceil(duration_s / period))
    arrival = (trace.arrival_s[None, :] + period * np.arange(copies)[:, None]).ravel()
    rows = np.tile(np.arange(len(trace)), copies)
    keep = arrival < duration_s
    return _with(trace, rows[keep], arrival[keep], duration_s)


def replay(trace: Trace, *, rate_per_s: float, duration_s: float, offset_s: float = 0.0) -> Trace:
    """Replay a trace at a target rate for a target duration.

    The trace is rotated to start at `offset_s` (in its own time), its time axis is scaled
    to `rate_per_s`, and it is tiled or cut to `[0, duration_s)`.

    Args:
        trace: the source trace (rate > 0).
        rate_per_s: the target mean rate; 0 gives an empty trace.
        duration_s: the length wanted.
        offset_s: where in the source the replay starts, seconds of source time.

    Returns:
        A trace with `window_s == duration_s`.

    Raises:
        ValueError: see `rotate`, `scale_to_rate`, `tile`.
    """
    if rate_per_s == 0:
        return _with(trace, slice(0, 0), np.zeros(0), duration_s)
    source = rotate(trace, offset_s) if offset_s else trace
    return tile(scale_to_rate(source, rate_per_s), duration_s)


def thin(trace: Trace, keep_probability: Callable[[FloatArray], FloatArray], rng: np.random.Generator) -> Trace:
    """Keep each request independently with probability `keep_probability(arrival_s)`.

    One uniform number is drawn per request, in arrival order. Thinning a Poisson process of
    rate `lam` gives one of rate `lam * p(t)`.

    Args:
        trace: the trace.
        keep_probability: maps arrival times to probabilities in [0, 1].
        rng: the random generator.

    Returns:
        The kept requests, same window.

    Raises:
        ValueError: a probability outside [0, 1] or NaN.
    """
    probability = np.asarray(keep_probability(trace.arrival_s), dtype=np.float64)
    if probability.shape != trace.arrival_s.shape:
        raise ValueError(f"keep_probability returned shape {probability.shape}, expected {trace.arrival_s.shape}")
    if not np.all((probability >= 0) & (probability <= 1 + 1e-12)):
        raise ValueError("keep_probability must return values in [0, 1]")
    keep = rng.random(len(trace)) < probability
    return _with(trace, keep, trace.arrival_s[keep], trace.window_s)


def assign_datasets(models: Sequence[str], datasets: Sequence[str]) -> dict[str, str]:
    """Spread datasets evenly across models, as the paper does: model i gets dataset i mod k.

    Args:
        models: model names, in order.
        datasets: dataset names, at least one.

    Returns:
        model name -> dataset name.

    Raises:
        ValueError: no datasets, or a model named twice.
    """
    if not datasets:
        raise ValueError("assign_datasets needs at least one dataset")
    if len(set(models)) != len(models):
        raise ValueError(f"model names must be unique, got {list(models)}")
    return {model: datasets[i % len(datasets)] for i, model in enumerate(models)}
