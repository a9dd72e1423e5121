"""Latency SLOs and the one definition of attainment that the planner, the simulator and the
reports share (DESIGN §4a).

A request *attains* when its TTFT is within `ttft_ms` and its TPOT, `(e2e − TTFT) / (D − 1)` as
`vllm bench serve` defines it, is within `tpot_ms` (a one-token output has no TPOT and attains on
TTFT alone). A model's plan is sized so that a share `attainment` of its requests attain.

Attainment, per phase (`phase_attainment`) or both SLOs together (`request_attainment`), is a
share of the *resolved* requests: those whose outcome is known, because they reached the end of
what is judged or failed. Requests still in flight when a run ends are left out. The simulator's
summary (`coral.sim.result`) and `coral plan --verify` (`coral.experiments.verify`) both read it here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from coral.perf.model import Phase

DEFAULT_ATTAINMENT = 0.95


@dataclass(frozen=True, slots=True, kw_only=True)
class Slo:
    """A model's latency targets and the share of requests that must meet both."""

    ttft_ms: float
    tpot_ms: float
    attainment: float = DEFAULT_ATTAINMENT

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"Slo.{name} must be a finite number > 0, got {v}")
        if not 0 < self.attainment < 1:
            raise ValueError(f"Slo.attainment must be in (0, 1), got {self.attainment}")

    def ms(self, phase: Phase) -> float:
        """The phase's SLO: TTFT for prefill, TPOT for decode (ms)."""
        return self.ttft_ms if phase is Phase.PREFILL else self.tpot_ms


def component_quantile(attainment: float) -> float:
    """The quantile each phase is sized to so that both together reach `attainment`: a request
    misses when either phase misses, so each phase gets half of the allowed misses."""
    return 1.0 - (1.0 - attainment) / 2.0


def request_tpot_s(ttft_s: np.ndarray, e2e_s: np.ndarray, output_tokens: np.ndarray) -> np.ndarray:
    """Per-request TPOT `(e2e − TTFT) / (D − 1)`; 0 for one-token outputs, NaN where unfinished."""
    out = np.asarray(output_tokens)
    with np.errstate(invalid="ignore", divide="ignore"):
        t = (np.asarray(e2e_s) - np.asarray(ttft_s)) / np.maximum(out - 1, 1)
    return np.where(out > 1, t, np.where(np.isnan(e2e_s), np.nan, 0.0))


def phase_attainment(latency_s: np.ndarray, slo_s: float, reached: np.ndarray, failed: np.ndarray) -> float | None:
    """One phase's attainment: the share of its resolved requests that reached the phase's end
    within `slo_s`.

    Denominator: the requests that reached the phase's end (their first token for TTFT, their last
    for TPOT) or failed, each counted once (a request that got its first token and then failed is
    one request). Numerator: those that reached it with `latency_s <= slo_s` (a failed request that
    had its first token in time met the TTFT). Requests in flight are in neither.

    Args:
        latency_s: per request, the phase's latency (TTFT or TPOT; NaN where not reached).
        slo_s: the phase's SLO.
        reached: per request, whether it reached the phase's end.
        failed: per request, whether it failed.

    Returns:
        The share, or None when no request is resolved.
    """
    reached = np.asarray(reached, dtype=bool)
    resolved = int((reached | np.asarray(failed, dtype=bool)).sum())
    if resolved == 0:
        return None
    with np.errstate(invalid="ignore"):
        met = reached & (np.asarray(latency_s) <= slo_s)
    return float(met.sum()) / resolved


def request_attainment(met: np.ndarray, finished: np.ndarray, failed: np.ndarray) -> float | None:
    """Both SLOs together: the share of resolved requests (finished or failed) that finished
    meeting both (`met`, from `attained`). None when no request is resolved."""
    resolved = int((np.asarray(finished, dtype=bool) | np.asarray(failed, dtype=bool)).sum())
    return float(np.asarray(met, dtype=bool).sum()) / resolved if resolved else None


def attained(ttft_s: np.ndarray, tpot_s: np.ndarray, ttft_slo_s: np.ndarray | float,
             tpot_slo_s: np.ndarray | float) -> np.ndarray:
    """Which requests meet both SLOs (NaN, i.e. unfinished, never does)."""
    with np.errstate(invalid="ignore"):
        return (np.asarray(ttft_s) <= ttft_slo_s) & (np.asarray(tpot_s) <= tpot_slo_s)
