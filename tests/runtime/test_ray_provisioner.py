"""The Ray provisioner on a 3-node local Ray cluster (127.0.0.1) with fake GPUs: actors placed by
`accelerator_type`, one placement group per instance, and the lifecycle tests on it (a plan change
under load with a drain, the kill of an engine actor; `make test-long`), with every request sent accounted for."""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from coral.errors import CoralError
from coral.runtime.deploy.cluster_config import parse_cluster
from coral.runtime.deploy.deployment import Deployment

from .conftest import deployment, http, wait_until
from .test_lifecycle import CLUSTER, NEW_C, Load

ray = pytest.importorskip("ray")

from coral.runtime.deploy.ray_provisioner import RayProvisioner, engine_device, ray_capacity  # noqa: E402

# a: one L4 node; b: an L4 stage then an L40S stage; c (started by the plan change): two L40S stages
CONFIGS = {"a": [["1xL4"]], "b": [["1xL4"], ["1xL40S"]], "c": [["1xL40S"], ["1xL40S"]]}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[object]:
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1, "resources": {"accelerator_type:L4": 1}})
    c.add_node(num_cpus=2, num_gpus=1, resources={"accelerator_type:L4": 1})
    try:
        c.add_node(num_cpus=3, num_gpus=6, resources={"accelerator_type:L40S": 1})
        ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def dep(ray_cluster: object) -> Iterator[Deployment]:
    yield from deployment(CLUSTER, timeout_s=180, provisioner=RayProvisioner(CONFIGS))


def _node_of(actor: object) -> str:
    """The Ray node an actor runs on."""
    return str(ray.get(actor.node_id.remote(), timeout=30))  # type: ignore[attr-defined]


def test_capacity_and_placement_by_gpu_type(dep: Deployment) -> None:
    assert {("L4", 1): 2, ("L40S", 6): 1} == dict(ray_capacity())
    prov = dep.provisioner
    assert isinstance(prov, RayProvisioner)
    gpu_node = {n["NodeID"]: next(k.split(":")[1] for k in n["Resources"] if k.startswith("accelerator_type:"))
                for n in ray.nodes() if n["Alive"]}
    assert "L4" == gpu_node[_node_of(prov.actor("a/0/0"))]
    assert "L4" == gpu_node[_node_of(prov.actor("b/0/0"))]
    assert "L40S" == gpu_node[_node_of(prov.actor("b/1/0"))]
    assert {"a", "b"} <= set(prov.groups)  # one placement group per instance
    # three 1xL4 nodes are one more than the cluster has
    too_many = parse_cluster({**CLUSTER, "instances": [{**CLUSTER["instances"][0], "name": n} for n in ("x", "y", "z")]})
    with pytest.raises(CoralError, match=r"needs 3 Ray nodes with 1x L4 .* has 2: 1 short"):
        RayProvisioner({n: [["1xL4"]] for n in ("x", "y", "z")}).check_capacity(too_many.instances)


def _env_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split("=", 1) for kv in f.read().decode().split("\0") if "=" in kv)


def test_engine_device_mapping() -> None:
    assert ("", "cpu") == engine_device([])
    assert ("3", "cuda:0") == engine_device([3])  # Ray's remap: the actor's only GPU is cuda:0
    assert ("4,5", "cuda:1") == engine_device(["4", "5"], rank=1, world=2)
    with pytest.raises(CoralError, match=r"rank 0 of 2 on a Ray actor with 1 GPU"):
        engine_device([2], rank=0, world=2)


def test_each_engine_uses_the_gpu_ray_gave_it(dep: Deployment) -> None:
    prov = dep.provisioner
    assert isinstance(prov, RayProvisioner)
    for name in ("a/0/0", "b/0/0", "b/1/0"):
        (p,) = prov.placement(name)
        assert 1 == len(p["gpu_ids"])  # a 1-GPU node's bundle
        assert p["cuda_visible_devices"] == p["gpu_ids"][0]
        assert "cuda:0" == p["device"]  # after Ray's visibility remap
        assert "cpu" == p["engine_device"]  # the cluster file runs the maths on the CPU here
        # the engine process itself sees only that GPU
        assert p["cuda_visible_devices"] == _env_of(prov.pids(name.split("/")[0])[name])["CUDA_VISIBLE_DEVICES"]
    assert 0 <= int(prov.placement("b/1/0")[0]["gpu_ids"][0]) < 6  # one of the L40S node's six


