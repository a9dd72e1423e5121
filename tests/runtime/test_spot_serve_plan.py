"""`coral serve --plan` of a spot plan (`coral plan --spot`, issue 30) under the live planner, on real processes
(127.0.0.1, a tiny model with phi-4's 40 layers): a notice for a spot instance re-plans with its spot pool down,
what starts is on-demand or spot from another pool, `POST /admin/preempt` says so, and the model keeps serving."""
from __future__ import annotations

from pathlib import Path

import yaml
from click.testing import CliRunner

from coral.cli import main
from coral.runtime.deploy.cluster_config import parse_cluster
from coral.runtime.deploy.deployment import Deployment
from coral.runtime.deploy.mapping import cluster_from_plan
from coral.runtime.deploy.plan_file import load_plan_file
from coral.runtime.deploy.planner import PlanPlanner, template_key

from .conftest import http, wait_until
from .test_serve_plan import PHI, phi_cluster


def _pools(spec) -> set[tuple[str, str]]:
    return {(spec.region, c) for c in template_key(spec).split("/", 2)[2].split("+")}


def test_a_notice_in_a_served_spot_plan_replans_off_the_lost_pool(tmp_path: Path) -> None:
    scen = tmp_path / "s.yaml"
    scen.write_text(yaml.safe_dump(PHI))
    plan = tmp_path / "plan.json"
    r = CliRunner().invoke(main, ["plan", "--scenario", str(scen), "--mode", "disagg", "--spot", "--out", str(plan)])
    assert r.exit_code == 0, r.output
    pf = load_plan_file(plan)
    cluster = cluster_from_plan(parse_cluster(phi_cluster(40)), pf)
    spot = [s for s in cluster.instances if s.spot]
    assert spot, "the plan rents no spot: nothing to preempt"
    planner = PlanPlanner.from_plan(pf, {m.name: m for m in cluster.models})
    dep = Deployment(cluster, http_port=0, planner=planner)
    dep.start(timeout_s=240)
    try:
        coord, ctl = dep.coordinator, dep.controller
        assert coord is not None and ctl is not None
        lost = spot[0]
        status, body = http("POST", dep.url + "/admin/preempt", {"node": lost.name}, timeout_s=120)
        assert 200 == status, body
        assert (lost.name, True) == (body["noticed"], body["replanned"])
        down = _pools(lost)
        assert down == planner.pools_down()
        started = {s["instance"] for s in body["started"]}
        assert started == {n for n in ctl.running if n not in {s.name for s in cluster.instances}}
        # (here every phi-4 instance rents the lost pool: the re-plan moves phi-4 elsewhere, and its new instances
        # are the replacements, for which the model's requests are held)
        under_way = {n for n, r in ctl.repairs.items() if r.replaces == lost.name}  # (read before `repaired`: one that comes up moves there)
        assert started and started == under_way | {r["by"] for r in ctl.repaired if r["replaced"] == lost.name}
        # nothing running or started rents spot from the lost pool
        assert [] == [n for n, s in ctl.running.items() if s.spot and _pools(s) & down]
        assert wait_until(lambda: started <= set(coord.instances), 120), "a started instance never registered"
        for prompt in ([1, 2, 3], [7] * 12):
            s, b = http("POST", dep.url + "/v1/completions", {"model": "phi-4", "prompt": prompt, "max_tokens": 3,
                                                             "temperature": 0})
            assert 200 == s, b
        assert wait_until(lambda: lost.name in coord.retired, 60)
    finally:
        dep.stop()
