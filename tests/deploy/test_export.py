"""`coral export`: SkyPilot tasks whose nodes add up to the plan's, vLLM commands whose partitions
add up to the model's layers, and refusals (exit 2, nothing written) for bad plans and derived shapes."""
from __future__ import annotations

import json
import shlex
from collections import Counter

import pytest
import yaml

from coral.catalog.models import builtin_model
from coral.runtime.deploy.export import export_skypilot, export_vllm
from coral.runtime.deploy.plan_file import load_plan_file
from coral.runtime.deploy.vllm import vllm_reason

from .conftest import DERIVED, TWO_MODELS, flat, run, write_plan


def _export(plan, scenario, fmt, out, *extra):
    return run("export", "--plan", str(plan), "--scenario", str(scenario), "--format", fmt, "--out", str(out), *extra)


def test_skypilot_nodes_add_up_to_the_plan(two_model_plan, tmp_path):
    scenario, plan, data = two_model_plan
    r = _export(plan, scenario, "skypilot", tmp_path / "sky")
    assert r.exit_code == 0, r.output
    got: Counter[tuple[str, str]] = Counter()
    control = yaml.safe_load((tmp_path / "sky" / "00-control-plane.yaml").read_text())
    assert "accelerators" not in control["resources"] and 1 == control["num_nodes"]  # a CPU node
    for f in sorted((tmp_path / "sky").glob("[!.]*.yaml")):  # .sky.yaml is SkyPilot's project config
        if f.name == "00-control-plane.yaml":
            continue
        task = yaml.safe_load(f.read_text())
        res = task["resources"]
        gpu, count = res["accelerators"].split(":")
        config = f"{count}x{gpu}"
        region = f"{res['cloud']}:{res['region']}"
        # an instance type other than the shape's default is its own configuration, asked for by name
        typed = [n["config"] for n in data["nodes"] if n["config"].startswith(config + "@")
                 and n.get("instance_type") == res.get("instance_type")]
        got[(region, typed[0] if typed else config)] += task["num_nodes"]
        # every rank of the task has a line in its run script, and no more
        assert task["run"].count(") REPLICA=") == task["num_nodes"]
    want = Counter({(n["region"], n["config"]): n["count"] for n in data["nodes"] if n["count"]})
    assert want == got


def test_skypilot_run_lines_cover_each_replica_layers(two_model_plan):
    scenario, plan, data = two_model_plan
    pf = load_plan_file(plan, str(scenario))
    ex = export_skypilot(pf)
    # the control plane + engine tasks, and SkyPilot's project config
    assert 1 + sum(len(set(i.nodes)) for i in pf.instances) == len([n for n in ex.files if not n.startswith(".")])
    for inst in pf.instances:
        ranges: Counter[tuple[int, int, int]] = Counter()
        for config in set(inst.nodes):
            run_script = yaml.safe_load(ex.files[f"{inst.name}-{config}.yaml"])["run"]
            for line in run_script.splitlines():
                if ") REPLICA=" in line:
                    rep = int(line.split("REPLICA=", 1)[1].split()[0])
                    engines = json.loads(shlex.split(line.split("ENGINES=", 1)[1])[0])
                    for e in engines:
                        ranges[(rep, e["layer_start"], e["layer_end"])] += 1
        layers = builtin_model(inst.model).num_layers
        for rep in range(inst.count):
            covered = sorted({(a, b) for (r, a, b) in ranges if r == rep})
            assert covered[0][0] == 0 and covered[-1][1] == layers
            assert all(x[1] == y[0] for x, y in zip(covered, covered[1:], strict=False))


