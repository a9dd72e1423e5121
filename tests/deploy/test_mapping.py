"""The Plan -> cluster mapping: stages and layer ranges from the template, per-node routing weights
that add up to each stage's planned throughput, and refusals for a cluster file of other models."""
from __future__ import annotations

import json

import pytest

from coral.catalog.models import builtin_model
from coral.errors import CoralError
from coral.runtime.deploy.mapping import node_weights, plan_instance_specs
from coral.runtime.deploy.plan_file import load_plan_file, parse_plan
from coral.scenario import load_scenario


def _hetero_dp(data: dict) -> dict:
    """The plan with one more instance line: phi-4 prefill on one stage of 1xL4 + 1xL40S (data parallel)."""
    d = json.loads(json.dumps(data))
    d["instances"].append({"model": "phi-4", "phase": "prefill", "region": "aws:us-east-2", "nodes": ["1xL4", "1xL40S"],
                           "count": 2, "throughput_tok_per_s": 900.0, "price_usd_per_h": 2.6,
                           "stages": [{"nodes": ["1xL4", "1xL40S"], "layers": 40, "node_index": [0, 1],
                                       "throughput_tok_per_s": 900.0}]})
    for c in ("1xL4", "1xL40S"):
        row = next((n for n in d["nodes"] if n["region"] == "aws:us-east-2" and n["config"] == c), None)
        if row is None:
            d["nodes"].append({"region": "aws:us-east-2", "config": c, "count": 2, "available": 64})
        else:
            row["count"] += 2
    return d


def test_weights_add_up_to_the_stage_and_favour_the_faster_node(two_model_plan):
    scenario, _, data = two_model_plan
    plan = parse_plan(_hetero_dp(data), load_scenario(str(scenario)))
    for inst in plan.instances:
        for st, w in zip(inst.stages, node_weights(plan, inst), strict=True):
            assert len(st.nodes) == len(w)
            assert sum(w) == pytest.approx(st.throughput_tok_per_s)
            if len(set(st.nodes)) == 1:
                assert max(w) == pytest.approx(min(w))
    (l4, l40s), = node_weights(plan, plan.instances[-1])
    assert l40s > l4  # an L40S runs the same layers faster than an L4, so it takes more of the stage's work


class _Model:
    """A cluster file's served model, as the mapping reads it: the built-in architecture of that name."""

    def __init__(self, name, layers):
        self.name, self.num_layers, self.seed, self.weights_path = name, layers, 0, None
        self.spec, self.config = builtin_model(name), {}


def test_instance_specs_expand_counts_and_keep_layer_ranges(two_model_plan):
    scenario, path, data = two_model_plan
    plan = load_plan_file(path, str(scenario))
    specs = plan_instance_specs(plan, {"phi-4": _Model("phi-4", 40), "qwen3-32b": _Model("qwen3-32b", 64)})
    assert sum(i["count"] for i in data["instances"]) == len(specs)
    assert len({s.name for s in specs}) == len(specs)
    for spec in specs:
        raw = data["instances"][int(spec.name.split("-", 1)[0])]
        assert [(s.layer_end - s.layer_start) for s in spec.stages] == [s["layers"] for s in raw["stages"]]
        assert [len(s.node_throughputs) for s in spec.stages] == [len(s["nodes"]) for s in raw["stages"]]
        # a colocated instance runs as the runtime's mixed one, with its template's chunk
        want = ("mixed", raw["chunk_tokens"]) if raw["phase"] == "colocated" else (raw["phase"], None)
        assert want == (spec.phase, spec.chunk_tokens) and spec.region == raw["region"]


def test_a_cluster_file_of_other_models_is_refused(two_model_plan):
    scenario, path, _ = two_model_plan
    plan = load_plan_file(path, str(scenario))
    with pytest.raises(CoralError, match="does not list"):
        plan_instance_specs(plan, {"phi-4": _Model("phi-4", 40)})
    with pytest.raises(CoralError, match="40 layers in the plan but 6"):
        plan_instance_specs(plan, {"phi-4": _Model("phi-4", 6), "qwen3-32b": _Model("qwen3-32b", 64)})
