"""A provisioner on a Ray cluster: every engine node and scheduler is a Ray actor, placed by GPU type.

Each engine node is one bundle asking for its GPUs (a whole node's, or its TP group's of the node:
`4xL40S/tp1` asks for one) and a sliver of its GPU type's `accelerator_type:<GPU>` resource (what Ray
sets on a GPU node, and what Ray Serve LLM places replicas by). A plan's instance gets one placement
group per machine (`STRICT_PACK`: the TP groups `hosts` puts on one machine land on one Ray node);
an instance without machines one placement group (`PACK`); the scheduler's small CPU bundle rides
in the first. An actor
owns one runtime process (`python -m coral.runtime.engine.worker ROLE SPEC`, the same entry point the
local provisioner starts); killing the actor ends its process, which the coordinator sees as a
dead engine. The local provisioner stays the default; this one needs the `ray` extra.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from coral.catalog.hardware import split_config_name
from coral.errors import CoralError
from coral.runtime.deploy.cluster_config import ClusterSpec, InstanceSpec, ServedModel
from coral.runtime.deploy.layout import entry_tp
from coral.runtime.deploy.provisioner import Provisioner, _free_port

__all__ = ["RayProvisioner", "engine_device", "ray_capacity"]

log = logging.getLogger(__name__)

ACCELERATOR_SLIVER = 0.001  # per actor: enough to pin the GPU type, never the binding constraint


def engine_device(gpu_ids: Sequence[int | str], rank: int = 0, world: int = 1) -> tuple[str, str]:
    """The GPU an engine process of a Ray actor uses: `(CUDA_VISIBLE_DEVICES, torch device)`.

    Ray gives a GPU actor the ids in `ray.get_gpu_ids()` and sets `CUDA_VISIBLE_DEVICES` to them, so
    inside the actor its first GPU is `cuda:0` whatever its id on the host; the ranks of a
    tensor-parallel node take `cuda:0 .. cuda:world-1` of the same set.

    Args:
        gpu_ids: what `ray.get_gpu_ids()` returned in the actor (empty: a CPU actor).
        rank: the process's tensor-parallel rank.
        world: the node's tensor-parallel degree.

    Returns:
        ("", "cpu") for a CPU actor, else (the ids joined by commas, f"cuda:{rank}").

    Raises:
        CoralError: more ranks than GPUs.
    """
    if not gpu_ids:
        return "", "cpu"
    if world > len(gpu_ids) or not 0 <= rank < world:
        raise CoralError(f"tensor-parallel rank {rank} of {world} on a Ray actor with {len(gpu_ids)} GPU(s) "
                         f"({list(gpu_ids)}); give the node at least tp GPUs")
    return ",".join(str(i) for i in gpu_ids), f"cuda:{rank}"


class _Process:
    """Ray actor body: the runtime processes of one engine node (its tensor-parallel ranks) or of a scheduler."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.devices: list[dict[str, Any]] = []  # per process: the GPU mapping it was started with

    def start(self, role: str, spec: dict[str, Any]) -> int:
        """Start one process; an engine's shard runs on the GPU Ray gave this actor (:func:`engine_device`)."""
        # lazy: ray (optional: only the Ray provisioner)
        import ray

        spec = {**spec, "parent_pid": os.getpid()}
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if role == "engine":
            tp = spec.get("tp") or {}
            ids = [str(i) for i in ray.get_gpu_ids()]
            visible, device = engine_device(ids, int(tp.get("rank", 0)), int(tp.get("world", 1)))
            if visible:
                env["CUDA_VISIBLE_DEVICES"] = visible
            shard = spec.get("shard")
            if shard is not None and ids and shard.get("device") != "cpu":
                # the cluster asks for a GPU: the one Ray gave, by its ordinal after the remap
                shard = {**shard, "device": device}
                spec = {**spec, "shard": shard, "device_index": int(device[5:])}
            self.devices.append({"gpu_ids": ids, "cuda_visible_devices": visible, "device": device,
                                 "engine_device": (shard or {}).get("device", "noop")})
        proc = subprocess.Popen([sys.executable, "-m", "coral.runtime.engine.worker", role, json.dumps(spec)],
                                stdin=subprocess.DEVNULL, env=env)
        self.procs.append(proc)
        return proc.pid

    def placement(self) -> list[dict[str, Any]]:
        """Per process started: the GPU ids Ray gave, the CUDA_VISIBLE_DEVICES and device it maps them to,
        and the device the engine runs on (cpu where the cluster file says so)."""
        return list(self.devices)

    def node_id(self) -> str:
        """The Ray node this actor runs on."""
        # lazy: ray (optional: only the Ray provisioner)
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def alive(self) -> bool:
        """Every process runs (a tensor-parallel node is lost with any of its ranks)."""
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def stop(self, timeout_s: float) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


