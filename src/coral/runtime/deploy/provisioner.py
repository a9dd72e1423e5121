"""Starting a cluster's processes: the provisioner interface, the local one, and a running deployment.

A :class:`Provisioner` turns an instance spec into running processes (one scheduler plus
one engine per node) that register with the coordinator by themselves. The built-in
:class:`LocalProvisioner` starts them as child processes on this machine; a cloud
provisioner would start the same worker command on rented nodes.

:class:`coral.runtime.deploy.deployment.Deployment` (what ``coral serve`` runs) starts instances
through a provisioner; it lives apart so that the lifecycle controller can import this module
without a cycle.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from typing import Any

from coral.errors import CoralError
from coral.runtime.deploy.cluster_config import ClusterSpec, InstanceSpec, ServedModel
from coral.runtime.deploy.layout import entry_tp, node_gpus

__all__ = ["LocalProvisioner", "Provisioner"]

log = logging.getLogger(__name__)


class Provisioner(ABC):
    """Starts and stops the processes of serving instances."""

    #: Whether it starts an instance's engine nodes itself (self-repair needs that); the remote mode
    #: of :class:`LocalProvisioner` starts only schedulers, the engines dial in from elsewhere.
    can_start_engines: bool = True

    @abstractmethod
    def start_instance(self, inst: InstanceSpec, model: ServedModel, cluster: ClusterSpec, coordinator: str) -> None:
        """Start an instance's scheduler and engine nodes; they register with ``coordinator``.

        Args:
            inst: the instance and its placement.
            model: its model (config and weights).
            cluster: cluster-wide settings (device, dtype, threads, host).
            coordinator: the coordinator's ZeroMQ address.
        """

    @abstractmethod
    def dead(self) -> list[str]:
        """Names of processes that have exited, except those of instances stopped on purpose."""

    @abstractmethod
    def instance_alive(self, name: str) -> bool:
        """Whether any process of instance ``name`` still runs."""

    @abstractmethod
    def stop_instance(self, name: str, timeout_s: float = 5.0) -> None:
        """Stop what is left of an instance (after a drain, or the rest of a failed one)."""

    @abstractmethod
    def stop_all(self, timeout_s: float = 10.0) -> None:
        """Stop every process started, within ``timeout_s`` (then kill)."""


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_port(host: str) -> int:
    """A free port for a child to bind later, chosen below the kernel's ephemeral range.

    A port taken with `bind(0)` and released is back in the ephemeral pool at once, so any
    process binding port 0 in between (our own engines and coordinator do) can take it before
    the child binds: the port is picked at random under that range instead, where nothing is
    handed out automatically, and never twice by this process.
    """
    low = max(1025, _ephemeral_low() - 12000)
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(low, low + 12000)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise CoralError(f"no free port found on {host} between {low} and {low + 12000}")


class LocalProvisioner(Provisioner):
    """Every process is a child of this one (``python -m coral.runtime.engine.worker``)."""

    def __init__(self, noop_engines: bool = False, log_level: str = "WARNING", *, start_engines: bool = True) -> None:
        """Args:
        noop_engines: start engines that do no maths (to measure the runtime's overhead).
        log_level: children's logging level.
        start_engines: False: start only each instance's scheduler (on its `scheduler_port`); its
            engine nodes are started elsewhere and dial in (`coral serve --provisioner remote`).
        """
        self.noop = noop_engines
        self.start_engines = self.can_start_engines = start_engines
        self.log_level = log_level
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.engines: dict[str, int] = {}  # name -> pid (children of the zygote)
        self.zygote: subprocess.Popen[bytes] | None = None
        self.retired: set[str] = set()  # instances stopped on purpose (their exits are expected)
        self._next_device = 0  # GPUs handed out on this host (engine k gets cuda:k, modulo the GPUs)

    @staticmethod
    def _instance_of(proc_name: str) -> str:
        return proc_name.split("/", 1)[0]

    def pids(self, name: str) -> dict[str, int]:
        """Process name -> pid of every process of instance ``name`` (for tests and benches)."""
        out = {n: p.pid for n, p in self.procs.items() if self._instance_of(n) == name}
        out.update({n: pid for n, pid in self.engines.items() if self._instance_of(n) == name})
        return out

    def all_pids(self) -> dict[str, int]:
        """Process name -> pid of every process started (zygote included)."""
        out = {n: p.pid for n, p in self.procs.items()}
        out.update(self.engines)
        return out

    def _spawn(self, name: str, role: str, spec: dict[str, Any]) -> None:
        spec = {**spec, "parent_pid": os.getpid(), "log_level": self.log_level}
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "coral.runtime.engine.worker", role, json.dumps(spec)],
            stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip

    def _spawn_engine(self, name: str, spec: dict[str, Any], model_types: list[str]) -> None:
        if self.zygote is None:
            zspec = {"parent_pid": os.getpid(), "log_level": self.log_level, "model_types": model_types}
            self.zygote = subprocess.Popen(
                [sys.executable, "-m", "coral.runtime.engine.worker", "zygote", json.dumps(zspec)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
            self.procs["zygote"] = self.zygote
        assert self.zygote.stdin is not None and self.zygote.stdout is not None
        try:
            self.zygote.stdin.write(json.dumps({**spec, "log_level": self.log_level}).encode() + b"\n")
            self.zygote.stdin.flush()
            answer = self.zygote.stdout.readline()
        except BrokenPipeError:
            answer = b""
        if not answer.strip().isdigit():
            raise CoralError(f"the engine launcher (zygote) died while starting {name}")
        self.engines[name] = int(answer)

    def _machines(self, inst: InstanceSpec) -> dict[tuple[int, int], int] | None:
        """(stage, node index) -> first device of each engine of a placed instance whose engines name their
        machine (`StageSpec.hosts`): every machine takes a block of its node's GPUs on this host, and the
        engines on it their own GPUs of the block, in order (a 4xL40S of four TP1 groups: four engines on
        four devices of one block). None for an instance without machines (one block per engine)."""
        if not all(st.hosts and st.configs for st in inst.stages):
            return None
        size: dict[int, int] = {}
        for st in inst.stages:
            for h, c in zip(st.hosts, st.configs, strict=True):
                size.setdefault(h, node_gpus(c))
        base = {}
        for h in sorted(size):
            base[h] = self._next_device
            self._next_device += size[h]
        used = dict.fromkeys(size, 0)
        out = {}
        for s, st in enumerate(inst.stages):
            for k, (h, c) in enumerate(zip(st.hosts, st.configs, strict=True)):
                out[(s, k)] = base[h] + used[h]
                used[h] += entry_tp(c)
        return out

    def start_instance(self, inst: InstanceSpec, model: ServedModel, cluster: ClusterSpec, coordinator: str) -> None:  # noqa: D102
        host = cluster.host
        self.retired.discard(inst.name)
        common = {
            "curve_keys_dir": cluster.curve_keys_dir, "heartbeat_s": cluster.heartbeat_s,
            "heartbeat_timeout_s": cluster.heartbeat_timeout_s, "max_message_bytes": cluster.max_message_bytes,
            "kv_cache_gib": cluster.kv_cache_gib,
        }  # fmt: skip
        sched_addr_port = inst.scheduler_port or _free_port(host)
        scheduler = f"tcp://{host}:{sched_addr_port}"
        nodes = []
        placement: list[tuple[int, str, int]] = []  # per node: TP degree, device, first device index
        machines = self._machines(inst)
        for s, st in enumerate(inst.stages):
            for k, w in enumerate(st.node_throughputs):
                nodes.append({"stage": s, "node_index": k, "layer_start": st.layer_start, "layer_end": st.layer_end, "throughput_tok_per_s": w})
                tp = st.tps[k]
                if st.devices:
                    d = st.devices[k]
                    placement.append((tp, "cpu" if d == "cpu" else "cuda", 0 if d == "cpu" else int(d[5:])))
                elif machines is not None:  # its own GPUs of its machine's block
                    placement.append((tp, cluster.device, machines[(s, k)]))
                else:  # one device per engine process, in order on this host
                    placement.append((tp, cluster.device, self._next_device))
                    self._next_device += tp
        self._spawn(f"{inst.name}/scheduler", "scheduler", {
            "instance_id": inst.name, "model": inst.model, "phase": inst.phase, "region": inst.region,
            "throughput_tok_per_s": inst.throughput_tok_per_s, "nodes": nodes, "coordinator": coordinator,
            "host": host, "port": sched_addr_port, "chunk_tokens": inst.chunk_tokens, **common,
        })  # fmt: skip
        if not self.start_engines:
            return
        for n, (tp, device, index) in zip(nodes, placement, strict=True):
            spec: dict[str, Any] = {
                "instance_id": inst.name, "stage": n["stage"], "node_index": n["node_index"], "scheduler": scheduler,
                "host": host, "threads": cluster.torch_threads, "device_index": index, **common,
            }  # fmt: skip
            if self.noop:
                spec["noop"] = {"layer_start": n["layer_start"], "layer_end": n["layer_end"], "num_layers": model.num_layers}
            else:
                spec["shard"] = {
                    "config": model.config, "layer_start": n["layer_start"], "layer_end": n["layer_end"],
                    "seed": inst.seed, "weights_path": inst.weights_path, "device": device, "dtype": cluster.dtype,
                }  # fmt: skip
            name = f"{inst.name}/{n['stage']}/{n['node_index']}"
            types = sorted({m.config["model_type"] for m in cluster.models})
            if tp == 1 or self.noop:
                self._spawn_engine(name, spec, types)
                continue
            rendezvous = f"tcp://{host}:{_free_port(host)}"
            for rank in range(tp):  # rank 0 is the node the scheduler talks to; the others follow it
                self._spawn_engine(name if rank == 0 else f"{name}/tp{rank}", {**spec, "tp": {"rank": rank, "world": tp, "init_method": rendezvous}}, types)

    @staticmethod
    def _pid_alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        # a zombie (exited, not yet reaped by the zygote) counts as dead
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return True

    def _exited(self) -> list[str]:
        out = [n for n, p in self.procs.items() if p.poll() is not None]
        out += [n for n, pid in self.engines.items() if not self._pid_alive(pid)]
        return out

    def dead(self) -> list[str]:  # noqa: D102
        return [n for n in self._exited() if self._instance_of(n) not in self.retired]

    def instance_alive(self, name: str) -> bool:  # noqa: D102
        if any(p.poll() is None for n, p in self.procs.items() if self._instance_of(n) == name):
            return True
        return any(self._pid_alive(pid) for n, pid in self.engines.items() if self._instance_of(n) == name)

    def stop_instance(self, name: str, timeout_s: float = 5.0) -> None:  # noqa: D102
        self.retired.add(name)
        mine = [n for n in self.procs if self._instance_of(n) == name]
        for n in mine:
            if self.procs[n].poll() is None:
                self.procs[n].terminate()
        engines = [n for n in self.engines if self._instance_of(n) == name]
        for n in engines:
            try:
                os.kill(self.engines[n], signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        for n in mine:
            try:
                self.procs[n].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.procs[n].kill()
                self.procs[n].wait(timeout=5)
            del self.procs[n]
        for n in engines:
            while self._pid_alive(self.engines[n]) and time.monotonic() < deadline:
                time.sleep(0.02)
            if self._pid_alive(self.engines[n]):
                try:
                    os.kill(self.engines[n], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            del self.engines[n]

    def stop_all(self, timeout_s: float = 10.0) -> None:  # noqa: D102
        if self.zygote is not None and self.zygote.stdin is not None:
            try:
                self.zygote.stdin.close()  # end of input: the zygote stops its engines and exits
            except BrokenPipeError:
                pass
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        if self.zygote is not None and self.zygote.stdout is not None:
            self.zygote.stdout.close()
        self.procs.clear()
        self.engines.clear()
        self.zygote = None
