"""The live planner after a spot notice (issue 30): the lost instance's (region, configuration) spot pools are
down for the fitted recovery time, the re-plan starts no spot instance in them (`allocate(..., spot_down=...)`:
the spot instances still running there stay) and still serves the lost instance's model, and once the pools
are back spot may be rented there again."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from coral.runtime.deploy.cluster_config import parse_cluster
from coral.runtime.deploy.mapping import cluster_from_plan
from coral.runtime.deploy.plan_file import load_plan_file
from coral.runtime.deploy.planner import PlanPlanner, template_key, traffic_observation

from .conftest import TWO_MODELS, write_plan
from .test_live_planner import _cluster


@pytest.fixture(scope="module")
def spot_served(tmp_path_factory):
    scenario, path = write_plan(tmp_path_factory.mktemp("spot"), TWO_MODELS, "plan.json", "--spot")
    pf = load_plan_file(path, str(scenario))
    cluster = cluster_from_plan(parse_cluster(_cluster()), pf)
    return pf, cluster


def _planner(pf, cluster, clock: list[float]) -> PlanPlanner:
    planner = PlanPlanner.from_plan(pf, {m.name: m for m in cluster.models})
    planner.clock = lambda: clock[0]
    return planner


def _configs(spec) -> set[str]:
    return set(template_key(spec).split("/", 2)[2].split("+"))


def _in_pools(specs, down) -> Counter:
    """Spot instances using one of the `down` pools, per (template, region)."""
    return Counter((template_key(s), s.region) for s in specs
                   if s.spot and any((s.region, c) in down for c in _configs(s)))


def test_the_served_spot_plan_replans_with_spot_on(spot_served):
    pf, cluster = spot_served
    assert any(i.spot for i in pf.instances) and not pf.scenario.spot  # `--spot` is not in the scenario file
    planner = _planner(pf, cluster, [0.0])
    assert planner.scenario.spot  # turned on again for the re-plans
    assert {s.name: s.spot for s in cluster.instances} == {
        f"{i.name}-r{r}": i.spot for i in pf.instances for r in range(i.count)}


def test_a_notice_replans_without_the_lost_spot_pools_until_they_are_back(spot_served):
    pf, cluster = spot_served
    clock = [100.0]
    planner = _planner(pf, cluster, clock)
    seen = traffic_observation(pf.scenario, 1.0)
    # the fleet as an epoch's re-plan leaves it; one of its spot instances gets the notice
    fleet = tuple(planner(seen, cluster.instances))
    lost = next(s for s in fleet if s.spot)
    running = tuple(s for s in fleet if s.name != lost.name)
    down = {(lost.region, c) for c in _configs(lost)}
    held = _in_pools(running, down)  # what still runs in the lost pools: it may stay, nothing may start there
    # without the pools down, the re-plan would start spot there again (so the checks below can fail)
    control = _planner(pf, cluster, clock)(seen, running)
    assert +(_in_pools(control, down) - held)
    desired = planner.after_notice(lost, running)
    assert desired is not None
    assert down == planner.pools_down()
    hold = {(r, c): max(planner.scenario.spot[(r, c)].process.recovery_s, planner.scenario.planner.epoch_s)
            for r, c in down}
    assert {p: clock[0] + h for p, h in hold.items()} == planner.spot_down
    # no spot instance starts in a lost pool: the plan keeps at most what runs there
    plan = planner.last_plan
    assert plan is not None
    assert not +(_in_pools(desired, down) - held), (_in_pools(desired, down), held)
    # the lost instance's model is still served (the re-plan may serve it colocated: the live planner plans
    # in mode auto), on-demand or in another spot pool
    assert any(s.model == lost.model for s in desired)
    # an epoch's re-plan while the pools are down still starts nothing there
    again = planner(seen, running)
    assert not +(_in_pools(again, down) - held), (_in_pools(again, down), held)
    # past the recovery time they are back (and forgotten)
    clock[0] += max(hold.values()) + 1.0
    assert frozenset() == planner.pools_down() and {} == planner.spot_down


def test_told_the_pool_is_back_the_planner_forgets_it(spot_served):
    pf, cluster = spot_served
    planner = _planner(pf, cluster, [0.0])
    planner.spot_lost("aws:us-east-2", ["4xL4", "1xL4"])
    planner.spot_lost("aws:ap-northeast-2", ["4xL4"])
    planner.spot_back(config="4xL4")
    assert frozenset({("aws:us-east-2", "1xL4")}) == planner.pools_down()
    planner.spot_back()
    assert frozenset() == planner.pools_down()


def test_an_on_demand_instance_needs_no_replan(spot_served):
    pf, cluster = spot_served
    planner = _planner(pf, cluster, [0.0])
    on_demand = dataclasses.replace(cluster.instances[0], spot=False)
    assert planner.after_notice(on_demand, cluster.instances[1:]) is None
    assert {} == planner.spot_down