def test_vllm_partitions_sum_to_the_model_layers(decode_plan, tmp_path):
    scenario, plan, data = decode_plan
    r = _export(plan, scenario, "vllm", tmp_path / "vllm")
    assert r.exit_code == 0, r.output
    scripts = sorted((tmp_path / "vllm").glob("*.sh"))
    assert scripts
    layers = {m["name"]: builtin_model(m["name"]).num_layers for m in TWO_MODELS["models"]}
    for f in scripts:
        text = f.read_text()
        cmd = next(line for line in text.splitlines() if "vllm serve" in line)
        env = dict(tok.split("=", 1) for tok in cmd.split() if tok.startswith("VLLM_PP_LAYER_PARTITION="))
        pp = int(cmd.split("--pipeline-parallel-size ")[1].split()[0])
        model = next(m for m in layers if f"-{m}-" in f.name)
        parts = [int(x) for x in env["VLLM_PP_LAYER_PARTITION"].split(",")] if pp > 1 else [layers[model]]
        assert "VLLM_PP_LAYER_PARTITION" in env or pp == 1
        assert layers[model] == sum(parts)
        assert pp == len(parts)
        tp = int(cmd.split("--tensor-parallel-size ")[1].split()[0])
        assert builtin_model(model).tp_problem(tp) is None  # only degrees vLLM accepts
        # a disaggregated line joins its P/D pair by NIXL; a colocated one runs chunked prefill
        assert ("--enable-chunked-prefill" in cmd) if "-colocated-" in f.name else ("NixlConnector" in cmd)
    # every instance line is either a script or listed with its reason
    listed = (tmp_path / "vllm" / "SKIPPED.txt").read_text().splitlines() if (tmp_path / "vllm" / "SKIPPED.txt").exists() else []
    assert len(scripts) + len(listed) == len(data["instances"])
    for line in listed:
        assert "vLLM" in line


def test_vllm_reason():
    assert vllm_reason([["4xL4"], ["4xL40S"]]) is None
    assert vllm_reason([["1xL4"]]) is None
    assert vllm_reason([["4xL4", "4xL4"]]) is None  # one stage: a server per node
    assert "data-parallel" in vllm_reason([["4xL4", "4xL4"], ["4xL40S"]])
    assert "tensor-parallel degree" in vllm_reason([["4xL4"], ["2xL40S"]])
    assert "10 KV heads" in vllm_reason([["4xL40S"]], spec=builtin_model("phi-4"))


def _with_a_data_parallel_stage(data: dict) -> dict:
    """The plan with its first instance as a two-stage pipeline whose first stage is data parallel over two
    1xL4 (which vLLM's pipeline cannot express), the plan's node counts kept consistent."""
    d = json.loads(json.dumps(data))
    inst = d["instances"][0]
    layers = sum(s["layers"] for s in inst["stages"])
    for c in inst["nodes"]:
        next(n for n in d["nodes"] if (n["region"], n["config"]) == (inst["region"], c))["count"] -= inst["count"]
    inst["nodes"] = ["1xL4", "1xL4", "1xL40S"]
    inst.pop("hosts", None)  # the reader derives them from the new stages
    inst["stages"] = [{"nodes": ["1xL4", "1xL4"], "layers": layers - 1, "throughput_tok_per_s": 1.0},
                      {"nodes": ["1xL40S"], "layers": 1, "throughput_tok_per_s": 1.0}]
    for c, k in (("1xL4", 2), ("1xL40S", 1)):
        row = next((n for n in d["nodes"] if (n["region"], n["config"]) == (inst["region"], c)), None)
        if row is None:
            d["nodes"].append(row := {"region": inst["region"], "config": c, "count": 0})
        row["count"] += k * inst["count"]
    return d


