"""The live planner in plan mode: each epoch re-plans over the served plan's scenario (its library,
prices, availability, SLO-sized capacity) and maps the new plan to runtime instances as
`serve --plan` does."""
from __future__ import annotations

from collections import Counter

import pytest

from coral.catalog.hardware import split_group_name
from coral.policy.demand import epoch_demand, epoch_forecaster
from coral.runtime.deploy.cluster_config import MIXED, parse_cluster
from coral.runtime.deploy.lifecycle import reconcile
from coral.runtime.deploy.mapping import cluster_from_plan
from coral.runtime.deploy.plan_file import load_plan_file
from coral.runtime.deploy.planner import (
    FLOOR_TOK_PER_S,
    PlanPlanner,
    template_key,
    traffic_observation,
)
from coral.runtime.serving.window import EpochObservation

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


def _observed(pf, factor: float) -> EpochObservation:
    """What the coordinator would record over an epoch at `factor` times the scenario's traffic."""
    return traffic_observation(pf.scenario, factor)


def _by_template(specs) -> Counter[tuple[str, str | None]]:
    return Counter((s.region, template_key(s)) for s in specs)


def test_capacity_is_the_simulators_epoch_demand_at_least_the_floor(served):
    pf, cluster = served
    planner = _planner(pf, cluster)
    seen = _observed(pf, 2.0)
    want = planner.capacity(seen)
    same = epoch_demand(pf.scenario, seen.window, epoch_forecaster(pf.scenario), planner.sizing_library)
    assert {g: max(FLOOR_TOK_PER_S, v) for g, v in same.items()} == want
    assert all(v > FLOOR_TOK_PER_S for v in want.values())  # twice the traffic: real capacity, not the floor
    # nothing arrived: the floor everywhere, so an idle model keeps one instance
    assert {g: FLOOR_TOK_PER_S for g in want} == _planner(pf, cluster).capacity(_observed(pf, 0.0))


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
        # ...on the scenario's node shapes (an entry is a whole node or a TP group of one)
        assert all(split_group_name(c)[0] in configs for st in s.stages for c in st.configs)
        assert s.stages[-1].layer_end == LAYERS[s.model]
    # the capacity planned per (model, phase) covers the demand it was sized for
    p = _planner(pf, cluster)
    p(_observed(pf, 4.0), running)
    assert p.last_plan is not None
    for line in p.last_plan.demand:
        assert line.capacity_tok_per_s >= line.demand_tok_per_s * (1 - 1e-6)

    # shrink from the grown cluster: the served plan may already be one instance per (model, phase)
    down = _planner(pf, cluster)(_observed(pf, 0.05), up)
    shrunk = _by_template(down)
    assert sum(shrunk.values()) < sum(grown.values())
    assert any(shrunk[k] < grown[k] for k in grown)
    # an idle phase keeps one instance (the floor; a colocated one serves both), so the next request has somewhere to go
    idle = _planner(pf, cluster)(_observed(pf, 0.0), running)
    for m in LAYERS:
        for ph in ("prefill", "decode"):
            assert 1 <= sum(1 for s in idle if s.model == m and s.phase in (ph, MIXED))
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
