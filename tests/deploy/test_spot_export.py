"""Spot lines of a plan (issue 30) read back and exported: version 4 reads the flag (version 3 still reads, every
line on-demand), the SkyPilot engine tasks of a spot line rent spot and name SkyPilot's recovery strategy, the
on-demand ones are unchanged, node counts still add up, and bad spot fields are refused with one line."""
from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import yaml

from coral.catalog.models import builtin_model
from coral.errors import CoralError
from coral.runtime.deploy.export import control_cluster, export_skypilot, export_vllm
from coral.runtime.deploy.mapping import plan_instance_specs
from coral.runtime.deploy.plan_file import load_plan_file

from .conftest import flat, run
from .spot_plans import with_spot
from .test_skypilot_accepts import _sky_home, _sky_python

SPOT_LINES = {1, 3}  # phi-4 decode (shares its 1xL40S shape with the on-demand prefill), qwen3-32b decode (2 nodes)


def _write(tmp_path: Path, data: dict, name: str = "spot.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return p


@pytest.fixture()
def spot_plan(two_model_plan, tmp_path):
    scenario, _, data = two_model_plan
    two = json.loads(json.dumps(data))
    two["instances"][3]["count"] = 2  # two replicas of the 2-node spot line (with_spot rebuilds the node rows)
    d = with_spot(two, SPOT_LINES)
    return scenario, _write(tmp_path, d), d


def test_version_4_reads_the_spot_flag_and_version_3_reads_on_demand(two_model_plan, spot_plan):
    scenario, v3, _ = two_model_plan
    _, v4, data = spot_plan
    pf = load_plan_file(v4, str(scenario))
    assert [k in SPOT_LINES for k in range(len(data["instances"]))] == [i.spot for i in pf.instances]
    assert [0.8 if k in SPOT_LINES else 1.0 for k in range(len(pf.instances))] == [i.capacity_share for i in pf.instances]
    # spot rows are their own: the totals per (region, config) add both markets up, `spot_nodes` the spot ones
    spot_rows = Counter({(n["region"], n["config"]): n["count"] for n in data["nodes"] if n["spot"]})
    assert dict(spot_rows) == pf.spot_nodes
    total: Counter[tuple[str, str]] = Counter()
    for n in data["nodes"]:
        total[(n["region"], n["config"])] += n["count"]
    assert dict(total) == pf.nodes
    old = load_plan_file(v3, str(scenario))
    assert [False] * len(old.instances) == [i.spot for i in old.instances]
    assert {} == old.spot_nodes


def test_the_runtime_instances_carry_the_flag(spot_plan):
    scenario, path, data = spot_plan
    pf = load_plan_file(path, str(scenario))
    cluster = control_cluster(pf)
    want = {f"{i.name}-r{r}": i.spot for i in pf.instances for r in range(i.count)}
    assert want == {c["name"]: c.get("spot", False) for c in cluster["instances"]}
    models = {i.model: _Model(i.model, i.stages[-1].layer_end) for i in pf.instances}
    assert want == {s.name: s.spot for s in plan_instance_specs(pf, models)}


class _Model:
    """A cluster file's served model, as the mapping reads it: the built-in architecture of that name."""

    def __init__(self, name: str, layers: int) -> None:
        self.name, self.num_layers, self.seed, self.weights_path = name, layers, 0, None
        self.spec, self.config = builtin_model(name), {}


def test_skypilot_spot_tasks_use_spot_and_name_the_recovery_strategy(spot_plan):
    scenario, path, data = spot_plan
    pf = load_plan_file(path, str(scenario))
    ex = export_skypilot(pf)
    seen: Counter[tuple[str, str, bool]] = Counter()
    for inst in pf.instances:
        for config in set(inst.nodes):
            # a spot line: a task per replica (a managed job's recovery relaunches its whole task)
            names = [f"{inst.name}-r{r}-{config}.yaml" for r in range(inst.count)] if inst.spot else [f"{inst.name}-{config}.yaml"]
            for name in names:
                text = ex.files.pop(name)
                task = yaml.safe_load(text)
                res = task["resources"]
                if inst.spot:
                    assert True is res["use_spot"]
                    assert {"strategy": "FAILOVER"} == res["job_recovery"]
                    assert "# SPOT:" in text and "sky jobs launch" in text
                    # its ranks are its replica's machines of this configuration, and only those
                    replica = int(name.rsplit("-r", 1)[1].split("-", 1)[0])
                    assert {f"REPLICA={replica}"} == {w for w in task["run"].split() if w.startswith("REPLICA=")}
                    assert inst.nodes.count(config) == task["num_nodes"]
                else:  # on-demand: no spot field at all, as before spot existed
                    assert "use_spot" not in res and "job_recovery" not in res and "SPOT" not in text
                seen[(inst.region, config, inst.spot)] += task["num_nodes"]
    assert {"00-control-plane.yaml", ".sky.yaml"} == set(ex.files)  # no other task
    # the engine tasks' nodes add up to the plan's rows, per market
    assert Counter({(n["region"], n["config"], n["spot"]): n["count"] for n in data["nodes"]}) == seen
    control = yaml.safe_load(ex.files["00-control-plane.yaml"])  # (the engine tasks were popped above)
    assert "use_spot" not in control["resources"]  # the control plane never rides on spot


def test_vllm_scripts_mark_the_spot_lines(decode_plan, tmp_path):
    scenario, _, data = decode_plan
    pf = load_plan_file(_write(tmp_path, with_spot(data, SPOT_LINES)), str(scenario))
    ex = export_vllm(pf)
    for inst in pf.instances:
        text = ex.files.get(f"{inst.name}.sh")
        if text is not None:
            assert inst.spot == ("# SPOT: rent every machine here as a spot instance" in text), inst.name


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["instances"][1].update(spot="yes"), "field 'spot' must be true or false, got 'yes'"),
    (lambda d: d["instances"][1].update(capacity_share=1.5), "field 'capacity_share' must be a number in (0, 1]"),
    # a spot node listed as on-demand: the file was edited
    (lambda d: [n.update(spot=False) for n in d["nodes"]], "does not match the nodes of its instances"),
])
def test_bad_spot_fields_exit_2_and_write_nothing(spot_plan, tmp_path, edit, message):
    scenario, _, data = spot_plan
    bad = json.loads(json.dumps(data))
    edit(bad)
    path = _write(tmp_path, bad, "bad.json")
    with pytest.raises(CoralError, match="instances\\[1\\]|nodes"):
        load_plan_file(path, str(scenario))
    r = run("export", "--plan", str(path), "--scenario", str(scenario), "--format", "skypilot", "--out", str(tmp_path / "o"))
    assert 2 == r.exit_code, r.output
    assert message in flat(r)
    assert not (tmp_path / "o").exists()


