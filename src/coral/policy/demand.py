"""The demand to plan the next epoch with: one function for the simulator's epochs and the live planner.

Both re-plan every epoch on what they saw in the last one: the simulator from the requests that
arrived in it (`coral.experiments.pipeline.run_simulation`), the runtime's live planner from the
requests its coordinator recorded (`coral.runtime.deploy.planner.PlanPlanner`, `coral serve
--plan`). Both call :func:`epoch_demand` with the window and the run's :func:`epoch_forecaster`,
so a plan the simulator verified is the plan the live planner makes on the same history.

Not exported by ``coral.policy`` (it loads the allocator's queueing model): a scheduler or engine
process imports the routing and lifecycle policies without it.
"""
from __future__ import annotations

from collections.abc import Mapping

from coral.allocator.demand import Forecaster, capacity_targets, observed_rates
from coral.perf.model import Phase
from coral.scenario import Scenario
from coral.templates.planning import plan_inputs
from coral.templates.template import TemplateLibrary
from coral.workload import Trace

__all__ = ["epoch_demand", "epoch_forecaster"]


def epoch_forecaster(scenario: Scenario) -> Forecaster:
    """The per-run forecaster of the next epoch's rates (`planner.forecast_quantile`, `scale_down_margin`).

    Args:
        scenario: the resolved scenario.

    Returns:
        A fresh forecaster (it keeps the run's history from its first `update` on).
    """
    return Forecaster(quantile=scenario.planner.forecast_quantile, scale_down_margin=scenario.planner.scale_down_margin)


def epoch_demand(scenario: Scenario, window: Mapping[str, Trace], forecast: Forecaster,
                 library: TemplateLibrary | None = None) -> dict[tuple[str, Phase], float]:
    """The capacity to plan the next epoch with, per (model, phase), tok/s.

    The larger of the queueing model on the requests observed in the last epoch and on the long
    traffic sample (`planner.history_s`), each scaled to the forecast rate (quantile +
    hysteresis). Six minutes of a bursty trace do not show its worst bursts (azure-code at 10
    req/s has an inter-arrival CV of 13), so the hour of history keeps the burst headroom while the
    last epoch tracks the level. Scaling the history's capacity linearly with the rate is
    conservative: compressing a trace's arrivals by `f` and raising the capacity by `f` shortens
    every wait by `f`.

    Args:
        scenario: the resolved scenario (models, SLOs, planner knobs).
        window: model -> the requests that arrived in the last epoch (arrival times from the
            epoch's start, prompt and output lengths, `window_s` = the epoch's length).
        forecast: the run's forecaster; updated with the window's rates.
        library: the template library prefill capacity is sized in (as `coral plan` does).

    Returns:
        (model, phase) -> tok/s for every model of the scenario.
    """
    rates = observed_rates(window)
    want = forecast.update(rates)
    scale = {m: (want[m] / r if r > 0 else 1.0) for m, r in rates.items()}
    recent = capacity_targets(scenario, window, scale=scale, library=library)
    history = capacity_targets(scenario, library=library)
    out: dict[tuple[str, Phase], float] = {}
    for m in plan_inputs(scenario):
        sample = m.history
        base_rate = len(sample) / float(sample.window_s or scenario.planner.history_s)
        f = want.get(m.model, 0.0) / base_rate if base_rate > 0 else 1.0
        for ph in (Phase.PREFILL, Phase.DECODE):
            out[(m.model, ph)] = max(recent[(m.model, ph)].capacity_tok_per_s, f * history[(m.model, ph)].capacity_tok_per_s)
    return out
