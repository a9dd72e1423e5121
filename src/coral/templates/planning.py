"""A scenario's per-model planning figures that the templates' budget model defines: how each
model's KV transfer is charged and the latency budget its templates are held to (DESIGN §4a).

They sit here, above `coral.scenario`, because they are `coral.templates.budget`'s model applied to
a resolved scenario's traffic (`coral.scenario.traffic`): the scenario below never needs them."""
from __future__ import annotations

from typing import Any

from coral.scenario.traffic import length_summary, scenario_key
from coral.templates.budget import KvModel, kv_model, latency_budget_ms

_KV: dict[tuple[Any, ...], KvModel] = {}


def model_kv(scenario: Any, model: str) -> KvModel:
    """How `model`'s KV transfer is charged (`coral.templates.budget.kv_model`, with the planner's
    `first_token` mode). Memoized per scenario content."""
    key = (scenario_key(scenario), model)
    hit = _KV.get(key)
    if hit is None:
        served = scenario.model(model)
        if len(_KV) > 256:
            _KV.clear()
        hit = _KV[key] = kv_model(served.spec, length_summary(scenario, model), served.slo, scenario.configs,
                                  scenario.planner.first_token, scenario.planner.kv_ttft_share,
                                  scenario.planner.kv_tpot_share)
    return hit


def template_budget_ms(scenario: Any, model: str, phase: Any) -> float:
    """The latency budget (ms) of `model`'s `phase` templates in this scenario: the one derivation
    (`coral.templates.budget.latency_budget_ms` with the model's KV allowance) that the library,
    `coral templates solve` and hand-made templates share."""
    served = scenario.model(model)
    planner = scenario.planner
    return latency_budget_ms(served.slo, phase, ttft_headroom=planner.ttft_headroom,
                             tpot_headroom=planner.tpot_headroom, kv=model_kv(scenario, model))
