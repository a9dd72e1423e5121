"""`coral plan --engine vllm` (the library restricted to what vLLM runs, its cost next to the full plan)
and `coral plan --running` (advisory: the diff against the fleet, nothing changed)."""
from __future__ import annotations

import json
import os

import pytest

from coral.catalog.models import builtin_model
from coral.runtime.deploy.vllm import vllm_reason

from .conftest import TWO_MODELS, flat, run, with_first_token, write_plan

# qwen3-32b alone (64 heads, 8 KV heads: TP 1, 2, 4, 8): phi-4's 10 KV heads refuse the 4-way TP of a
# whole 4-GPU node, the only template that met its TTFT in TWO_MODELS before the planner splits nodes
QWEN = {**TWO_MODELS, "name": "deployqwen", "models": [m for m in TWO_MODELS["models"] if m["name"] == "qwen3-32b"]}


def test_engine_vllm_plans_only_vllm_templates(tmp_path):
    scenario, plan = write_plan(tmp_path, QWEN, "vllm.json", "--engine", "vllm")
    data = json.loads(plan.read_text())
    for inst in data["instances"]:
        assert vllm_reason([s["nodes"] for s in inst["stages"]], spec=builtin_model(inst["model"])) is None
    rep = data["engine_restriction"]
    assert rep["engine"] == "vllm"
    assert rep["engine_cost_usd_per_h"] == pytest.approx(data["cost_usd_per_h"])
    # a subset of the templates cannot plan cheaper (up to the MIP gap)
    assert rep["engine_cost_usd_per_h"] >= rep["unrestricted_cost_usd_per_h"] * (1 - 1e-3)
    assert rep["engine_cost_ratio"] == pytest.approx(rep["engine_cost_usd_per_h"] / rep["unrestricted_cost_usd_per_h"])
    assert 0 < rep["engine_templates"] < rep["templates"]
    r = run("plan", "--scenario", str(scenario), "--mode", "disagg", "--engine", "vllm")
    assert r.exit_code == 0
    assert "engine vllm:" in flat(r) and "unrestricted" in flat(r)


def test_engine_vllm_export_has_nothing_to_skip(tmp_path):
    scenario, plan = write_plan(tmp_path, QWEN, "vllm.json", "--engine", "vllm")
    data = json.loads(plan.read_text())
    plan.write_text(json.dumps(with_first_token(data, "decode")))  # vLLM's P/D proxy emits it from decode
    r = run("export", "--plan", str(plan), "--format", "vllm", "--out", str(tmp_path / "v"), "--strict")
    assert r.exit_code == 0, r.output  # the plan file's scenario_source finds the YAML without --scenario
    assert not (tmp_path / "v" / "SKIPPED.txt").exists()


@pytest.mark.parametrize("mode", [None, "prefill"])
def test_vllm_export_refuses_a_plan_whose_first_token_leaves_from_prefill(two_model_plan, tmp_path, mode):
    scenario, _, data = two_model_plan
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(with_first_token(data, mode)))
    r = run("export", "--plan", str(plan), "--scenario", str(scenario), "--format", "vllm", "--out", str(tmp_path / "v"))
    assert r.exit_code == 2 and "Traceback" not in r.output
    first = min(i["model"] for i in data["instances"] if i["phase"] != "colocated")  # a colocated model has no hand-off
    assert f"{first} emits its first token from prefill (first_token prefill" in flat(r)
    assert ("prefill by default" in flat(r)) == (mode is None) and not (tmp_path / "v").exists()
    # Coral's runtime runs it: the SkyPilot export takes the mode into the control plane's cluster file
    assert 0 == run("export", "--plan", str(plan), "--scenario", str(scenario), "--format", "skypilot", "--out",
                    str(tmp_path / "s")).exit_code


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
