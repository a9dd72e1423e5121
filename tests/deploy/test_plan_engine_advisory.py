"""`coral plan --engine vllm` (the library restricted to what vLLM runs, its cost next to the full plan)
and `coral plan --running` (advisory: the diff against the fleet, nothing changed)."""
from __future__ import annotations

import json
import os

import pytest

from coral.runtime.deploy.vllm import vllm_reason

from .conftest import TWO_MODELS, flat, run, write_plan


def test_engine_vllm_plans_only_vllm_templates(tmp_path):
    scenario, plan = write_plan(tmp_path, TWO_MODELS, "vllm.json", "--engine", "vllm")
    data = json.loads(plan.read_text())
    for inst in data["instances"]:
        assert vllm_reason([s["nodes"] for s in inst["stages"]]) is None
    rep = data["engine_restriction"]
    assert rep["engine"] == "vllm"
    assert rep["engine_cost_usd_per_h"] == pytest.approx(data["cost_usd_per_h"])
    # a subset of the templates cannot plan cheaper (up to the MIP gap)
    assert rep["engine_cost_usd_per_h"] >= rep["unrestricted_cost_usd_per_h"] * (1 - 1e-3)
    assert rep["engine_cost_ratio"] == pytest.approx(rep["engine_cost_usd_per_h"] / rep["unrestricted_cost_usd_per_h"])
    assert 0 < rep["engine_templates"] < rep["templates"]
    r = run("plan", "--scenario", str(scenario), "--engine", "vllm")
    assert r.exit_code == 0
    assert "engine vllm:" in flat(r) and "unrestricted" in flat(r)


def test_engine_vllm_export_has_nothing_to_skip(tmp_path):
    scenario, plan = write_plan(tmp_path, TWO_MODELS, "vllm.json", "--engine", "vllm")
    r = run("export", "--plan", str(plan), "--format", "vllm", "--out", str(tmp_path / "v"), "--strict")
    assert r.exit_code == 0, r.output  # the plan file's scenario_source finds the YAML without --scenario
    assert not (tmp_path / "v" / "SKIPPED.txt").exists()


def test_running_prints_the_diff_and_changes_nothing(two_model_plan, tmp_path):
    scenario, running, data = two_model_plan
    before = (running.read_bytes(), os.stat(running).st_mtime_ns)
    r = run("plan", "--scenario", str(scenario), "--demand-scale", "2", "--running", str(running), "--json")
    assert r.exit_code == 0, r.output
    new = json.loads(r.output)
    adv = new["advisory"]
    assert (running.read_bytes(), os.stat(running).st_mtime_ns) == before
    assert adv["running_usd_per_h"] == pytest.approx(data["cost_usd_per_h"])
    assert adv["planned_usd_per_h"] == pytest.approx(new["cost_usd_per_h"])
    assert adv["delta_usd_per_h"] == pytest.approx(sum(c["delta_usd_per_h"] for c in adv["changes"]))
    # counts: running + start - drain = planned, for every template, and twice the demand starts something
    old = {(i["region"], i["model"], i["phase"], tuple(i["nodes"])): i["count"] for i in data["instances"]}
    for c in adv["changes"]:
        assert c["running"] + c["start"] - c["drain"] == c["planned"]
    assert adv["start"] > 0
    assert adv["unchanged"] + adv["drain"] == sum(old.values())
    r = run("plan", "--scenario", str(scenario), "--running", str(running))
    assert r.exit_code == 0
    assert "0 instance(s) to start, 0 to drain" in flat(r) and "(+0.00 $/h)" in flat(r)


def test_running_of_another_scenario_or_version_exits_2(two_model_plan, tmp_path):
    scenario, running, data = two_model_plan
    for edit, message in ((lambda d: d.update(scenario="core"), "field 'scenario' is 'core'"),
                          (lambda d: d.pop("plan_version"), "no plan_version")):
        bad = json.loads(json.dumps(data))
        edit(bad)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        out = tmp_path / "new.json"
        r = run("plan", "--scenario", str(scenario), "--running", str(path), "--out", str(out))
        assert r.exit_code == 2, r.output
        assert message in flat(r) and "--running" in flat(r)
        assert not out.exists()
