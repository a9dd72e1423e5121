"""`coral serve --plan`: a plan file's instances started as real processes on 127.0.0.1 and served
end to end (a tiny model with the planned model's layer count stands in for it)."""
from __future__ import annotations

import json
from pathlib import Path

import yaml
from click.testing import CliRunner

from coral.cli import main
from coral.runtime.deploy.cluster_config import parse_cluster
from coral.runtime.deploy.deployment import Deployment
from coral.runtime.deploy.mapping import cluster_from_plan_file
from coral.runtime.engine.model import BUILTIN_CONFIGS

from .conftest import http

PHI = {
    "name": "servetest", "description": "phi-4 only",
    "models": [{"name": "phi-4", "ttft_ms": 2000, "tpot_ms": 80,
                "workload": {"rate_per_s": 4, "dataset": "synthetic", "prompt_tokens_mean": 600, "output_tokens_mean": 60}}],
    "configs": ["1xL40S", "4xL40S", "1xL4", "4xL4"],
    "regions": [{"name": "aws:us-east-2"}],
    "planner": {"n_max": 3, "batch_grid": [1, 4, 16, 64], "history_s": 900, "epoch_s": 120},
}


def phi_cluster(layers: int) -> dict:
    """A CPU cluster file of the `layers`-layer tiny phi-4 stand-in, whose instances a plan replaces."""
    return {
        "coordinator": {"port": 0}, "device": "cpu",
        "models": [{"name": "phi-4", "hf_config": {**BUILTIN_CONFIGS["tiny-llama"], "num_hidden_layers": layers},
                    "weights": {"seed": 3}}],
        # replaced by the plan's instances
        "instances": [{"name": "x", "model": "phi-4", "phase": "mixed", "region": "r", "stages": [{"layers": [0, layers]}]}],
    }


def test_serve_plan_starts_the_plans_instances_and_serves(tmp_path: Path) -> None:
    scen = tmp_path / "s.yaml"
    scen.write_text(yaml.safe_dump(PHI))
    plan = tmp_path / "plan.json"
    r = CliRunner().invoke(main, ["plan", "--scenario", str(scen), "--mode", "disagg", "--out", str(plan)])
    assert r.exit_code == 0, r.output
    data = json.loads(plan.read_text())
    cluster = cluster_from_plan_file(parse_cluster(phi_cluster(40)), str(plan))
    assert sum(i["count"] for i in data["instances"]) == len(cluster.instances)
    dep = Deployment(cluster, http_port=0)
    dep.start(timeout_s=180)
    try:
        assert dep.coordinator is not None
        assert {i.name for i in cluster.instances} == set(dep.coordinator.instances)
        for prompt in ([1, 2, 3], [7] * 12, [40, 41]):
            s, b = http("POST", dep.url + "/v1/completions", {"model": "phi-4", "prompt": prompt, "max_tokens": 3,
                                                             "temperature": 0})
            assert 200 == s, b
            assert 3 == len(b["choices"][0]["token_ids"])
    finally:
        dep.stop()


def test_serve_plan_of_another_model_exits_2(tmp_path: Path) -> None:
    scen = tmp_path / "s.yaml"
    scen.write_text(yaml.safe_dump(PHI))
    plan = tmp_path / "plan.json"
    assert CliRunner().invoke(main, ["plan", "--scenario", str(scen), "--mode", "disagg", "--out", str(plan)]).exit_code == 0
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml.safe_dump(phi_cluster(6)))
    r = CliRunner().invoke(main, ["serve", "--config", str(cfg), "--plan", str(plan)])
    assert 2 == r.exit_code
    assert "40 layers in the plan but 6" in " ".join(r.output.split())


def test_dry_run_serves_the_first_plan_and_only_logs_later_changes() -> None:
    from .test_lifecycle import CLUSTER, NEW_C

    dep = Deployment(parse_cluster(CLUSTER), http_port=0, dry_run=True)
    dep.start(timeout_s=120)
    try:
        coord, ctl, prov = dep.coordinator, dep.controller, dep.provisioner
        assert coord is not None and {"a", "b"} == set(coord.instances)
        s, body = http("POST", dep.url + "/admin/plan", {"instances": [CLUSTER["instances"][1], NEW_C]})
        assert 200 == s, body
        planned = {(a["kind"], a["instance"]) for a in body["actions"] if a["kind"] != "keep"}
        assert {("drain", "a"), ("start", "c")} == planned
        assert ctl.history[-1]["dry_run"] is True
        assert planned == set(ctl.history[-1]["actions"])
        ctl.epoch()
        # nothing was carried out: a still serves, c was never started
        assert {"a", "b"} == set(coord.instances) and "a" not in coord.retired
        assert prov.instance_alive("a") and not prov.pids("c")
        s, b = http("POST", dep.url + "/v1/completions", {"model": "llama", "prompt": [5, 6], "max_tokens": 2, "temperature": 0})
        assert 200 == s
    finally:
        dep.stop()