def ray_capacity() -> Counter[tuple[str, int]]:
    """(GPU type, GPUs) -> alive Ray nodes of that shape (`accelerator_type:<GPU>` and `GPU` resources)."""
    # lazy: ray (optional: only the Ray provisioner)
    import ray

    out: Counter[tuple[str, int]] = Counter()
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        for key in res:
            if key.startswith("accelerator_type:"):
                out[(key.split(":", 1)[1], int(res.get("GPU", 0)))] += 1
    return out


def _check_tp(inst: InstanceSpec, configs: list[list[str | None]]) -> None:
    """Refuse a stage whose TP degree needs more GPUs than its node has.

    Raises:
        CoralError: naming the instance, the stage and the node.
    """
    for s, (stage, st) in enumerate(zip(configs, inst.stages, strict=True)):
        for c, tp in zip(stage, st.tps, strict=True):
            if c is not None and entry_tp(c) < tp:
                raise CoralError(f"instance {inst.name} stage {s}: tp {tp} needs {tp} GPUs per node, its "
                                 f"node {c} has {entry_tp(c)}")


class RayProvisioner(Provisioner):
    """Instances as Ray actors, one placement group per instance.

    Args:
        node_configs: instance name -> per stage, the node configuration of each node (e.g.
            `[["4xL4"], ["4xL40S", "4xL40S"]]`, from `coral.runtime.deploy.mapping.plan_node_configs`).
            A replacement `name-2` uses the entry of `name`.
        default_config: the configuration of nodes of instances not in `node_configs` (None: no GPU
            asked for, CPU-only actors).
        address: the Ray cluster to join (None: the one this process already joined, or a new local one).
        cpus_per_engine: CPUs each engine actor reserves.
        placement_timeout_s: how long a placement group may wait for free nodes.
    """

    def __init__(self, node_configs: Mapping[str, Sequence[Sequence[str]]] | None = None, *,
                 default_config: str | None = None, address: str | None = None, cpus_per_engine: float = 0.5,
                 placement_timeout_s: float = 60.0, log_level: str = "WARNING") -> None:
        # lazy: ray (optional: only the Ray provisioner)
        import ray

        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        self.node_configs = dict(node_configs or {})
        self.default_config = default_config
        self.cpus_per_engine = cpus_per_engine
        self.placement_timeout_s = placement_timeout_s
        self.log_level = log_level
        self.actors: dict[str, Any] = {}  # process name -> actor handle
        self.pids_: dict[str, int] = {}
        self.groups: dict[str, list[Any]] = {}  # instance -> its placement groups (one per machine, or one)
        self.retired: set[str] = set()

    # -- shapes and capacity ------------------------------------------------------------------
    def configs_of(self, inst: InstanceSpec) -> list[list[str | None]]:
        """Per stage, per node: its configuration (or None), checked against the instance's shape."""
        name = inst.name
        while name not in self.node_configs and "-" in name and name.rsplit("-", 1)[1].isdigit():
            name = name.rsplit("-", 1)[0]
        shape = [len(st.node_throughputs) for st in inst.stages]
        if all(st.configs for st in inst.stages):  # placed by a plan: the spec carries its nodes' shapes
            return [list(st.configs) for st in inst.stages]
        if name in self.node_configs:
            got = [list(s) for s in self.node_configs[name]]
            if [len(s) for s in got] != shape:
                raise CoralError(f"instance {inst.name}: node_configs has {[len(s) for s in got]} nodes per stage, "
                                 f"the instance {shape}")
            return [list(s) for s in got]
        return [[self.default_config] * n for n in shape]

    @staticmethod
    def machines_of(inst: InstanceSpec) -> list[list[tuple[int, int]]] | None:
        """The (stage, node index) of each engine, per machine of a placed instance whose engines name their
        machine (`StageSpec.hosts`: a plan's TP groups of one node share it); None for one without."""
        if not all(st.hosts for st in inst.stages):
            return None
        out: dict[int, list[tuple[int, int]]] = {}
        for s, st in enumerate(inst.stages):
            for k, h in enumerate(st.hosts):
                out.setdefault(h, []).append((s, k))
        return [out[h] for h in sorted(out)]

    def check_capacity(self, instances: Sequence[InstanceSpec]) -> None:
        """Refuse a set of instances that needs more GPU nodes of a type than the Ray cluster has (a
        machine of a placed instance counts once, however many of its TP groups it runs).

        Raises:
            CoralError: naming the GPU type, the nodes needed and the shortfall.
        """
        need: Counter[tuple[str, int]] = Counter()
        for inst in instances:
            configs = self.configs_of(inst)
            machines = self.machines_of(inst)
            groups = machines if machines is not None else [[(s, k)] for s, st in enumerate(configs) for k in range(len(st))]
            for machine in groups:
                c = configs[machine[0][0]][machine[0][1]]
                if c is not None:
                    count, gpu = split_config_name(c)
                    need[(gpu, count)] += 1
        have = ray_capacity()
        for (gpu, count), n in sorted(need.items()):
            fits = sum(k for (g, c), k in have.items() if g == gpu and c >= count)
            if fits < n:
                raise CoralError(f"the plan needs {n} Ray nodes with {count}x {gpu} (accelerator_type:{gpu}), the Ray "
                                 f"cluster has {fits}: {n - fits} short; add {gpu} nodes or re-plan with fewer")

    # -- Provisioner ------------------------------------------------------------------------------
    def start_instance(self, inst: InstanceSpec, model: ServedModel, cluster: ClusterSpec, coordinator: str) -> None:  # noqa: D102
        # lazy: ray (optional: only the Ray provisioner)
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        configs = self.configs_of(inst)
        _check_tp(inst, configs)
        self.retired.discard(inst.name)
        keys = [(s, k) for s, st in enumerate(inst.stages) for k in range(len(st.node_throughputs))]
        bundle = self._bundles(inst, configs)
        where = self._place(inst, keys, bundle)
        actor_cls = ray.remote(_Process)
        host = cluster.host
        common = {"curve_keys_dir": cluster.curve_keys_dir, "heartbeat_s": cluster.heartbeat_s,
                  "heartbeat_timeout_s": cluster.heartbeat_timeout_s, "max_message_bytes": cluster.max_message_bytes,
                  "log_level": self.log_level}
        port = _free_port(host)
        nodes = [{"stage": s, "node_index": k, "layer_start": st.layer_start, "layer_end": st.layer_end,
                  "throughput_tok_per_s": w}
                 for s, st in enumerate(inst.stages) for k, w in enumerate(st.node_throughputs)]

        def spawn(name: str, role: str, spec: dict[str, Any], at: tuple[Any, int], b: dict[str, float]) -> None:
            pg, index = at
            opts: dict[str, Any] = {"num_cpus": b["CPU"], "num_gpus": b.get("GPU", 0),
                                    "resources": {k: v for k, v in b.items() if k.startswith("accelerator_type:")},
                                    "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
                                    "name": f"coral/{name}", "max_restarts": 0}
            actor: Any = actor_cls.options(**opts).remote()  # type: ignore[attr-defined]
            self.actors[name] = actor
            self.pids_[name] = ray.get(actor.start.remote(role, spec), timeout=60)

        spawn(f"{inst.name}/scheduler", "scheduler", {
            "instance_id": inst.name, "model": inst.model, "phase": inst.phase, "region": inst.region,
            "throughput_tok_per_s": inst.throughput_tok_per_s, "nodes": nodes, "coordinator": coordinator,
            "host": host, "port": port, "chunk_tokens": inst.chunk_tokens, **common}, where["scheduler"], {"CPU": 0.05})
        tps = [tp for st in inst.stages for tp in st.tps]
        for n, tp in zip(nodes, tps, strict=True):
            key = (int(n["stage"]), int(n["node_index"]))
            spec: dict[str, Any] = {
                "instance_id": inst.name, "stage": n["stage"], "node_index": n["node_index"],
                "scheduler": f"tcp://{host}:{port}", "host": host, "threads": cluster.torch_threads,
                "kv_cache_gib": cluster.kv_cache_gib, **common,
                "shard": {"config": model.config, "layer_start": n["layer_start"], "layer_end": n["layer_end"],
                          "seed": inst.seed, "weights_path": inst.weights_path, "device": cluster.device,
                          "dtype": cluster.dtype}}
            name = f"{inst.name}/{n['stage']}/{n['node_index']}"
            if tp == 1:
                spawn(name, "engine", spec, where[key], bundle[key])
                continue
            # a tensor-parallel node: its ranks run in the node's one actor, over the GPUs Ray gave it
            rendezvous = f"tcp://{host}:{_free_port(host)}"
            spawn(name, "engine", {**spec, "tp": {"rank": 0, "world": tp, "init_method": rendezvous}}, where[key], bundle[key])
            for rank in range(1, tp):
                self.pids_[f"{name}/tp{rank}"] = ray.get(self.actors[name].start.remote(
                    "engine", {**spec, "tp": {"rank": rank, "world": tp, "init_method": rendezvous}}), timeout=60)

    def _bundles(self, inst: InstanceSpec, configs: list[list[str | None]]) -> dict[tuple[int, int], dict[str, float]]:
        """Each engine node's Ray resources: CPUs, and its GPUs (the whole node's, or its TP group's)."""
        bundle: dict[tuple[int, int], dict[str, float]] = {}
        for s, st in enumerate(inst.stages):
            for k in range(len(st.node_throughputs)):
                b: dict[str, float] = {"CPU": self.cpus_per_engine}
                c = configs[s][k]
                if c is not None:
                    b.update({"GPU": float(entry_tp(c)), f"accelerator_type:{split_config_name(c)[1]}": ACCELERATOR_SLIVER})
                bundle[(s, k)] = b
        return bundle

    def _place(self, inst: InstanceSpec, keys: list[tuple[int, int]],
               bundle: dict[tuple[int, int], dict[str, float]]) -> dict[tuple[int, int] | str, tuple[Any, int]]:
        """Reserve the instance's placement groups: one per machine of a placed instance (STRICT_PACK:
        its TP groups on one Ray node), else one for the whole instance (PACK); the scheduler's small
        CPU bundle rides in the first. Returns each process's (group, bundle index).

        Raises:
            CoralError: a group not placed within `placement_timeout_s` (the groups made so far are removed).
        """
        # lazy: ray (optional: only the Ray provisioner)
        import ray
        from ray.util.placement_group import placement_group

        machines = self.machines_of(inst)
        groups = machines if machines is not None else [keys]
        strategy = "STRICT_PACK" if machines is not None else "PACK"
        where: dict[tuple[int, int] | str, tuple[Any, int]] = {}
        pgs = []
        for g, members in enumerate(groups):
            bundles = ([{"CPU": 0.05}] if g == 0 else []) + [bundle[m] for m in members]
            pg = placement_group(bundles, strategy=strategy, name=f"coral-{inst.name}-{g}")
            pgs.append(pg)
            try:
                ray.get(pg.ready(), timeout=self.placement_timeout_s)
            except Exception:
                for p in pgs:
                    ray.util.remove_placement_group(p)
                raise CoralError(f"instance {inst.name}: its placement group ({len(members)} engine node(s)"
                                 f"{f' of machine {g}' if machines is not None else ''}) was not placed within "
                                 f"{self.placement_timeout_s:.0f} s; the Ray cluster lacks nodes") from None
            if g == 0:
                where["scheduler"] = (pg, 0)
            for i, m in enumerate(members):
                where[m] = (pg, i + (1 if g == 0 else 0))
        self.groups[inst.name] = pgs
        return where

    @staticmethod
    def _instance_of(proc_name: str) -> str:
        return proc_name.split("/", 1)[0]

    def pids(self, name: str) -> dict[str, int]:
        """Process name -> pid of instance `name`'s processes (as `LocalProvisioner.pids`)."""
        return {n: p for n, p in self.pids_.items() if self._instance_of(n) == name}

    def actor(self, proc_name: str) -> Any:
        """The Ray actor running process `proc_name` (e.g. `b/1/0`), for tests that kill one."""
        return self.actors[proc_name]

    def placement(self, proc_name: str) -> list[dict[str, Any]]:
        """The GPU mapping of engine node `proc_name`'s processes (its TP ranks): see `_Process.placement`."""
        # lazy: ray (optional: only the Ray provisioner)
        import ray

        return list(ray.get(self.actors[proc_name].placement.remote(), timeout=30))

    def _alive(self, names: list[str]) -> dict[str, bool]:
        # lazy: ray (optional: only the Ray provisioner)
        import ray

        refs = {}
        out = {}
        for n in names:
            try:
                refs[n] = self.actors[n].alive.remote()
            except Exception:
                out[n] = False
        for n, ref in refs.items():
            try:
                out[n] = bool(ray.get(ref, timeout=10))
            except Exception:  # the actor died (killed, its node lost)
                out[n] = False
        return out

    def dead(self) -> list[str]:  # noqa: D102
        names = [n for n in self.actors if self._instance_of(n) not in self.retired]
        return [n for n, ok in self._alive(names).items() if not ok]

    def instance_alive(self, name: str) -> bool:
        """Whether any process of instance `name` still runs; when none does (drained, or failed), its
        actors and placement group are released at once, so its GPUs return to the Ray cluster
        without waiting for the controller's next sweep."""
        mine = [n for n in self.actors if self._instance_of(n) == name]
        alive = any(self._alive(mine).values())
        if mine and not alive:
            self.stop_instance(name, timeout_s=0.1)
        return alive

    def stop_instance(self, name: str, timeout_s: float = 5.0) -> None:  # noqa: D102
        # lazy: ray (optional: only the Ray provisioner)
        import ray

        self.retired.add(name)
        mine = [n for n in self.actors if self._instance_of(n) == name]
        refs = []
        for n in mine:
            try:
                refs.append(self.actors[n].stop.remote(timeout_s))
            except Exception:
                pass
        deadline = time.monotonic() + timeout_s + 5
        for r in refs:
            try:
                ray.get(r, timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                pass
        for n in mine:
            try:
                ray.kill(self.actors[n])
            except Exception:
                pass
            del self.actors[n]
        for n in [n for n in self.pids_ if self._instance_of(n) == name]:
            del self.pids_[n]
        for pg in self.groups.pop(name, []):
            ray.util.remove_placement_group(pg)

    def stop_all(self, timeout_s: float = 10.0) -> None:  # noqa: D102
        for name in sorted({self._instance_of(n) for n in self.actors} | set(self.groups)):
            self.stop_instance(name, timeout_s=min(timeout_s, 5.0))