def test_tensor_parallel_node_gets_its_gpus_as_cuda_0_and_1(dep: Deployment) -> None:
    """A 2xL40S node with tp 2: both ranks in the node's actor, on the two GPUs Ray gave it."""
    from coral.runtime.deploy.cluster_config import InstanceSpec, StageSpec

    prov, coord, cluster = dep.provisioner, dep.coordinator, dep.cluster
    assert isinstance(prov, RayProvisioner) and coord is not None and dep.transport is not None
    t = InstanceSpec(name="tp", model="llama", phase="mixed", region="local", throughput_tok_per_s=1.0,
                     stages=(StageSpec(layer_start=0, layer_end=6, node_throughputs=(1.0,), tp=2, configs=("2xL40S",)),),
                     seed=3, weights_path=None)
    prov.start_instance(t, cluster.model("llama"), cluster, dep.transport.address)
    try:
        assert wait_until(lambda: "tp" in coord.instances, 120), "the TP instance did not register"
        ranks = prov.placement("tp/0/0")
        assert ["cuda:0", "cuda:1"] == [r["device"] for r in ranks]
        assert ranks[0]["gpu_ids"] == ranks[1]["gpu_ids"] and 2 == len(ranks[0]["gpu_ids"])
        # b's L40S stage runs on the same Ray node: Ray gave the two actors different GPUs
        assert not set(ranks[0]["gpu_ids"]) & set(prov.placement("b/1/0")[0]["gpu_ids"])
        assert {"tp/scheduler", "tp/0/0", "tp/0/0/tp1"} == set(prov.pids("tp"))
        assert ",".join(ranks[0]["gpu_ids"]) == _env_of(prov.pids("tp")["tp/0/0/tp1"])["CUDA_VISIBLE_DEVICES"]
    finally:
        prov.stop_instance("tp")
    assert "tp" not in prov.groups and not prov.pids("tp")


def test_tp_groups_of_one_machine_share_a_ray_node_on_their_own_gpus(dep: Deployment) -> None:
    """A plan's 4xL40S as two TP2 groups (one stage, `hosts` [0, 0]): one STRICT_PACK placement group for the
    machine, each group's actor on the same Ray node with two GPUs of its own."""
    from coral.runtime.deploy.cluster_config import InstanceSpec, StageSpec

    prov, coord, cluster = dep.provisioner, dep.coordinator, dep.cluster
    assert isinstance(prov, RayProvisioner) and coord is not None and dep.transport is not None
    g = InstanceSpec(name="grp", model="llama", phase="mixed", region="local", throughput_tok_per_s=1.0,
                     stages=(StageSpec(layer_start=0, layer_end=6, node_throughputs=(1.0, 1.0), configs=("4xL40S/tp2",) * 2,
                                       hosts=(0, 0)),), seed=3, weights_path=None)
    prov.check_capacity([g])  # one 4xL40S machine, not two: the L40S node (6 GPUs) holds it
    prov.start_instance(g, cluster.model("llama"), cluster, dep.transport.address)
    try:
        assert wait_until(lambda: "grp" in coord.instances, 120), "the instance did not register"
        assert 1 == len(prov.groups["grp"])
        (a,), (b,) = prov.placement("grp/0/0"), prov.placement("grp/0/1")
        assert _node_of(prov.actor("grp/0/0")) == _node_of(prov.actor("grp/0/1"))
        assert 2 == len(a["gpu_ids"]) == len(b["gpu_ids"]) and not set(a["gpu_ids"]) & set(b["gpu_ids"])
    finally:
        prov.stop_instance("grp")
    assert "grp" not in prov.groups


# The two lifecycle tests on Ray (the second needs the first's instance c) start three instances between them,
# about 40 s of Ray actors and engine processes here: `make test` runs them on the local provisioner
# (test_lifecycle.py: the same plan change under load with a drain, and a kill -9 of an engine).
ON_LOCAL = "tests/runtime/test_lifecycle.py (the plan change with a drain and the engine kill, local provisioner)"


