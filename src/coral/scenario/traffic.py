"""A scenario's traffic as the planner sees it before any run: a sample of each model's workload
(its "history"), drawn with `PLANNING_SEED`, and the configurations its templates may use. The
per-model planning value built on them (lengths at the attainment quantile, budgets, KV model,
the history itself) is `coral.templates.planning.plan_inputs`'s, built once per scenario: these
functions draw afresh on every call and keep nothing."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coral.catalog.hardware import NodeConfig
from coral.errors import CoralError
from coral.scenario.resolve import Scenario
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


def traffic_sample(scenario: Scenario, model: str, duration_s: float | None = None, *,
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
    return build_workload({served.name: workload}, duration_s=window, seed=PLANNING_SEED,
                          base_dir=scenario.base_dir)[served.name]


def length_summary(sample: Trace, quantile: float, model: str,
                   kv_tokens: Callable[[float], float] | None = None) -> LengthSummary:
    """`model`'s length distribution at `quantile` (`coral.slo.component_quantile` of its target),
    read from `sample` (a traffic sample drawn at >= 1 req/s: lengths don't depend on the rate);
    `kv_tokens`: the model's KV tokens per layer of a prompt (`ModelSpec.effective_context`).

    Raises:
        CoralError: the sample holds no request to read lengths from.
    """
    if len(sample) == 0:
        raise CoralError(f"model {model}: its workload produced no requests to size templates on; check its dataset")
    return summarize_lengths(sample, quantile, kv_tokens)


def planner_memory(scenario: Scenario) -> float:
    """The share of GPU memory the performance model lets weights and KV use."""
    return float(getattr(scenario.perf.system, "memory_utilization", 1.0))


def model_configs(scenario: Scenario, model: str) -> tuple[NodeConfig, ...]:
    """The configurations `model`'s templates may use: every one the scenario offers (each
    template's own NIC times its KV transfer, `coral.templates.budget.KvModel`)."""
    return tuple(scenario.configs)


def scenario_key(scenario: Scenario) -> tuple[Any, ...]:
    """What a memo of per-scenario figures must be keyed on: every resolved input that changes them
    (models with their SLOs and workloads, configurations, prices, planner knobs, perf model), not
    the scenario file alone: scenarios are also built in code."""
    return (tuple((m.name, m.spec.name, m.slo, m.rate_per_s, m.workload.model_dump_json()) for m in scenario.models),
            tuple(c.name for c in scenario.configs), tuple(sorted(scenario.prices.items())),
            scenario.planner.model_dump_json(), str(scenario.base_dir), scenario.perf.version)
