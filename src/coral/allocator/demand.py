"""The capacity each (model, phase) is planned with: the queueing model of
`coral.allocator.capacity` on a traffic sample, with the template budgets and KV link of each
model's planning value (`coral.templates.planning.plan_inputs`), and the epoch-to-epoch forecast
and hysteresis (DESIGN §4a)."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from coral.allocator import capacity_store
from coral.allocator.capacity import CapacityTarget, decode_capacity, prefill_capacity
from coral.perf.model import DEMAND_PHASES, Phase
from coral.scenario.traffic import scenario_key
from coral.templates.planning import plan_inputs
from coral.templates.table import as_table
from coral.workload.trace import Trace

Group = tuple[str, Phase]
_MEMO: dict[tuple[Any, ...], dict[Group, CapacityTarget]] = {}


def offered_demand(scenario: Any) -> dict[Group, float]:
    """The traffic itself per (model, phase), tok/s: rate x mean prompt (prefill) or output
    (decode) tokens, with no capacity headroom (`capacity_targets` is what a plan provisions).

    Args:
        scenario: a resolved `coral.scenario.Scenario`.

    Returns:
        tok/s per (model name, phase), every model and both phases.
    """
    return {(m.name, ph): m.rate_per_s * (m.prompt_tokens_mean if ph is Phase.PREFILL else m.output_tokens_mean)
            for m in scenario.models for ph in DEMAND_PHASES}


def instance_rates(scenario: Any, library: Any) -> dict[str, float]:
    """Per model, the rate of one prefill *server*: the unit the plan adds prefill capacity in. It
    is the template with the most Θ per $ (at its cheapest region), divided by its narrowest
    stage's data-parallel width: a request runs on one node per stage, so a stage of `w` nodes is
    `w` servers, not one `w` times as fast. Read from the library's arrays (usage, Θ), so only
    the winning template is made."""
    price: dict[str, float] = {}
    for (_, c), p in scenario.prices.items():
        price[c] = min(p, price.get(c, math.inf))
    out = {}
    for m in scenario.models:
        ts = library.of(m.name, Phase.PREFILL)
        if not len(ts):
            continue
        names, usage, theta = as_table(ts).arrays()
        with np.errstate(invalid="ignore", divide="ignore"):  # an unpriced config: inf (or 0 x inf = nan)
            cost = usage.astype(float) @ np.array([price.get(n, math.inf) for n in names])
            per_dollar = np.where(np.isfinite(cost) & (cost > 0), theta / cost, -np.inf)
        best = int(np.argmax(per_dollar))
        if not np.isfinite(per_dollar[best]):
            continue
        t = ts[best]
        out[m.name] = float(theta[best]) / min(len(st.nodes) for st in t.placement.stages)
    return out


def capacity_targets(scenario: Any, samples: Mapping[str, Trace] | None = None, *,
                     scale: Mapping[str, float] | None = None,
                     boost: Mapping[Group, float] | None = None,
                     library: Any = None, store: bool | None = None,
                     progress: Callable[[int, int], None] | None = None) -> dict[Group, CapacityTarget]:
    """Per (model, phase), the capacity that keeps the model's attainment target on its traffic.

    Args:
        scenario: the resolved scenario (SLOs, targets, planner knobs, models' workloads).
        samples: model -> requests to size on, each with its `window_s`; default the scenario's
            traffic sample (`ModelPlanning.history` of `coral.templates.planning.plan_inputs`,
            `planner.history_s` long).
        scale: model -> rate multiplier applied to its sample (the forecast's ratio to it): the
            arrival times are compressed by it, which keeps the burstiness's shape.
        boost: (model, phase) -> capacity multiplier on top (`coral plan --calibrate`).
        library: the template library; given, prefill is sized as `c` instances of its best Θ per
            $ template (`instance_rates`) rather than one pooled server.
        store: keep the targets of the scenario's own sample on disk across processes
            (`coral.allocator.capacity_store`, keyed by the replay's content); default on unless
            `CORAL_CAPACITY_CACHE=0`. Windows, scales and boosts are never stored.
        progress: called with (models sized, models) after each model (the replays of a large
            sample take seconds each).

    Returns:
        The targets; a model without requests in its sample gets 0.

    Raises:
        CoralError: on the scenario's own sample, a target that no capacity reaches (names the model
            and the latency that misses); on given samples (an epoch's window) the capacity is sized
            for the best the templates allow instead.
    """
    use_store = capacity_store.enabled() if store is None else store
    rates = instance_rates(scenario, library) if library is not None else {}
    memo_key = None
    if samples is None and not scale and not boost:
        memo_key = (scenario_key(scenario), tuple(sorted(rates.items())))
        hit = _MEMO.get(memo_key)
        if hit is not None:
            return hit
    planning = plan_inputs(scenario)
    out: dict[Group, CapacityTarget] = {}
    for done, m in enumerate(scenario.models):
        if progress is not None:
            progress(done, len(scenario.models))
        mp = planning.of(m.name)
        if samples is None:
            tr = mp.history
        else:
            tr = samples.get(m.name) or Trace(name=m.name, arrival_s=np.zeros(0), prompt_tokens=np.zeros(0, np.int64),
                                              output_tokens=np.zeros(0, np.int64), window_s=1.0)
        arr, p, d, window = _in_arrival_order(tr, float((scale or {}).get(m.name, 1.0)))
        pre_args, dec_args = _replay_args(mp, window, rates.get(m.name), strict=samples is None)
        key = None
        if memo_key is not None and use_store:
            key = capacity_store.replay_key((arr, p, d), {**{f"prefill_{k}": v for k, v in pre_args.items()},
                                                          **{f"decode_{k}": v for k, v in dec_args.items()}})
            stored = capacity_store.load(key)
            if stored is not None:
                out[(m.name, Phase.PREFILL)], out[(m.name, Phase.DECODE)] = stored
                continue
        pre = prefill_capacity(arr, p, **pre_args)
        dec = decode_capacity(arr, p, d, **dec_args)
        if key is not None:
            capacity_store.save(key, pre, dec)
        for ph, target in ((Phase.PREFILL, pre), (Phase.DECODE, dec)):
            out[(m.name, ph)] = _boosted(target, float((boost or {}).get((m.name, ph), 1.0)))
    if progress is not None:
        progress(len(scenario.models), len(scenario.models))
    if memo_key is not None:
        if len(_MEMO) > 32:
            _MEMO.clear()
        _MEMO[memo_key] = out
    return out


def _in_arrival_order(tr: Trace, scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """`tr`'s arrivals (compressed by `scale`, the forecast's rate ratio; 1 if not > 0), prompt and
    output lengths in arrival order (the queues replay requests in that order), and its window (s)."""
    window = float(tr.window_s or (float(tr.arrival_s.max()) if len(tr) else 1.0))
    f = scale if scale > 0 else 1.0
    order = np.argsort(tr.arrival_s, kind="stable")
    return tr.arrival_s[order] / f, tr.prompt_tokens[order], tr.output_tokens[order], window / f


def _replay_args(mp: Any, window_s: float, instance_tok_per_s: float | None, *,
                 strict: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The keyword arguments of `prefill_capacity` and `decode_capacity` for one model (`mp`, its
    `ModelPlanning`). The KV allowance is the transfer's share of the SLO it counts in: queueing
    gets the rest (`queueing_slo_s`); in "prefill" mode it is taken off TPOT, in "decode" mode it
    is in TTFT, so the decode replay charges no transfer of its own."""
    pre_args: dict[str, Any] = dict(window_s=window_s, ttft_s=mp.queueing_slo_s(Phase.PREFILL),
                                    budget_s=mp.prefill_budget_ms / 1e3, prompt_q=mp.lengths.prompt_q,
                                    attainment=mp.quantile, model=mp.model, instance_tok_per_s=instance_tok_per_s,
                                    strict=strict)
    dec_args: dict[str, Any] = dict(window_s=window_s, tpot_s=mp.queueing_slo_s(Phase.DECODE),
                                    cadence_s=mp.decode_budget_ms / 1e3, kv_s_per_token=0.0, kv_latency_s=0.0,
                                    attainment=mp.quantile, model=mp.model, strict=strict)
    return pre_args, dec_args


def _boosted(target: CapacityTarget, k: float) -> CapacityTarget:
    """`target` with its capacity multiplied by `k` (`coral plan --calibrate`'s boost)."""
    if k == 1.0:
        return target
    return CapacityTarget(capacity_tok_per_s=target.capacity_tok_per_s * k, mean_tok_per_s=target.mean_tok_per_s,
                          predicted_attainment=target.predicted_attainment,
                          quantile_latency_s=target.quantile_latency_s)


@dataclass(slots=True)
class Forecaster:
    """Each epoch's rate per model: an EWMA level plus the `quantile` of its past one-step errors
    (normal), never below the last observation's share the hysteresis keeps; so capacity follows
    demand up at once and comes down only when it has clearly fallen."""

    quantile: float = 0.9
    alpha: float = 0.5
    scale_down_margin: float = 0.15
    level: dict[str, float] | None = None
    err_sq: dict[str, float] | None = None
    planned: dict[str, float] | None = None

    def update(self, observed: Mapping[str, float]) -> dict[str, float]:
        """Feed the rates observed over the last epoch (req/s per model); return the rates to plan for."""
        z = NormalDist().inv_cdf(self.quantile)
        level = self.level if self.level is not None else {}
        err = self.err_sq if self.err_sq is not None else {}
        planned = self.planned if self.planned is not None else {}
        out: dict[str, float] = {}
        for m, x in observed.items():
            prev = level.get(m)
            if prev is None:
                level[m], err[m] = x, (0.25 * x) ** 2  # no history: a 25 % spread
            else:
                e = x - prev
                err[m] = (1 - self.alpha) * err[m] + self.alpha * e * e
                level[m] = prev + self.alpha * e
            want = max(x, level[m] + z * math.sqrt(err[m]))
            old = planned.get(m)
            if old is not None and (1 - self.scale_down_margin) * old <= want < old:
                want = old  # hysteresis: keep the running capacity for a small drop
            planned[m] = want
            out[m] = want
        self.level, self.err_sq, self.planned = level, err, planned
        return out


def observed_rates(window: Mapping[str, Trace]) -> dict[str, float]:
    """Requests per second of each model over its window."""
    return {m: (len(t) / t.window_s if t.window_s else 0.0) for m, t in window.items()}


def demand_of(targets: Mapping[Group, CapacityTarget], groups: Sequence[Group] | None = None) -> dict[Group, float]:
    """The allocator's demand rows: the targets' capacities (tok/s)."""
    return {g: t.capacity_tok_per_s for g, t in targets.items() if groups is None or g in groups}
