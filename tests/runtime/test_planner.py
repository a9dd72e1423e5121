"""The allocator as the runtime's live planner, on the example cluster's shapes."""
import dataclasses
from pathlib import Path

from coral.runtime.deploy.cluster_config import load_cluster
from coral.runtime.deploy.planner import AllocatorPlanner

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cluster-tiny.yaml"


def _shapes():
    cluster = load_cluster(EXAMPLE)
    by_name = {s.name: s for s in cluster.instances}
    return cluster, by_name


def test_demand_sizes_the_plan():
    cluster, by = _shapes()
    planner = AllocatorPlanner(shapes=cluster.instances, target_utilization=1.0)
    running = tuple(cluster.instances)
    # No traffic: one instance of each prefill / decode shape (the floor); mixed ones are kept.
    plan = planner({}, running)
    assert sorted(s.name for s in plan) == ["llama-decode", "llama-prefill", "qwen3-mixed"]
    # 450 prompt tok/s on 200 tok/s prefill instances -> 3; 250 output tok/s on 100 -> 3.
    plan = planner({"tiny-llama": {"prefill": 450.0, "decode": 250.0}}, running)
    names = [s.name for s in plan]
    assert names.count("llama-prefill") == 3 and names.count("llama-decode") == 3
    assert names.count("qwen3-mixed") == 1


def test_cheaper_shape_wins_and_availability_caps():
    cluster, by = _shapes()
    # A second prefill shape on one node that serves 150 tok/s: 150 per node beats 100 per node
    # (the 2-node shape's 200), so the planner uses it.
    one = dataclasses.replace(by["llama-prefill"], name="llama-prefill-1",
                              stages=(dataclasses.replace(by["llama-prefill"].stages[0], layer_end=6),),
                              throughput_tok_per_s=150.0)
    shapes = [*cluster.instances, one]
    plan = AllocatorPlanner(shapes=shapes, target_utilization=1.0)({"tiny-llama": {"prefill": 300.0}}, tuple(shapes))
    assert [s.name for s in plan if s.phase == "prefill"] == ["llama-prefill-1", "llama-prefill-1"]
    # With too few nodes the plan shrinks to what fits (goodput mode), it never grows past them.
    small = AllocatorPlanner(shapes=shapes, target_utilization=1.0, max_nodes=6)
    plan = small({"tiny-llama": {"prefill": 3000.0, "decode": 100.0}}, tuple(shapes))
    nodes = sum(len(st.node_throughputs) for s in plan if s.phase != "mixed" for st in s.stages)
    assert nodes <= 6


def test_cluster_file_selects_the_allocator(tmp_path):
    import yaml

    data = yaml.safe_load(EXAMPLE.read_text())
    data["coordinator"].update(planner="allocator", epoch_s=30, max_nodes=8)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    cluster = load_cluster(path)
    assert (cluster.planner, cluster.epoch_s, cluster.max_nodes) == ("allocator", 30, 8)
    data["coordinator"]["planner"] = "oracle"
    path.write_text(yaml.safe_dump(data))
    import pytest

    from coral.errors import CoralError

    with pytest.raises(CoralError, match="planner"):
        load_cluster(path)