def test_strict_vllm_refuses_an_inexpressible_instance(decode_plan, tmp_path):
    scenario, _, data = decode_plan
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_with_a_data_parallel_stage(data)))
    assert export_vllm(load_plan_file(plan, str(scenario))).skipped  # the edited instance, at least
    r = _export(plan, scenario, "vllm", tmp_path / "out", "--strict")
    assert r.exit_code == 2
    assert "cannot express instance" in flat(r)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("plan_version"), "no plan_version"),
    (lambda d: d.update(plan_version=1), "plan_version 1"),
    (lambda d: d.update(scenario="core"), "field 'scenario' is 'core'"),
    (lambda d: d["instances"][0].update(model="llama-2-70b"), "not in scenario"),
    (lambda d: d["instances"][0]["stages"][0].update(layers=1), "layers"),
    (lambda d: d["nodes"][0].update(count=99), "does not match the nodes of its instances"),
])
def test_bad_plan_files_exit_2_and_write_nothing(two_model_plan, tmp_path, edit, message):
    scenario, _, data = two_model_plan
    bad = json.loads(json.dumps(data))
    edit(bad)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    for fmt in ("skypilot", "vllm"):
        r = _export(path, scenario, fmt, tmp_path / fmt)
        assert r.exit_code == 2, r.output
        assert message in flat(r)
        assert "Traceback" not in r.output
        assert not (tmp_path / fmt).exists()


def test_missing_and_non_json_plan(tmp_path):
    r = run("export", "--plan", str(tmp_path / "nope.json"), "--format", "vllm", "--out", str(tmp_path / "o"))
    assert r.exit_code == 2 and "no such file" in flat(r)
    (tmp_path / "x.json").write_text("{not json")
    r = run("export", "--plan", str(tmp_path / "x.json"), "--format", "vllm", "--out", str(tmp_path / "o"))
    assert r.exit_code == 2 and "not JSON" in flat(r)
    assert not (tmp_path / "o").exists()


def test_derived_shapes_are_refused_or_flagged(tmp_path):
    scenario, plan = write_plan(tmp_path, DERIVED)
    data = json.loads(plan.read_text())
    assert all(i["derived"] for i in data["instances"])
    r = _export(plan, scenario, "skypilot", tmp_path / "sky")
    assert r.exit_code == 2
    assert "derived shape" in flat(r) and "--allow-derived" in flat(r)
    assert not (tmp_path / "sky").exists()
    r = _export(plan, scenario, "skypilot", tmp_path / "sky", "--allow-derived")
    assert r.exit_code == 0, r.output
    for f in (tmp_path / "sky").glob("[!.]*.yaml"):
        if f.name == "00-control-plane.yaml":  # a CPU node: no shape of the plan's
            continue
        text = f.read_text()
        assert "# WARNING: derived shape(s) 2xL40S" in text
        # a derived shape has no instance type to pin; SkyPilot picks one with these accelerators
        assert "instance_type" not in yaml.safe_load(text)["resources"]


def test_out_folder_with_other_files_is_refused_and_a_re_export_replaces(decode_plan, tmp_path):
    scenario, plan, _ = decode_plan
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    r = _export(plan, scenario, "vllm", mine)
    assert r.exit_code == 2 and "other files" in flat(r)
    assert ["notes.txt"] == [p.name for p in mine.iterdir()]
    out = tmp_path / "out"
    assert _export(plan, scenario, "skypilot", out).exit_code == 0
    assert _export(plan, scenario, "vllm", out).exit_code == 0  # an earlier export is ours to replace
    assert not list(out.glob("*.yaml")) and list(out.glob("*.sh"))


def test_skypilot_refuses_a_line_its_scheduler_ports_cannot_number(two_model_plan, tmp_path):
    scenario, _, data = two_model_plan
    bad = json.loads(json.dumps(data))
    inst = bad["instances"][0]
    extra = 101 - inst["count"]
    inst["count"] = 101  # replicas 0..100: one more than a line's 100 ports
    for c in inst["nodes"]:
        next(n for n in bad["nodes"] if n["region"] == inst["region"] and n["config"] == c)["count"] += extra
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    r = _export(path, scenario, "skypilot", tmp_path / "sky")
    assert r.exit_code == 2, r.output
    assert "instance line 0 has replica 100" in flat(r) and "split the line" in flat(r)
    assert not (tmp_path / "sky").exists()
