"""The optional host model at run time: engine nodes that share a machine's cores (processor sharing)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coral.sim.cluster import BACKGROUND, FINISH, TAKEN, Batch, Host, Node
from coral.sim.hosts import Hosts

PushFn = Callable[[float, int, Any, Any], None]


class CpuShare:
    """The hosts of a run (`Hosts`), their busy nodes and the front end's pseudo-node: each
    busy node runs at its host's rate, re-planning its finish event when the rate changes.
    Events go on the simulator's queue through `push`."""

    def __init__(self, hosts: Hosts | None, push: PushFn) -> None:
        self.hosts = hosts
        self.push = push
        self.by_name: dict[str, Host] = {}
        self.fe: Node | None = None  # the front end's pseudo-node (Hosts.frontend_work)

    def host(self, name: str, now: float) -> Host:
        """The host named `name`, created on first use with its background steps."""
        assert self.hosts is not None
        h = self.by_name.get(name)
        if h is None:
            h = self.by_name[name] = Host(name, float(self.hosts.cores[name]), 0.0)
            for at, threads in self.hosts.background_steps(name):
                if at <= now:  # nothing runs on the new host yet: set, no event
                    h.background = threads
                else:
                    self.push(at, BACKGROUND, h, threads)
            for at, cores in self.hosts.taken_steps(name):
                if at <= now:
                    h.taken = cores
                else:
                    self.push(at, TAKEN, h, cores)
        return h

    def frontend_work(self, t: float, work: float) -> None:
        """Give the front end `work` > 0 CPU seconds (host model with `frontend_work` only): a
        pseudo-node on the front-end host, busy while it has work, sharing the cores."""
        assert self.hosts is not None
        fe = self.fe
        if fe is None:
            fe = self.fe = Node(None, None)  # type: ignore[arg-type]
            fe.host = self.host(self.hosts.frontend_host, t)
        h = fe.host
        assert h is not None
        if fe.busy:
            fe.rem = max(0.0, fe.rem - h.rate * (t - fe.since)) + work
            fe.since = t
            fe.version += 1
            self.push(t + fe.rem / h.rate, FINISH, fe, fe.version)
            return
        fe.busy = True
        fe.rem = work
        fe.since = t
        h.busy[fe] = None
        self.rerate(t, h, fe)

    def rerate(self, t: float, host: Host, new: Node | None = None) -> None:
        """The host's busy count changed: every busy node's speed is min(1, (cores - taken) / (busy + background)).

        Nodes already running are advanced to `t` at the old speed and, if the speed changed,
        get a new finish event (the old one becomes stale through the version); `new` (just
        started, its work in `rem`) always gets one.
        """
        n = len(host.busy)
        rate = min(1.0, (host.cores - host.taken) / (n + host.background)) if n else 1.0
        old = host.rate
        if rate != old:
            host.rate = rate
            for x in host.busy:
                if x is new:
                    continue
                x.rem = max(0.0, x.rem - old * (t - x.since))
                x.since = t
                x.version += 1
                self.push(t + x.rem / rate, FINISH, x, x.version)
        if new is not None:
            new.version += 1
            self.push(t + new.rem / rate, FINISH, new, new.version)

    def finished(self, node: Node, version: int, t: float) -> Batch | None:
        """A node's finish event at `t`: the micro-batch it finished, or None (a stale event, or
        the front end running out of work)."""
        if version != node.version or not node.busy:
            return None  # planned at a speed that has since changed
        host = node.host
        if node is self.fe:  # the front end ran out of work
            assert host is not None
            node.busy = False
            node.rem = 0.0
            del host.busy[node]
            self.rerate(t, host)
            return None
        assert host is not None and node.lane is not None
        lane = node.lane
        node.lane = None
        node.rem = 0.0
        del host.busy[node]
        self.rerate(t, host)
        return lane