CHECK = r"""
import json, sys, yaml
import sky
out = []
for path in sys.argv[1:]:
    (res,) = sky.Task.from_yaml_config(yaml.safe_load(open(path))).resources
    out.append({"file": path, "use_spot": res.use_spot, "job_recovery": res.job_recovery})
print(json.dumps(out))
"""


def test_skypilot_reads_the_spot_fields(spot_plan, tmp_path, data_dir):
    """SkyPilot's own loader takes `use_spot` and `job_recovery` as the export writes them."""
    exe = _sky_python()
    scenario, path, _ = spot_plan
    r = run("export", "--plan", str(path), "--scenario", str(scenario), "--format", "skypilot", "--out", str(tmp_path / "sky"))
    assert 0 == r.exit_code, r.output
    files = sorted(str(p) for p in (tmp_path / "sky").glob("[!.]*.yaml") if p.name != "00-control-plane.yaml")
    home = tmp_path / "home"
    _sky_home(home, data_dir)
    env = {**os.environ, "HOME": str(home), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1"}
    proc = subprocess.run([exe, "-c", CHECK, *files], capture_output=True, text=True, env=env, timeout=240)
    assert 0 == proc.returncode, proc.stderr[-3000:]
    got = {Path(t["file"]).name: (t["use_spot"], t["job_recovery"]) for t in json.loads(proc.stdout.strip().splitlines()[-1])}
    pf = load_plan_file(path, str(scenario))
    want = {f"{i.name}-{c}.yaml": (False, None) for i in pf.instances if not i.spot for c in set(i.nodes)}
    want |= {f"{i.name}-r{r}-{c}.yaml": (True, {"strategy": "FAILOVER"})
             for i in pf.instances if i.spot for c in set(i.nodes) for r in range(i.count)}
    assert want == got


def test_a_version_4_line_without_spot_is_on_demand(spot_plan, tmp_path):
    scenario, _, data = spot_plan
    d = json.loads(json.dumps(data))
    d["instances"][0].pop("spot")  # an on-demand line (as a hand-written plan has it)
    d["instances"][1].pop("spot")  # a spot line whose flag was dropped: its spot node rows no longer match
    d["instances"][1]["capacity_share"] = 1.0
    with pytest.raises(CoralError, match="field 'nodes' does not match the nodes of its instances"):
        load_plan_file(_write(tmp_path, d, "d.json"), str(scenario))
    d["nodes"] = with_spot({**data, "instances": d["instances"]}, SPOT_LINES - {1})["nodes"]
    pf = load_plan_file(_write(tmp_path, d, "e.json"), str(scenario))
    assert [k in SPOT_LINES - {1} for k in range(len(pf.instances))] == [i.spot for i in pf.instances]


def test_advisory_keeps_spot_and_on_demand_lines_apart_and_keys_prev_as_the_allocator(two_model_plan, spot_plan):
    from coral.allocator.spot import spot_region
    from coral.runtime.deploy.advisory import diff_plans, running_counts

    scenario, v3, _ = two_model_plan
    _, v4, _ = spot_plan
    on_demand, spot = load_plan_file(v3, str(scenario)), load_plan_file(v4, str(scenario))
    prev = running_counts(spot)
    want: Counter[tuple[str, str]] = Counter()
    for i in spot.instances:
        want[(spot_region(i.region) if i.spot else i.region, i.key)] += i.count
    assert dict(want) == prev  # what the allocator's `prev` (Plan.counts) keys spot instances by
    # moving a line from on-demand to spot drains the one and starts the other: they are not the same line
    diff = diff_plans(on_demand, spot)
    moved = {(c.key, c.spot): (c.running, c.planned) for c in diff.changes}
    for k in SPOT_LINES:
        i, j = on_demand.instances[k], spot.instances[k]
        assert (i.count, 0) == moved[(i.key, False)] and (0, j.count) == moved[(j.key, True)]
    assert [True] * len(SPOT_LINES) == [c["spot"] for c in diff.to_json()["changes"] if c["planned"]]