@pytest.mark.long(reduced=ON_LOCAL)
def test_plan_change_under_load_with_a_drain(dep: Deployment) -> None:
    coord, prov = dep.coordinator, dep.provisioner
    assert coord is not None
    with Load(dep.url, clients=3, max_tokens=24) as load:
        assert wait_until(lambda: load.completed >= 4 and coord.loads().get("a", 0) > 0, 60)
        s, body = http("POST", dep.url + "/admin/plan", {"instances": [CLUSTER["instances"][1], NEW_C]})
        assert 200 == s, body
        assert {("drain", "a"), ("start", "c")} == {(a["kind"], a["instance"]) for a in body["actions"] if a["kind"] != "keep"}
        assert wait_until(lambda: "stopped" == coord.retired.get("a"), 60)
        assert wait_until(lambda: not prov.instance_alive("a"), 20), "drained instance's actors still run"
        assert wait_until(lambda: coord.loads().get("c", 0) > 0 or any(e[1] == "c" and e[2] == "first request" for e in coord.events), 90)
        n = load.completed
        assert wait_until(lambda: load.completed >= n + 4, 60)
    assert coord.load_at_drain["a"] > 0, "the drain began with no request in flight; the test proved nothing"
    assert load.sent == load.completed + len(load.errors)
    assert [] == load.errors
    assert "a" not in prov.groups  # its placement group was released with its last process
    # 8 GPUs: b holds one L4 and one L40S, c two L40S; a's L4 is back
    assert wait_until(lambda: 4 == ray.available_resources().get("GPU", 0), 20), ray.available_resources()


@pytest.mark.long(reduced=ON_LOCAL)
def test_kill_of_an_engine_actor_every_request_accounted(dep: Deployment) -> None:
    coord, prov, ctl = dep.coordinator, dep.provisioner, dep.controller
    assert coord is not None and isinstance(prov, RayProvisioner) and {"b", "c"} <= set(coord.instances)
    with Load(dep.url, clients=3) as load:
        assert wait_until(lambda: load.completed >= 4 and coord.loads().get("c", 0) > 0, 60)
        ray.kill(prov.actor("c/1/0"))  # c's second stage
        assert wait_until(lambda: "c" in coord.retired, 20), "dead engine actor not detected"
        n = load.completed
        assert wait_until(lambda: load.completed >= n + 4, 60), "service stopped serving"
        time.sleep(1.0)  # the controller's sweep releases c's placement group
        ctl.epoch()
        assert wait_until(lambda: "c-2" in coord.instances, 120)
    assert load.sent == load.completed + len(load.errors)
    assert [] == load.errors
    assert "L40S" in {k.split(":")[1] for n in ray.nodes() for k in n["Resources"] if k.startswith("accelerator_type:")}


def test_serve_plan_on_a_short_ray_cluster_exits_2_naming_the_gpu(ray_cluster: object, tmp_path) -> None:
    import json

    import yaml
    from click.testing import CliRunner

    from coral.cli import main

    from .test_serve_plan import PHI, phi_cluster

    scen = tmp_path / "s.yaml"
    scen.write_text(yaml.safe_dump({**PHI, "configs": ["4xL40S", "4xL4"]}))  # 4-GPU nodes only
    plan = tmp_path / "plan.json"
    # disaggregated (two 4-GPU machines): the up-front GPU check names the type; auto plans one colocated 4xL40S,
    # which that check lets through and whose placement group then times out (exit 2 too, without the GPU's name)
    assert 0 == CliRunner().invoke(main, ["plan", "--scenario", str(scen), "--mode", "disagg", "--out", str(plan)]).exit_code
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml.safe_dump(phi_cluster(40)))
    used = {n["config"] for n in json.loads(plan.read_text())["nodes"] if n["count"]}
    assert used & {"4xL4", "4xL40S"}  # 4-GPU nodes: the test cluster's L4 nodes have one GPU each
    r = CliRunner().invoke(main, ["serve", "--config", str(cfg), "--plan", str(plan), "--provisioner", "ray"])
    assert 2 == r.exit_code, r.output
    out = " ".join(r.output.split())
    assert "Ray nodes with 4x L4" in out or "Ray nodes with 4x L40S" in out
    assert "short" in out
