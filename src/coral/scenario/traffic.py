"""A scenario's traffic as the planner sees it before any run: a sample of each model's workload
(its "history") and the length summary at the attainment quantile (DESIGN §4a); the KV model
and the template budgets built on them are `coral.templates.planning`'s."""
from __future__ import annotations

from typing import Any

from coral.catalog.hardware import NodeConfig
from coral.errors import CoralError
from coral.perf.model import Phase, Shape
from coral.slo import component_quantile
from coral.workload import build_workload
from coral.workload.summary import LengthSummary, summarize_lengths
from coral.workload.trace import Trace

# The first plan is sized on another draw of the workload than the runs' (seeds 0, 1, ...), as a
# user sizes on past traffic: for a trace replay it starts at another point of the trace.
PLANNING_SEED = 7919

# At a high rate the default sample is the part of `planner.history_s` that holds this many requests:
# the same draw cut short, so its rate, lengths and burst shape are the history's (a trace replay at
# rate r loops the trace every len(trace)/r s), while its memory and the capacity replays stay
# bounded: an hour of core at 1000x is 36 M requests per model (8 GB). Every built-in scenario's
# history holds fewer. Workloads with a demand shift keep the whole history (the shift is in time).
MAX_SAMPLE_REQUESTS = 400_000

_SAMPLES: dict[tuple[Any, ...], Trace] = {}
_SUMMARIES: dict[tuple[int, float], tuple[Trace, LengthSummary]] = {}  # (id(sample), quantile) -> the summary


def traffic_sample(scenario: Any, model: str, duration_s: float | None = None, *,
                   min_rate_per_s: float = 0.0) -> Trace:
    """`duration_s` (default `planner.history_s`, cut to hold at most `MAX_SAMPLE_REQUESTS` of a
    workload without a shift) of `model`'s workload, drawn with `PLANNING_SEED`; its `window_s`
    says how long it is.

    Args:
        min_rate_per_s: draw at least this rate (the lengths do not depend on the rate, so the
            length summary of a model with almost no traffic still has requests to read).

    Returns:
        The trace; it may hold no request when the rate is (near) zero.

    Raises:
        CoralError: the workload's data cannot be read.
    """
    served = scenario.model(model)
    window = float(duration_s or scenario.planner.history_s)
    workload = served.workload
    if workload.rate_per_s < min_rate_per_s:
        workload = workload.model_copy(update={"rate_per_s": min_rate_per_s})
    if duration_s is None and workload.shift.kind == "none" and workload.rate_per_s * window > MAX_SAMPLE_REQUESTS:
        window = MAX_SAMPLE_REQUESTS / workload.rate_per_s
    key = (served.name, workload.model_dump_json(), str(scenario.base_dir), window)
    hit = _SAMPLES.get(key)
    if hit is None:
        if len(_SAMPLES) > 256:
            _SAMPLES.clear()
        hit = _SAMPLES[key] = build_workload({served.name: workload}, duration_s=window, seed=PLANNING_SEED,
                                             base_dir=scenario.base_dir)[served.name]
    return hit


def component_attainment(scenario: Any, model: str) -> float:
    """The quantile each phase of `model` is sized to (`coral.slo.component_quantile`)."""
    return component_quantile(scenario.model(model).slo.attainment)


def length_summary(scenario: Any, model: str) -> LengthSummary:
    """`model`'s length distribution at its per-phase quantile (drawn at >= 1 req/s: lengths don't
    depend on the rate).

    Raises:
        CoralError: the workload has no request to read lengths from.
    """
    sample = traffic_sample(scenario, model, min_rate_per_s=1.0)
    if len(sample) == 0:
        raise CoralError(f"model {model}: its workload produced no requests to size templates on; check its dataset")
    quantile = component_attainment(scenario, model)
    key = (id(sample), quantile)  # a sample lives in _SAMPLES as long as its summary does
    hit = _SUMMARIES.get(key)
    if hit is None or hit[0] is not sample:
        if len(_SUMMARIES) > 256:
            _SUMMARIES.clear()
        hit = _SUMMARIES[key] = (sample, summarize_lengths(sample, quantile))
    return hit[1]


def planner_memory(scenario: Any) -> float:
    """The share of GPU memory the performance model lets weights and KV use."""
    return float(getattr(scenario.perf.system, "memory_utilization", 1.0))


def model_configs(scenario: Any, model: str) -> tuple[NodeConfig, ...]:
    """The configurations `model`'s templates may use: every one the scenario offers (each
    template's own NIC times its KV transfer, `coral.templates.planning.model_kv`)."""
    return tuple(scenario.configs)


def fastest_latency_ms(scenario: Any, model: str, phase: Any) -> tuple[float, str, float]:
    """The lowest latency any template of `model` could reach in `phase`: every layer on one engine
    of the fastest usable configuration, at the largest TP degree vLLM accepts there (a pipeline
    never shortens one request: its stages run one after another), at the length the budget is
    checked at. Returns (ms, a description of that engine, prompt tokens)."""
    served = scenario.model(model)
    lengths = length_summary(scenario, model)
    prompt = lengths.prompt_q if phase is Phase.PREFILL else lengths.prompt_mean
    shape = Shape(phase=phase, batch=1, prompt_tokens=prompt, output_tokens=lengths.output_mean)
    # every engine a node can run: itself where vLLM takes its GPU count as the TP degree, else its TP groups
    engines = [c if served.spec.tp_problem(c.count) is None else c.group(max(served.spec.valid_tp(c.count)))
               for c in model_configs(scenario, model)]
    best = min((scenario.perf.node_time_s(c, served.spec, shape, served.spec.num_layers, first=True, last=True) * 1e3,
                 c.name, c.memory_bytes) for c in engines)
    holds = best[2] * planner_memory(scenario) >= served.spec.weights_bytes
    where = f"one {best[1]}" if holds else f"a pipeline as fast as {best[1]} per layer"
    return best[0], where, prompt


def scenario_key(scenario: Any) -> tuple[Any, ...]:
    """What a memo of per-scenario figures must be keyed on: every resolved input that changes them
    (models with their SLOs and workloads, configurations, prices, planner knobs, perf model), not
    the scenario file alone: scenarios are also built in code."""
    return (tuple((m.name, m.spec.name, m.slo, m.rate_per_s, m.workload.model_dump_json()) for m in scenario.models),
            tuple(c.name for c in scenario.configs), tuple(sorted(scenario.prices.items())),
            scenario.planner.model_dump_json(), str(scenario.base_dir), scenario.perf.version)
