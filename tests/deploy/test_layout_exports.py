"""The exports of engine layouts: vLLM's TP / PP / DP sizes (or several servers per machine) from a plan's
stage entries, SkyPilot machines that launch one engine per TP group on its own GPUs, and the control
plane's cluster file carrying each engine's TP, machine and the model's first-token mode."""
from __future__ import annotations

import json
import re
import shlex

import pytest
import yaml

from coral.catalog.models import builtin_model
from coral.runtime.deploy.export import control_cluster, export_skypilot, export_vllm, vllm_command
from coral.runtime.deploy.plan_file import load_plan_file
from coral.runtime.deploy.vllm import VllmServer, vllm_layout

from .layout_plans import DECODE, DP4, PP4, TP2X2, write_layout_plan

PHI = builtin_model("phi-4")


def _plan(tmp_path, instances, **kw):
    return load_plan_file(write_layout_plan(tmp_path, instances, **kw)[1])


@pytest.mark.parametrize(("inst", "want"), [
    (DP4, (VllmServer(host=0, gpus=(0, 1, 2, 3), tp=1, dp=4, hosts=(0,)),)),
    (PP4, (VllmServer(host=0, gpus=(0, 1, 2, 3), tp=1, pp=4, hosts=(0,)),)),
    (TP2X2, (VllmServer(host=0, gpus=(0, 1, 2, 3), tp=2, dp=2, hosts=(0,)),)),
    (DECODE, (VllmServer(host=0, gpus=(0,), tp=1, hosts=(0,)), VllmServer(host=1, gpus=(0,), tp=1, hosts=(1,)))),
    # groups of different degrees on one machine: a server each, on its own GPUs
    ({"phase": "prefill", "nodes": ["4xL40S"], "stages": [(["4xL40S/tp1", "4xL40S/tp1", "4xL40S/tp2"], 40)]},
     (VllmServer(host=0, gpus=(0,), tp=1, hosts=(0,)), VllmServer(host=0, gpus=(1,), tp=1, hosts=(0,)),
      VllmServer(host=0, gpus=(2, 3), tp=2, hosts=(0,)))),
    # eight TP1 stages over two machines: one pipeline, the first machine's four GPUs at its head (Ray)
    ({"phase": "prefill", "nodes": ["4xL40S", "4xL40S"], "stages": [(["4xL40S/tp1"], 5)] * 8},
     (VllmServer(host=0, gpus=(0, 1, 2, 3), tp=1, pp=8, hosts=(0, 1)),)),
])
def test_vllm_sizes_follow_the_layout(tmp_path, inst, want):
    (i,) = _plan(tmp_path, [inst]).instances
    assert want == vllm_layout([s.nodes for s in i.stages], nodes=i.nodes, hosts=i.hosts, spec=PHI)


@pytest.mark.parametrize(("stages", "nodes", "match"), [
    ([["4xL40S/tp2"], ["4xL4/tp2"], ["4xL40S/tp2"]], ["4xL4", "4xL40S"], "not consecutive"),
    ([["4xL40S/tp1", "4xL40S/tp1"], ["4xL40S/tp2"]], ["4xL40S"], "data-parallel entries"),
    ([["4xL40S/tp1"], ["4xL40S/tp2"]], ["4xL40S"], "1 and 2 GPUs each"),
    ([["4xL40S"]], ["4xL40S"], r"refuses --tensor-parallel-size 4: phi-4 has 10 KV heads"),
])
def test_what_vllm_cannot_run_says_why(stages, nodes, match):
    got = vllm_layout(stages, nodes=nodes, spec=PHI)
    assert isinstance(got, str)
    assert re.search(match, got), got


def _serve_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "vllm serve" in ln]


def test_vllm_scripts_carry_the_sizes_and_a_machine_argument_where_several_servers_run(tmp_path):
    pf = _plan(tmp_path, [DP4, PP4, DECODE], first_token="decode")
    dp, pp, dec = pf.instances
    (line,) = _serve_lines(vllm_command(pf, dp, port=8000))
    assert line.startswith("CUDA_VISIBLE_DEVICES=0,1,2,3 ")
    assert "--tensor-parallel-size 1 --pipeline-parallel-size 1 --data-parallel-size 4" in line
    assert "VLLM_PP_LAYER_PARTITION" not in line and "ray" not in line
    (line,) = _serve_lines(vllm_command(pf, pp, port=8000))
    assert "VLLM_PP_LAYER_PARTITION=10,10,10,10" in line and "--pipeline-parallel-size 4" in line
    assert "--distributed-executor-backend" not in line  # the pipeline stays inside the machine
    text = vllm_command(pf, dec, port=8002)
    assert 'MACHINE="${1:?' in text
    cases = [ln.split(")", 1)[0].strip() for ln in text.splitlines() if ln.startswith("  ") and "exec CUDA_VISIBLE_DEVICES=0 " in ln]
    assert ["0", "1"] == cases  # one server per 1xL4 machine, each on its only GPU
    ex = export_vllm(pf)
    assert not ex.skipped and 3 == len([n for n in ex.files if n.endswith(".sh")])


