"""The per-model planning input, built once per resolved scenario (DESIGN §4a).

`plan_inputs(scenario)` is the one place where what the planner reads off a model's traffic and
SLO is derived: the traffic sample (the history whose arrivals carry the burstiness the capacity
model sizes for), the length summary at the per-phase quantile, the KV model with its bytes per
token, the latency budget of each phase and the configurations its templates may use. The
templates, the allocator, the simulator and the runtime planner read these `ModelPlanning`
values; none derives them again.

They sit here, above `coral.scenario`, because they are `coral.templates.budget`'s model applied to
a resolved scenario's traffic (`coral.scenario.traffic`): the scenario below never needs them.
The value is a pure function of the scenario's content, so `plan_inputs` keeps the last few it
built keyed on that content (`coral.scenario.traffic.scenario_key`): the CLI, the simulator's
epochs and the live planner each ask for it many times and get the same object.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from coral.catalog.hardware import NodeConfig
from coral.errors import CoralError
from coral.perf.model import Phase, Shape
from coral.scenario import Scenario
from coral.scenario.traffic import (
    length_summary,
    model_configs,
    planner_memory,
    scenario_key,
    traffic_sample,
)
from coral.slo import Slo, component_quantile
from coral.templates.budget import KvModel, kv_intake_per_output, kv_model, latency_budget_ms
from coral.workload.summary import LengthSummary
from coral.workload.trace import Trace

_BUILT: dict[tuple[Any, ...], PlanningInputs] = {}  # scenario content -> its planning inputs
_KEEP = 8  # scenarios whose planning inputs stay built (a study sweeps a few at a time)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ModelPlanning:
    """What the planner reads off one model's SLO and traffic, derived once.

    `history` is the traffic sample (`planner.history_s`, `coral.scenario.traffic.traffic_sample`):
    its arrivals carry the burstiness the capacity model sizes for. `lengths` are read from the
    same draw taken at >= 1 req/s (lengths don't depend on the rate), at `quantile`, the share
    each phase is sized to (`coral.slo.component_quantile` of the SLO's attainment).
    """

    model: str
    slo: Slo
    quantile: float
    lengths: LengthSummary
    kv: KvModel
    prefill_budget_ms: float  # coral.templates.budget.latency_budget_ms, the KV allowance taken
    decode_budget_ms: float
    colocated_budget_ms: float  # TPOT times its headroom: a colocated step moves no KV
    configs: tuple[NodeConfig, ...]  # the configurations its templates may use
    history: Trace

    def budget_ms(self, phase: Phase) -> float:
        """The latency budget (ms) `phase` templates are held to (can be <= 0: `specs_for` says so)."""
        if phase is Phase.COLOCATED:
            return self.colocated_budget_ms
        return self.prefill_budget_ms if phase is Phase.PREFILL else self.decode_budget_ms

    def queueing_slo_s(self, phase: Phase) -> float:
        """The phase's SLO (s) less the KV allowance when the transfer counts in it: what the
        queueing model (`coral.allocator.capacity`) holds the phase's latency to."""
        return self.slo.ms(phase) / 1e3 - self.kv.allowance_in_ms(phase) / 1e3

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes of one prompt token, all layers."""
        return self.kv.bytes_per_token


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PlanningInputs:
    """Every model's `ModelPlanning`, in the scenario's model order."""

    models: tuple[ModelPlanning, ...]

    def of(self, model: str) -> ModelPlanning:
        """`model`'s planning value.

        Raises:
            KeyError: a model the scenario does not serve.
        """
        for m in self.models:
            if m.model == model:
                return m
        raise KeyError(model)

    def __iter__(self) -> Iterator[ModelPlanning]:
        return iter(self.models)


def model_planning(scenario: Scenario, model: str) -> ModelPlanning:
    """`model`'s planning value, derived from the scenario (use `plan_inputs`: it builds each once).

    Raises:
        CoralError: the workload's data cannot be read, or it yields no request to read lengths from.
    """
    served = scenario.model(model)
    planner = scenario.planner
    history = traffic_sample(scenario, model)
    # the lengths need requests even at (almost) no traffic; at >= 1 req/s it is the same draw
    drawn = history if served.workload.rate_per_s >= 1.0 else traffic_sample(scenario, model, min_rate_per_s=1.0)
    quantile = component_quantile(served.slo.attainment)
    lengths = length_summary(drawn, quantile, model, served.spec.effective_context)
    configs = model_configs(scenario, model)
    kv = kv_model(served.spec, lengths, served.slo, configs, planner.first_token, planner.kv_ttft_share,
                  planner.kv_tpot_share, kv_intake_per_output(history, served.spec.effective_context,
                                                              planner.epoch_s, quantile))
    budgets = {ph: latency_budget_ms(served.slo, ph, ttft_headroom=planner.ttft_headroom,
                                     tpot_headroom=planner.tpot_headroom, kv=kv) for ph in Phase}
    return ModelPlanning(model=model, slo=served.slo, quantile=quantile, lengths=lengths, kv=kv,
                         prefill_budget_ms=budgets[Phase.PREFILL], decode_budget_ms=budgets[Phase.DECODE],
                         colocated_budget_ms=budgets[Phase.COLOCATED],
                         configs=configs, history=history)


def plan_inputs(scenario: Scenario) -> PlanningInputs:
    """The scenario's planning inputs: one `ModelPlanning` per model, built once per scenario content.

    Raises:
        CoralError: a model's workload data cannot be read or yields no request.
    """
    key = scenario_key(scenario)
    hit = _BUILT.get(key)
    if hit is None:
        hit = PlanningInputs(models=tuple(model_planning(scenario, m.name) for m in scenario.models))
        if len(_BUILT) >= _KEEP:
            _BUILT.pop(next(iter(_BUILT)))
        _BUILT[key] = hit
    return hit


def fastest_latency_ms(scenario: Scenario, planning: ModelPlanning, phase: Phase) -> tuple[float, str, float]:
    """The lowest latency any template of the model could reach in `phase`: every layer on one engine
    of the fastest usable configuration, at the largest TP degree vLLM accepts there (a pipeline
    never shortens one request: its stages run one after another), at the length the budget is
    checked at. Returns (ms, a description of that engine, prompt tokens)."""
    served = scenario.model(planning.model)
    lengths = planning.lengths
    prompt = lengths.prompt_q if phase is Phase.PREFILL else lengths.prompt_mean
    shape = Shape(phase=phase, batch=1, prompt_tokens=prompt, output_tokens=lengths.output_mean)
    # every engine a node can run: itself where vLLM takes its GPU count as the TP degree, else its TP groups
    engines = [c if served.spec.tp_problem(c.count) is None else c.group(max(served.spec.valid_tp(c.count)))
               for c in planning.configs]
    best = min((scenario.perf.node_time_s(c, served.spec, shape, served.spec.num_layers, first=True, last=True) * 1e3,
                 c.name, c.memory_bytes) for c in engines)
    holds = best[2] * planner_memory(scenario) >= served.spec.weights_bytes
    where = f"one {best[1]}" if holds else f"a pipeline as fast as {best[1]} per layer"
    return best[0], where, prompt


def no_template_explainer(scenario: Scenario) -> Callable[[tuple[str, Phase]], str] | None:
    """What to say when a (model, phase) has no template: the budget its templates were held to,
    at which length, and the best any node reaches (computed only then)."""
    if not scenario.configs:
        return None

    def explain(g: tuple[str, Phase]) -> str:
        try:
            planning = plan_inputs(scenario).of(g[0])
            budget = planning.budget_ms(g[1])
            best, cfg, prompt = fastest_latency_ms(scenario, planning, g[1])
            q = planning.lengths.quantile
        except (CoralError, ValueError, KeyError):
            return "its templates are held to the budget of coral.templates.budget"
        at = f"the p{q * 100:g} prompt ({prompt:,.0f} tokens)" if g[1] is Phase.PREFILL else "the mean context"
        return (f"templates must reach {at} within a {budget:.4g} ms budget; the fastest node, {cfg}, "
                f"takes {best:.4g} ms")

    return explain
