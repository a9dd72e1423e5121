"""Plans whose stages name TP groups of a node (`4xL40S/tp1`): read back with each entry's machine and GPUs
(`Template.hosts()`), mapped to one engine per entry, and refused where the layout does not fit."""
from __future__ import annotations

import json

import pytest

from coral.catalog.models import builtin_model
from coral.errors import CoralError
from coral.runtime.deploy.mapping import plan_instance_specs
from coral.runtime.deploy.plan_file import load_plan_file

from .layout_plans import DECODE, DP4, PP4, TP2X2, plan_json, write_layout_plan


class _Served:
    """A cluster file's served model as the mapping reads it."""

    def __init__(self, spec, config=None):
        self.name, self.num_layers, self.seed, self.weights_path = "phi-4", 40, 0, None
        self.spec, self.config = spec, config or {}


def _engines(inst):
    return [(e.stage, e.index, e.host, e.tp, e.gpus) for e in inst.engines()]


def test_each_entry_is_an_engine_on_its_own_gpus_of_the_node_hosts_names(tmp_path):
    _, p = write_layout_plan(tmp_path, [DP4, PP4, TP2X2, DECODE])
    dp, pp, tp, dec = load_plan_file(p).instances
    assert ((0, 0, 0, 0),) == dp.hosts
    assert [(0, k, 0, 1, (k,)) for k in range(4)] == _engines(dp)  # four TP1 replicas, one GPU each
    assert [(s, 0, 0, 1, (s,)) for s in range(4)] == _engines(pp)  # a pipeline inside the node
    assert [(0, 0, 0, 2, (0, 1)), (0, 1, 0, 2, (2, 3))] == _engines(tp)
    assert [(0, 0, 0, 1, (0,)), (0, 1, 1, 1, (0,))] == _engines(dec)  # two whole 1xL4 nodes


def test_eight_groups_over_two_nodes_fill_the_first_node_first(tmp_path):
    inst = {"phase": "prefill", "nodes": ["4xL40S", "4xL40S"], "stages": [(["4xL40S/tp1"] * 2, 10)] * 4}
    _, p = write_layout_plan(tmp_path, [inst])
    (i,) = load_plan_file(p).instances
    assert ((0, 0), (0, 0), (1, 1), (1, 1)) == i.hosts
    assert [(2, 0, 1, 1, (0,)), (2, 1, 1, 1, (1,))] == _engines(i)[4:6]


@pytest.mark.parametrize(("inst", "match"), [
    # phi-4 has 10 KV heads: vLLM refuses TP 4 (the rule of ModelSpec.check_tp)
    ({"phase": "prefill", "nodes": ["4xL40S"], "stages": [(["4xL40S/tp4"], 40)]}, r"10 KV heads.*valid TP degrees on 4 GPUs: 1, 2"),
    ({"phase": "prefill", "nodes": ["4xL40S"], "stages": [(["4xL40S/tp3"], 40)]}, "TP 3 does not divide"),
    # a fifth TP1 group has no GPU left on the one node: the rule puts it on a second node the instance lacks
    ({"phase": "prefill", "nodes": ["4xL40S"], "stages": [(["4xL40S/tp1"] * 5, 40)]}, "runs on node 1; the instance has 1"),
    ({"phase": "prefill", "nodes": ["4xL40S", "4xL40S"], "stages": [(["4xL40S/tp1"] * 4, 40)]}, "node 1 .4xL40S. runs no stage entry"),
    ({"phase": "prefill", "nodes": ["4xL40S"], "stages": [(["1xL4"], 40)]}, "1xL4, which is not one of the nodes"),
    ({"phase": "prefill", "nodes": ["4xL40S"], "stages": [(["4xL40S/tp1"] * 4, 40)], "hosts": [[0, 0, 0, 1]]},
     r"field 'hosts' \[\[0, 0, 0, 1\]\] is not Template.hosts\(\)"),
])
def test_a_layout_that_does_not_fit_is_refused_in_one_line(tmp_path, inst, match):
    _, p = write_layout_plan(tmp_path, [inst])
    with pytest.raises(CoralError, match=match) as e:
        load_plan_file(p)
    assert "\n" not in str(e.value) and "instances[0]" in str(e.value)


def test_first_token_is_read_per_model_and_defaults_to_prefill(tmp_path):
    _, p = write_layout_plan(tmp_path, [DP4, DECODE])
    assert "prefill" == load_plan_file(p).first_token_of("phi-4")
    _, p = write_layout_plan(tmp_path, [DP4, DECODE], first_token="decode")
    assert "decode" == load_plan_file(p).first_token_of("phi-4")
    data = json.loads(p.read_text())
    data["models"][0]["first_token"] = "client"
    p.write_text(json.dumps(data))
    with pytest.raises(CoralError, match=r"'first_token' is 'client'; valid: prefill, decode"):
        load_plan_file(p)


def test_the_mapping_runs_each_entry_at_its_tp_on_its_machine(tmp_path):
    _, p = write_layout_plan(tmp_path, [DP4, PP4, TP2X2, DECODE])
    dp, pp, tp, dec = plan_instance_specs(load_plan_file(p), {"phi-4": _Served(builtin_model("phi-4"))})
    (st,) = dp.stages
    assert ((1, 1, 1, 1), (0, 0, 0, 0), ("4xL40S/tp1",) * 4) == (st.tps, st.hosts, st.configs)
    assert [(s.layer_start, s.layer_end, s.tps, s.hosts) for s in pp.stages] == [(10 * k, 10 * k + 10, (1,), (0,)) for k in range(4)]
    assert ((2, 2), (0, 0)) == (tp.stages[0].tps, tp.stages[0].hosts)
    assert ((1, 1), (0, 1)) == (dec.stages[0].tps, dec.stages[0].hosts)


def test_a_whole_node_runs_the_largest_tp_the_served_model_splits(tmp_path, caplog):
    whole = {"phase": "prefill", "nodes": ["4xL40S"], "stages": [(["4xL40S"], 40)]}
    _, p = write_layout_plan(tmp_path, [whole, TP2X2])
    plan = load_plan_file(p)
    # phi-4 (10 KV heads) splits 2 ways, not 4: a whole 4xL40S of an older plan runs TP 2, 2 GPUs idle
    whole_spec, tp2 = plan_instance_specs(plan, {"phi-4": _Served(builtin_model("phi-4"))})
    assert (2,) == whole_spec.stages[0].tps and "2 GPU(s) idle" in caplog.text
    # a stand-in whose 3 KV heads split no way runs every entry at TP 1
    odd = _Served(None, {"num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 96})
    assert (1, 1) == plan_instance_specs(plan, {"phi-4": odd})[1].stages[0].tps


def test_plan_json_hosts_field_is_accepted_when_it_is_the_rule(tmp_path):
    data = plan_json([{**PP4, "hosts": [[0], [0], [0], [0]]}])
    assert [[0]] * 4 == data["instances"][0]["hosts"]
    _, p = write_layout_plan(tmp_path, [{**PP4, "hosts": [[0], [0], [0], [0]]}])
    assert ((0,),) * 4 == load_plan_file(p).instances[0].hosts
