"""A plan's colocated instance (issue 27) read back and exported: a `vllm serve` with chunked prefill and no KV
connector, a SkyPilot engine task, and a control plane that serves it as a `mixed` instance with its chunk."""
from __future__ import annotations

import json
import shlex

import pytest
import yaml

from coral.errors import CoralError
from coral.perf.model import Phase
from coral.runtime.deploy.cluster_config import MIXED, parse_cluster, parse_instances
from coral.runtime.deploy.export import control_cluster, export_skypilot, export_vllm, vllm_command
from coral.runtime.deploy.mapping import cluster_from_plan
from coral.runtime.deploy.plan_file import load_plan_file
from coral.runtime.engine.model import BUILTIN_CONFIGS

from .conftest import run
from .layout_plans import COLOCATED, COLOCATED_TP2X2, DECODE, PP4, write_layout_plan
from .test_skypilot_accepts import check_with_skypilot


def _plan(tmp_path, instances, **kw):
    return load_plan_file(write_layout_plan(tmp_path, instances, **kw)[1])


def test_a_colocated_instance_reads_back_with_its_chunk_decode_rate_and_batch(tmp_path):
    (inst,) = _plan(tmp_path, [COLOCATED_TP2X2]).instances
    assert (Phase.COLOCATED, True, 512, 900.0, 4) == (inst.phase, inst.colocated, inst.chunk_tokens,
                                                      inst.decode_tok_per_s, inst.micro_batch)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("chunk_tokens", 0, "field 'chunk_tokens' must be an integer >= 1, got 0"),
    ("decode_tok_per_s", -1.0, "field 'decode_tok_per_s' must be a number > 0"),
    ("phase", "both", "field 'phase' is 'both'; valid: prefill, decode, colocated"),
])
def test_a_bad_colocated_field_in_a_plan_file_is_named(tmp_path, field, value, match):
    s, p = write_layout_plan(tmp_path, [COLOCATED])
    data = json.loads(p.read_text())
    data["instances"][0][field] = value
    p.write_text(json.dumps(data))
    with pytest.raises(CoralError, match=match):
        load_plan_file(p)


def _serve_args(text: str) -> list[str]:
    (line,) = [ln for ln in text.splitlines() if "vllm serve" in ln]
    return shlex.split(line)


def test_vllm_runs_a_colocated_instance_with_chunked_prefill_and_no_kv_connector(tmp_path):
    # the plan's models emit their first token at prefill (the default): no matter for a colocated-only model
    pf = _plan(tmp_path, [COLOCATED_TP2X2])
    (inst,) = pf.instances
    text = vllm_command(pf, inst, port=8000)
    args = _serve_args(text)
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" == args[0]  # no NIXL side channel either
    serve = args[1:]
    flag = {a: serve[k + 1] for k, a in enumerate(serve[:-1]) if a.startswith("--")}
    assert ("2", "1", "2") == (flag["--tensor-parallel-size"], flag["--pipeline-parallel-size"], flag["--data-parallel-size"])
    assert "--enable-chunked-prefill" in serve and str(512 + 4) == flag["--max-num-batched-tokens"]  # chunk + decode batch
    assert "--kv-transfer-config" not in serve and "NIXL" not in text
    assert "colocated: runs each request's prefill and decode" in text
    ex = export_vllm(pf)
    assert not ex.skipped and [f"{inst.name}.sh"] == [n for n in ex.files if n.endswith(".sh")]
    assert "chunked prefill of at most 512 prompt tokens per step beside a decode batch of 4" in ex.files[f"{inst.name}.sh"]


def test_a_disaggregated_model_beside_a_colocated_one_still_needs_first_token_decode(tmp_path):
    pf = _plan(tmp_path, [COLOCATED, PP4, DECODE])
    with pytest.raises(CoralError, match="phi-4 emits its first token from prefill"):
        export_vllm(pf)
    pf = _plan(tmp_path, [COLOCATED, PP4, DECODE], first_token="decode")
    colo, pre, _ = pf.instances
    assert "--kv-transfer-config" in _serve_args(vllm_command(pf, pre))
    assert "--kv-transfer-config" not in _serve_args(vllm_command(pf, colo))


def test_skypilot_exports_an_engine_task_and_the_control_plane_serves_it_mixed(tmp_path):
    pf = _plan(tmp_path, [COLOCATED_TP2X2], count=2)
    (inst,) = pf.instances
    ex = export_skypilot(pf)
    text = ex.files[f"{inst.name}-4xL40S.yaml"]
    assert "# colocated: prefill and decode in one instance" in text
    task = yaml.safe_load(text)
    assert 2 == task["num_nodes"]  # one 4xL40S per replica
    control = control_cluster(pf)
    assert [("mixed", 512), ("mixed", 512)] == [(i["phase"], i["chunk_tokens"]) for i in control["instances"]]
    # the runtime takes the control plane's instances as they are: mixed, with the plan's chunk
    cluster = parse_cluster({"models": [{"name": "phi-4", "hf_config": {**BUILTIN_CONFIGS["tiny-llama"], "num_hidden_layers": 40}}],
                             "instances": [{"name": "x", "model": "phi-4", "stages": [{"layers": [0, 40]}]}]})
    specs = parse_instances({"instances": control["instances"]}, cluster)
    assert [(MIXED, 512)] * 2 == [(s.phase, s.chunk_tokens) for s in specs]


def test_skypilot_accepts_the_colocated_tasks(tmp_path, data_dir):
    scenario, plan = write_layout_plan(tmp_path, [COLOCATED, COLOCATED_TP2X2])
    check_with_skypilot(plan, json.loads(plan.read_text()), tmp_path, data_dir, "--scenario", str(scenario))



def test_a_plan_forced_colocated_reads_back_exports_and_maps_to_mixed_instances(tmp_path):
    """`coral plan --mode colocated`'s own file, not a hand-made one: the contract between planner and runtime."""
    scenario, _ = write_layout_plan(tmp_path, [COLOCATED])  # the scenario file (phi-4 on L40S / L4)
    plan = tmp_path / "colo.json"
    r = run("plan", "--scenario", str(scenario), "--mode", "colocated", "--out", str(plan))
    assert r.exit_code == 0, r.output
    pf = load_plan_file(plan)
    assert pf.instances and all(i.colocated and i.chunk_tokens >= 1 and i.micro_batch >= 1 for i in pf.instances)
    ex = export_vllm(pf)  # no first_token decode needed
    for inst in pf.instances:
        if inst.name in dict(ex.skipped):
            continue
        args = _serve_args(ex.files[f"{inst.name}.sh"])
        assert str(inst.chunk_tokens + inst.micro_batch) == args[args.index("--max-num-batched-tokens") + 1]
    cluster = parse_cluster({"models": [{"name": "phi-4", "hf_config": {**BUILTIN_CONFIGS["tiny-llama"], "num_hidden_layers": 40}}],
                             "instances": [{"name": "x", "model": "phi-4", "stages": [{"layers": [0, 40]}]}]})
    specs = cluster_from_plan(cluster, pf).instances
    assert sum(i.count for i in pf.instances) == len(specs)
    assert all(s.phase == MIXED and s.chunk_tokens == next(i.chunk_tokens for i in pf.instances if s.name.startswith(i.name))
               for s in specs)
