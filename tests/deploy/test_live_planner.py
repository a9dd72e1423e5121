"""The live planner in plan mode: each epoch re-plans over the served plan's scenario (its library,
prices, availability, SLO-sized capacity) and maps the new plan to runtime instances as
`serve --plan` does."""
from __future__ import annotations

from collections import Counter

import pytest

from coral.allocator.demand import capacity_targets, offered_demand
from coral.perf.model import Phase
from coral.runtime.deploy.cluster_config import parse_cluster
from coral.runtime.deploy.lifecycle import reconcile
from coral.runtime.deploy.mapping import cluster_from_plan
from coral.runtime.deploy.plan_file import load_plan_file
from coral.runtime.deploy.planner import FLOOR_TOK_PER_S, PlanPlanner, template_key

LAYERS = {"phi-4": 40, "qwen3-32b": 64}


def _cluster() -> dict:
    tiny = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    return {"coordinator": {"port": 0}, "device": "cpu",
            "models": [{"name": n, "hf_config": {**tiny, "num_hidden_layers": k}, "weights": {"seed": 1}}
                       for n, k in LAYERS.items()],
            "instances": [{"name": f"x-{n}", "model": n, "stages": [{"layers": [0, k]}]} for n, k in LAYERS.items()]}


@pytest.fixture
def served(two_model_plan):
    scenario, path, _ = two_model_plan
    pf = load_plan_file(path, str(scenario))
    cluster = cluster_from_plan(parse_cluster(_cluster()), pf)
    return pf, cluster


def _planner(pf, cluster) -> PlanPlanner:
    return PlanPlanner.from_plan(pf, {m.name: m for m in cluster.models})


def _observed(pf, factor: float) -> dict[str, dict[str, float]]:
    """What the coordinator would report at `factor` times the scenario's offered traffic."""
    offered = offered_demand(pf.scenario)
    return {m.name: {ph.value: factor * offered[(m.name, ph)] for ph in Phase} for m in pf.scenario.models}


def _by_template(specs) -> Counter[tuple[str, str | None]]:
    return Counter((s.region, template_key(s)) for s in specs)


def test_capacity_is_the_offline_sizing_at_the_forecast_rate(served):
    pf, cluster = served
    planner = _planner(pf, cluster)
    want = planner.capacity(_observed(pf, 2.0))
    history = capacity_targets(pf.scenario, library=planner.sizing_library)
    # a first observation has no history: the forecast adds a 25 % spread at the quantile
    from statistics import NormalDist

    f = 2.0 * (1 + NormalDist().inv_cdf(pf.scenario.planner.forecast_quantile) * 0.25)
    for m in pf.scenario.models:
        for ph in Phase:
            assert history[(m.name, ph)].capacity_tok_per_s * f == pytest.approx(want[(m.name, ph)])


def test_replan_under_changed_demand_adds_and_removes_real_templates(served):
    pf, cluster = served
    running = cluster.instances
    planned = _by_template(running)
    keys = {t.key for t in _planner(pf, cluster).library.templates}
    assert all(k in keys for _, k in planned)  # the served plan's instances are the library's templates

    up = _planner(pf, cluster)(_observed(pf, 4.0), running)
    grown = _by_template(up)
    assert sum(grown.values()) > sum(planned.values())
    assert any(grown[k] > planned[k] for k in grown)  # more instances of real templates...
    configs = {c.name for c in pf.scenario.configs}
    for s in up:
        assert template_key(s) in keys
        assert all(c in configs for st in s.stages for c in st.configs)  # ...on the scenario's node shapes
        assert s.stages[-1].layer_end == LAYERS[s.model]
    # the capacity planned per (model, phase) covers the demand it was sized for
    p = _planner(pf, cluster)
    p(_observed(pf, 4.0), running)
    assert p.last_plan is not None
    for line in p.last_plan.demand:
        assert line.capacity_tok_per_s >= line.demand_tok_per_s * (1 - 1e-6)

    down = _planner(pf, cluster)(_observed(pf, 0.05), running)
    shrunk = _by_template(down)
    assert sum(shrunk.values()) < sum(planned.values())
    # an idle phase keeps one instance (the floor), so the next request has somewhere to go
    idle = _planner(pf, cluster)({}, running)
    for m in LAYERS:
        for ph in ("prefill", "decode"):
            assert 1 <= sum(1 for s in idle if s.model == m and s.phase == ph)
    assert p.last_demand and min(p.last_demand.values()) >= FLOOR_TOK_PER_S


def test_a_steady_demand_keeps_the_running_instances(served):
    """Re-planning the same demand with the running plan as prev changes nothing (no churn)."""
    pf, cluster = served
    planner = _planner(pf, cluster)
    first = planner(_observed(pf, 2.0), cluster.instances)
    running = {s.name: s for s in first}
    again = planner(_observed(pf, 2.0), tuple(first))
    actions = reconcile(again, running, {}, set(running))
    assert all(a.kind == "keep" for a in actions), [(a.kind, a.name) for a in actions if a.kind != "keep"]