def test_live_replan_of_a_served_plan_logs_real_templates_in_dry_run_then_acts(tmp_path: Path, caplog) -> None:
    """`planner: allocator` with `--plan`: an idle epoch re-plans the scenario down to its floor; the dry
    run logs the drains with their templates' node shapes and does nothing; then they are carried out."""
    import logging

    from coral.runtime.deploy.mapping import cluster_from_plan
    from coral.runtime.deploy.plan_file import load_plan_file
    from coral.runtime.deploy.planner import PlanPlanner

    scen = tmp_path / "s.yaml"
    scen.write_text(yaml.safe_dump({**PHI, "models": [{**PHI["models"][0], "workload": {
        **PHI["models"][0]["workload"], "rate_per_s": 12}}]}))  # enough traffic for several instances
    plan = tmp_path / "plan.json"
    # disaggregated: an idle epoch then sizes prefill for one burst and drains the rest (auto plans phi-4 colocated
    # here, whose instances the same burst sizing keeps)
    assert CliRunner().invoke(main, ["plan", "--scenario", str(scen), "--mode", "disagg", "--out", str(plan)]).exit_code == 0
    pf = load_plan_file(plan)
    cluster = cluster_from_plan(parse_cluster(phi_cluster(40)), pf)
    assert len(cluster.instances) > 2
    planner = PlanPlanner.from_plan(pf, {m.name: m for m in cluster.models})
    dep = Deployment(cluster, http_port=0, planner=planner, dry_run=True)
    dep.start(timeout_s=240)
    try:
        coord, ctl = dep.coordinator, dep.controller
        assert coord is not None
        s, b = http("POST", dep.url + "/v1/completions", {"model": "phi-4", "prompt": [1, 2], "max_tokens": 2})
        assert 200 == s, b
        with caplog.at_level(logging.WARNING, logger="coral.runtime.deploy.lifecycle"):
            actions = ctl.epoch()  # two tokens in an epoch: far below the plan's demand
        drains = sorted(a.name for a in actions if a.kind == "drain")
        assert drains, "an idle cluster kept every instance"
        entry = ctl.history[-1]
        assert entry["dry_run"] is True and {("drain", n) for n in drains} <= set(entry["actions"])
        configs = {c.name for c in pf.scenario.configs}
        for t in entry["templates"]:  # e.g. phi-4/prefill/4xL40S in aws:us-east-2
            model, phase, rest = t.split("/", 2)
            assert model == "phi-4" and phase in ("prefill", "decode")
            assert set(rest.split(" in ")[0].split("+")) <= configs
        assert any("would drain" in r.getMessage() and "in aws:us-east-2" in r.getMessage() for r in caplog.records)
        assert {i.name for i in cluster.instances} == set(coord.instances)  # nothing was done
        assert not coord.retired
        ctl.dry_run = False
        ctl.apply_plan(ctl.target)  # the same re-plan, carried out
        from .conftest import wait_until

        assert wait_until(lambda: set(drains) <= set(coord.retired), 60)
        assert planner.last_plan is not None
        left = set(coord.instances) - set(coord.retired)
        assert len(left) == sum(i.count for i in planner.last_plan.instances)
        s, b = http("POST", dep.url + "/v1/completions", {"model": "phi-4", "prompt": [3, 4], "max_tokens": 2})
        assert 200 == s, b
    finally:
        dep.stop()


def test_serve_refuses_a_plan_of_another_version_or_scenario_and_remote_without_ports(tmp_path: Path) -> None:
    scen = tmp_path / "s.yaml"
    scen.write_text(yaml.safe_dump(PHI))
    plan = tmp_path / "plan.json"
    assert CliRunner().invoke(main, ["plan", "--scenario", str(scen), "--mode", "disagg", "--out", str(plan)]).exit_code == 0
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml.safe_dump(phi_cluster(40)))
    ready = tmp_path / "ready.txt"
    old = json.loads(plan.read_text())
    old["plan_version"] = 1
    (tmp_path / "old.json").write_text(json.dumps(old))
    for args, message in (
        (["--plan", str(tmp_path / "old.json")], "plan_version 1; this Coral reads plan_version 3"),
        (["--plan", str(plan), "--scenario", "core"], "field 'scenario' is 'servetest', but the scenario given is 'core'"),
        (["--provisioner", "remote"], "instance x has no scheduler_port"),
    ):
        r = CliRunner().invoke(main, ["serve", "--config", str(cfg), "--ready-file", str(ready), *args])
        assert 2 == r.exit_code, r.output
        assert message in " ".join(r.output.split())
        assert "Traceback" not in r.output and not ready.exists()
