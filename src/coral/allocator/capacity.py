"""Capacity that keeps the SLO: per (model, phase), the throughput a plan must have so that the
attainment quantile of waiting plus service fits in the SLO (DESIGN §4a).

The model replays a sample of the model's traffic (its own arrival times and lengths, so the
burstiness at the SLO's time scale is the measured one, not an assumption) through a queue:

- **Prefill** has `c` servers of rate `r`, the template the plan is likely to use (the best
  throughput per $ of the library's group) divided by its narrowest stage's data-parallel width
  (a request runs on one node per stage): request `i` waits `W_i` for a whole server (FCFS, Kiefer–Wolfowitz on `P_i / r`; the least-work router sends it where it
  clears soonest, which is that discipline), then takes the template's latency, which reaches
  the quantile prompt `P_q` within the budget, so `lat_i = budget · P_i / P_q` (a short prompt
  batched with others under load waits for the whole batch; measured in the simulator, the
  proportional figure still meets the targets once a stage's data-parallel nodes are picked by
  least work, and charging every prompt the full budget cost 23 % more on core).
  TTFT_i = W_i + lat_i and `C = c · r`. Without a library, one pooled fluid server of rate `C` (Lindley's recursion),
  which is exact for one instance and optimistic by up to one service time for several.
- **Decode** is a multi-server queue: `c` sequence slots, each emitting one token per `cadence`
  (the template's step budget, an upper bound on its step time), sequence `i` holding a slot for
  `(D_i − 1)` steps; it waits `W_i` for a slot (FCFS, Kiefer–Wolfowitz recursion). Its TPOT is
  `(kv_i + W_i) / (D_i − 1) + cadence`, where `kv_i` is its KV transfer from prefill. A template
  of throughput `Θ` has `Θ · cadence` slots, so `C = c / cadence` tokens/s.

The smallest `C` whose attainment on the sample reaches the target is found by bisection (both
waits fall as capacity grows). An M/M/c check against Erlang C is in the tests.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from coral.errors import CoralError


def erlang_c(servers: int, offered_load: float) -> float:
    """Probability that an arrival waits in an M/M/c queue (Erlang C), `a = λ/μ < c`.

    Raises:
        ValueError: fewer than one server, or a load the servers cannot carry.
    """
    c, a = servers, offered_load
    if c < 1:
        raise ValueError(f"servers must be >= 1, got {c}")
    if not 0 <= a < c:
        raise ValueError(f"offered load must be in [0, {c}), got {a}")
    term, total = 1.0, 1.0  # a^k / k!, summed for k < c
    for k in range(1, c):
        term *= a / k
        total += term
    last = term * a / c  # a^c / c!
    top = last * c / (c - a)
    return top / (total + top)


def fluid_waits(arrival_s: np.ndarray, work: np.ndarray, rate: float) -> np.ndarray:
    """Waiting times at a FCFS fluid server of `rate` work units per second (Lindley's recursion)."""
    n = len(arrival_s)
    out = np.zeros(n)
    if n == 0:
        return out
    service = np.asarray(work, dtype=float) / rate
    gaps = np.diff(np.asarray(arrival_s, dtype=float))
    w = 0.0
    for i in range(1, n):
        w = w + service[i - 1] - gaps[i - 1]
        if w < 0.0:
            w = 0.0
        out[i] = w
    return out


def fcfs_waits(arrival_s: np.ndarray, service_s: np.ndarray, servers: int) -> np.ndarray:
    """Waiting times in a FCFS queue with `servers` identical servers (Kiefer–Wolfowitz)."""
    n = len(arrival_s)
    if servers >= n:
        return np.zeros(n)
    # plain Python floats and one heap operation per request: the same arithmetic as numpy's
    # element by element, about twice as fast as indexing the arrays
    arrivals = np.asarray(arrival_s, dtype=float).tolist()
    services = np.asarray(service_s, dtype=float).tolist()
    out = [0.0] * n
    free = [0.0] * servers  # when each server is next free (a heap)
    replace = heapq.heapreplace
    for i in range(n):
        a = arrivals[i]
        f = free[0]
        if f > a:
            out[i] = f - a
            replace(free, f + services[i])
        else:
            replace(free, a + services[i])
    return np.array(out)


def _quantile(x: np.ndarray, q: float) -> float:
    return float(np.quantile(x, q)) if x.size else 0.0


def _smallest_count(lo: int, ok: Callable[[int], bool]) -> int:
    """The smallest whole count >= `lo` with `ok` (monotone: more servers never attain less),
    by doubling then bisection. The caller has checked that some count is ok (`_reachable`)."""
    if ok(lo):
        return lo
    hi = lo * 2
    while not ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _reachable(unqueued: np.ndarray, slo_s: float, attainment: float, strict: bool,
               why: Callable[[float], str]) -> float | None:
    """The attainment to size for, given each request's latency with no queueing at all: the target
    where that reaches it; otherwise (strict) a `CoralError` saying `why`, or (not strict) the share
    that latency does reach, less half a point, and None when that is nothing."""
    best = _quantile(unqueued, attainment)
    # the share itself, not the interpolated quantile: on a few requests the quantile can sit
    # under the SLO while fewer than `attainment` of them do, and no capacity would then reach it
    if float(np.mean(unqueued <= slo_s)) >= attainment:
        return attainment
    if strict:
        raise CoralError(why(best))
    reach = float(np.mean(unqueued <= slo_s)) - 0.005
    return reach if reach > 0 else None


@dataclass(frozen=True, slots=True, kw_only=True)
class CapacityTarget:
    """The capacity a (model, phase) is planned with and why."""

    capacity_tok_per_s: float  # what the plan must provide
    mean_tok_per_s: float  # the sample's raw demand
    predicted_attainment: float  # on the sample, at that capacity
    quantile_latency_s: float  # the attainment quantile of TTFT / TPOT at that capacity

    @property
    def factor(self) -> float:
        """Capacity over raw demand (what the burstiness and the SLO cost)."""
        return self.capacity_tok_per_s / self.mean_tok_per_s if self.mean_tok_per_s > 0 else 1.0


def _bisect(lo: float, hi: float, ok, rel: float = 0.01) -> float:  # type: ignore[no-untyped-def]
    """Smallest x >= lo with ok(x) (to `rel`), for a monotone ok; `hi` is a first guess, doubled
    until ok."""
    if ok(lo):
        return lo
    for _ in range(60):
        if ok(hi):
            break
        lo, hi = hi, 2.0 * hi
    while hi - lo > rel * hi:
        mid = 0.5 * (lo + hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def prefill_capacity(arrival_s: np.ndarray, prompt_tokens: np.ndarray, *, window_s: float, ttft_s: float,
                     budget_s: float, prompt_q: float, attainment: float, model: str = "",
                     instance_tok_per_s: float | None = None, strict: bool = True) -> CapacityTarget:
    """The prefill capacity (prompt tokens/s) at which `attainment` of the sample's TTFTs fit `ttft_s`.

    Args:
        instance_tok_per_s: the throughput of one instance of the template the plan is likely to
            use. Given, the queue has `c` servers of that rate (a request waits for a whole instance,
            as it does: it cannot be split) and the capacity is `c` times it; None: one pooled fluid
            server (exact for one instance, optimistic by up to a service time for several).
        strict: raise when no capacity reaches the target; False: size for the best the latency
            allows instead (what an epoch re-plan does when its window holds longer prompts than
            the templates were built for: more capacity would not help those requests).

    Raises:
        CoralError: (strict) the target cannot be reached at any capacity (the latency alone misses it).
    """
    p = np.maximum(np.asarray(prompt_tokens, dtype=float), 1.0)
    mean = float(p.sum() / window_s) if window_s > 0 else 0.0
    if p.size == 0:
        return CapacityTarget(capacity_tok_per_s=0.0, mean_tok_per_s=0.0, predicted_attainment=1.0, quantile_latency_s=0.0)
    lat = budget_s * p / prompt_q
    reach = _reachable(lat, ttft_s, attainment, strict, lambda best: (
        f"model {model}: the p{attainment * 100:g} TTFT is {best:.3g} s with no queueing at all, above the "
        f"{ttft_s:g} s SLO; lower slo_attainment, relax ttft_ms or raise planner.ttft_headroom"))
    if reach is None:  # nothing is reachable: capacity would buy nothing
        return CapacityTarget(capacity_tok_per_s=mean, mean_tok_per_s=mean, predicted_attainment=0.0,
                              quantile_latency_s=_quantile(lat, attainment))
    attainment = reach

    if instance_tok_per_s is not None and instance_tok_per_s > 0:
        r = float(instance_tok_per_s)
        service = p / r

        def ttft_at(servers: int) -> np.ndarray:
            return fcfs_waits(arrival_s, service, servers) + lat

        servers = _smallest_count(max(1, math.ceil(mean / r)),
                                  lambda n: float(np.mean(ttft_at(n) <= ttft_s)) >= attainment)
        ttft = ttft_at(servers)
        return CapacityTarget(capacity_tok_per_s=max(mean, servers * r), mean_tok_per_s=mean,
                              predicted_attainment=float(np.mean(ttft <= ttft_s)),
                              quantile_latency_s=_quantile(ttft, attainment))

    def attain(c: float) -> float:
        return float(np.mean(fluid_waits(arrival_s, p, c) + lat <= ttft_s))

    cap = _bisect(mean, 2.0 * mean + 1.0, lambda c: attain(c) >= attainment)
    ttft = fluid_waits(arrival_s, p, cap) + lat
    return CapacityTarget(capacity_tok_per_s=cap, mean_tok_per_s=mean, predicted_attainment=float(np.mean(ttft <= ttft_s)),
                          quantile_latency_s=_quantile(ttft, attainment))


def decode_capacity(arrival_s: np.ndarray, prompt_tokens: np.ndarray, output_tokens: np.ndarray, *, window_s: float,
                    tpot_s: float, cadence_s: float, kv_s_per_token: float, kv_latency_s: float,
                    attainment: float, model: str = "", strict: bool = True) -> CapacityTarget:
    """The decode capacity (output tokens/s) at which `attainment` of the sample's TPOTs fit `tpot_s`.

    Args:
        arrival_s, prompt_tokens, output_tokens: the sample (arrivals at decode ≈ at prefill: the
            TTFT shift is common to all requests).
        cadence_s: the decode templates' step budget.
        kv_s_per_token, kv_latency_s: the KV transfer, `P · kv_s_per_token + kv_latency_s`.
        strict: as for `prefill_capacity`.

    Raises:
        CoralError: (strict) the target cannot be reached at any capacity.
    """
    d = np.maximum(np.asarray(output_tokens, dtype=float), 1.0)
    p = np.asarray(prompt_tokens, dtype=float)
    mean = float(d.sum() / window_s) if window_s > 0 else 0.0
    if d.size == 0:
        return CapacityTarget(capacity_tok_per_s=0.0, mean_tok_per_s=0.0, predicted_attainment=1.0, quantile_latency_s=0.0)
    steps = np.maximum(d - 1, 1)
    kv = p * kv_s_per_token + kv_latency_s
    service = steps * cadence_s
    multi = d > 1

    def tpot(slots: int) -> np.ndarray:
        w = fcfs_waits(arrival_s, service, slots)
        return np.where(multi, (kv + w) / steps + cadence_s, 0.0)

    floor = tpot(len(d) + 1)
    reach = _reachable(floor, tpot_s, attainment, strict, lambda best: (
        f"model {model}: the p{attainment * 100:g} TPOT is {best * 1e3:.3g} ms with no queueing (step "
        f"{cadence_s * 1e3:.3g} ms plus the KV transfer), above the {tpot_s * 1e3:g} ms SLO; lower slo_attainment, "
        "relax tpot_ms, or offer nodes with faster NICs"))
    if reach is None:  # nothing is reachable: capacity would buy nothing
        return CapacityTarget(capacity_tok_per_s=mean, mean_tok_per_s=mean, predicted_attainment=0.0,
                              quantile_latency_s=_quantile(floor, attainment))
    attainment = reach
    slots = _smallest_count(max(1, int(mean * cadence_s)),
                            lambda n: float(np.mean(tpot(n) <= tpot_s)) >= attainment)
    t = tpot(slots)
    return CapacityTarget(capacity_tok_per_s=max(mean, slots / cadence_s), mean_tok_per_s=mean,
                          predicted_attainment=float(np.mean(t <= tpot_s)), quantile_latency_s=_quantile(t, attainment))


def check_capacity_inputs(window_s: float, attainment: float) -> None:
    if not (math.isfinite(window_s) and window_s > 0):
        raise CoralError(f"capacity sample window must be a finite number > 0 s, got {window_s}")
    if not 0 < attainment < 1:
        raise CoralError(f"slo_attainment must be in (0, 1), got {attainment}")