def test_vllm_servers_sharing_a_machine_get_their_own_gpus_and_ports(tmp_path):
    mixed = {"phase": "prefill", "nodes": ["4xL40S"], "stages": [(["4xL40S/tp1", "4xL40S/tp1", "4xL40S/tp2"], 40)]}
    pf = _plan(tmp_path, [mixed, DECODE], first_token="decode")
    text = vllm_command(pf, pf.instances[0], port=8000)
    (case,) = [ln for ln in text.splitlines() if ln.startswith("  0) ")]
    servers = case.removeprefix("  0) ").removesuffix(" & wait ;;").split(" & ")
    got = [(shlex.split(s)[0], s.split("--port ")[1].split()[0], shlex.split(s)[1]) for s in servers]
    assert [("CUDA_VISIBLE_DEVICES=0", "8000", "VLLM_NIXL_SIDE_CHANNEL_PORT=5600"),
            ("CUDA_VISIBLE_DEVICES=1", "8100", "VLLM_NIXL_SIDE_CHANNEL_PORT=5700"),
            ("CUDA_VISIBLE_DEVICES=2,3", "8200", "VLLM_NIXL_SIDE_CHANNEL_PORT=5800")] == got


def _machines(task: dict) -> list[tuple[int, int, list[dict]]]:
    out = []
    for line in task["run"].splitlines():
        if ") REPLICA=" in line:
            rep = int(line.split("REPLICA=", 1)[1].split()[0])
            machine = int(line.split("MACHINE=", 1)[1].split()[0])
            out.append((rep, machine, json.loads(shlex.split(line.split("ENGINES=", 1)[1])[0])))
    return out


def test_skypilot_machines_launch_one_engine_per_tp_group(tmp_path):
    pf = _plan(tmp_path, [DP4, TP2X2, DECODE], count=2)
    ex = export_skypilot(pf)
    dp = yaml.safe_load(ex.files[f"{pf.instances[0].name}-4xL40S.yaml"])
    assert 2 == dp["num_nodes"]  # one 4xL40S per replica, not one per group
    assert [(r, 0, [(0, k, 1, str(k)) for k in range(4)]) for r in (0, 1)] == [
        (r, m, [(e["stage"], e["node"], e["tp"], e["gpus"]) for e in es]) for r, m, es in _machines(dp)]
    tp = yaml.safe_load(ex.files[f"{pf.instances[1].name}-4xL40S.yaml"])
    assert [[(2, "0,1"), (2, "2,3")]] * 2 == [[(e["tp"], e["gpus"]) for e in es] for _, _, es in _machines(tp)]
    assert "runs 2 engines, one per TP group" in ex.files[f"{pf.instances[1].name}-4xL40S.yaml"]
    dec = yaml.safe_load(ex.files[f"{pf.instances[2].name}-1xL4.yaml"])
    assert [(0, 0), (0, 1), (1, 0), (1, 1)] == [(r, m) for r, m, _ in _machines(dec)]


def test_a_whole_node_phi4_cannot_split_4_ways_runs_tp2_and_says_so(tmp_path):
    whole = {"phase": "prefill", "nodes": ["4xL40S"], "stages": [(["4xL40S"], 40)]}
    pf = _plan(tmp_path, [whole])
    text = export_skypilot(pf).files[f"{pf.instances[0].name}-4xL40S.yaml"]
    assert "runs tensor-parallel 2 on Coral's engine" in text and "2 of its GPU(s) idle" in text
    assert [[(2, "0,1,2,3")]] == [[(e["tp"], e["gpus"]) for e in es] for _, _, es in _machines(yaml.safe_load(text))]


def test_the_control_cluster_carries_each_engines_tp_machine_and_the_first_token(tmp_path):
    pf = _plan(tmp_path, [TP2X2, DECODE], first_token="decode")
    c = control_cluster(pf)
    assert [{"name": "phi-4", "first_token": "decode"}] == [{k: m[k] for k in ("name", "first_token")} for m in c["models"]]
    assert [([2, 2], [0, 0]), ([1, 1], [0, 1])] == [(i["stages"][0]["tp"], i["stages"][0]["hosts"]) for i in c["instances"]]
