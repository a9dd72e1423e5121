"""A spot preemption notice under load (issue 30), on real processes (127.0.0.1). Make before break: `POST
/admin/preempt` starts a replacement of the node's instance at once, and the instance keeps serving until the
replacement does (its routed count grows after the notice, and no request is held for the replacement), then
drains; or, where the replacement is not up by the loss deadline less the margin, it drains then, and only then are
the model's requests held for the replacement. The node then goes (its engines are killed, as the cloud would).
Every request sent is completed or cleanly refused: none is cut.

The replacement's start is delayed (`SlowStart.init_s`, a cloud node's boot and weight load) so that the notice's
window is wide enough to see, whatever the load of the host."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from coral.runtime.deploy.cluster_config import ClusterSpec, InstanceSpec, ServedModel
from coral.runtime.deploy.deployment import Deployment
from coral.runtime.deploy.provisioner import LocalProvisioner
from coral.runtime.serving.coordinator import Coordinator

from .conftest import deployment, http, wait_until
from .test_lifecycle import Load

CLUSTER = {
    "coordinator": {"port": 0, "heartbeat_s": 0.1, "heartbeat_timeout_s": 2.0, "max_retries": 3},
    "device": "cpu",
    "models": [{"name": "llama", "builtin": "tiny-llama", "weights": {"seed": 3}}],
    "instances": [
        {"name": "pre", "model": "llama", "phase": "prefill", "stages": [{"layers": [0, 3]}, {"layers": [3, 6]}]},
        {"name": "dec", "model": "llama", "phase": "decode", "stages": [{"layers": [0, 3], "nodes": 2}, {"layers": [3, 6]}]},
    ],
}  # fmt: skip

INIT_S = 3.0  # the replacement's start is delayed this long (AWS: minutes); its processes then start as usual


class SlowStart(LocalProvisioner):
    """The local provisioner, with every start delayed by `init_s` (0: at once): a cloud node's boot and weight
    load. An instance whose start is pending counts as alive; stopping it cancels the start."""

    def __init__(self) -> None:
        super().__init__()
        self.init_s = 0.0
        self.pending: dict[str, threading.Timer] = {}
        self._plock = threading.Lock()

    def start_instance(self, inst: InstanceSpec, model: ServedModel, cluster: ClusterSpec, coordinator: str) -> None:
        if self.init_s <= 0:
            super().start_instance(inst, model, cluster, coordinator)
            return

        def go() -> None:
            with self._plock:
                if inst.name not in self.pending:  # stopped meanwhile
                    return
            super(SlowStart, self).start_instance(inst, model, cluster, coordinator)
            with self._plock:
                self.pending.pop(inst.name, None)

        t = threading.Timer(self.init_s, go)
        t.daemon = True
        with self._plock:
            self.pending[inst.name] = t
        t.start()

    def instance_alive(self, name: str) -> bool:
        with self._plock:
            if name in self.pending:
                return True
        return super().instance_alive(name)

    def stop_instance(self, name: str, timeout_s: float = 5.0) -> None:
        with self._plock:
            t = self.pending.pop(name, None)
        if t is not None:
            t.cancel()
        super().stop_instance(name, timeout_s)

    def stop_all(self, timeout_s: float = 10.0) -> None:
        with self._plock:
            timers, self.pending = list(self.pending.values()), {}
        for t in timers:
            t.cancel()
        super().stop_all(timeout_s)


def routed(coord: Coordinator, name: str) -> int | None:
    """Request attempts the coordinator has routed to instance `name` (None: not registered)."""
    return next((i["routed"] for i in coord.snapshot() if i["id"] == name), None)


def state(coord: Coordinator, name: str) -> str:
    return next((i["state"] for i in coord.snapshot() if i["id"] == name), "gone")


def kill(pids: dict[str, int]) -> None:
    """The node goes: every process of the instance is killed."""
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def dep() -> Iterator[Deployment]:
    prov = SlowStart()
    for d in deployment(CLUSTER, provisioner=prov):
        prov.init_s = INIT_S  # the first plan started at once; what starts from now on boots first
        yield d


def _notice(dep: Deployment, node: str, deadline_s: float) -> dict[str, Any]:
    status, body = http("POST", dep.url + "/admin/preempt", {"node": node, "deadline_s": deadline_s})
    assert 200 == status, body
    return body


def test_the_noticed_instance_serves_until_its_replacement_does_then_drains_under_load(dep: Deployment) -> None:
    coord, ctl, prov = dep.coordinator, dep.controller, dep.provisioner
    assert coord is not None and ctl is not None and isinstance(prov, SlowStart)
    with Load(dep.url, clients=3, max_tokens=24) as load:  # "dec": the model's only decode instance
        assert wait_until(lambda: load.completed >= 4, 60)
        pids, held = prov.pids("dec"), coord.held_requests
        body = _notice(dep, "dec/0/0", deadline_s=60.0)
        at_notice = routed(coord, "dec")
        new = body["replacement"]
        assert ("dec", new, True) == (body["noticed"], body["replacement"], 0 < body["drain_by_s"] <= 50)
        # the replacement takes its place in the plan at once, but it still serves: it is not draining
        assert "dec" not in ctl.running and new in ctl.running and "dec" in ctl.noticed
        assert "active" == state(coord, "dec")
        seen = [at_notice]
        assert wait_until(lambda: seen.append(routed(coord, "dec")) or new in coord.instances, 60), f"{new} never registered"
        # it took new requests while the replacement booted, and no request waited for the replacement
        assert at_notice is not None and max(r for r in seen if r is not None) > at_notice, seen
        assert held == coord.held_requests
        # once the replacement serves, it drains
        assert wait_until(lambda: "dec" not in ctl.noticed and state(coord, "dec") in ("draining", "gone"), 30)
        kill(pids)  # its node goes now (what it still holds is resent)
        n = load.completed
        assert wait_until(lambda n=n: load.completed >= n + 4, 60), "the model stopped serving after the notice"
        assert wait_until(lambda: not ctl.repairs, 30), ctl.repairs
    assert load.sent == load.completed + len(load.errors)
    assert [] == load.errors  # nothing cut, nothing refused: served, drained, finished or resent
    assert "dec" in coord.retired
    assert [("preempted", "dec", new)] == [(r["reason"], r["replaced"], r["by"]) for r in ctl.repaired]
    assert "ok" == http("GET", dep.url + "/health")[1]["models"]["llama"]


def test_the_noticed_instance_drains_at_the_deadline_when_its_replacement_is_late(dep: Deployment) -> None:
    coord, ctl, prov = dep.coordinator, dep.controller, dep.provisioner
    assert coord is not None and ctl is not None and isinstance(prov, SlowStart)
    ctl.notice_margin_s, prov.init_s = 1.0, 8.0  # the node goes 3 s after the notice; the replacement boots 8 s
    original = next(n for n, s in ctl.running.items() if s.phase == "prefill")  # the model's only prefill instance
    try:
        with Load(dep.url, clients=3, max_tokens=24) as load:
            assert wait_until(lambda: load.completed >= 4, 60)
            pids, held = prov.pids(original), coord.held_requests
            body = _notice(dep, f"{original}/0/0", deadline_s=3.0)
            new = body["replacement"]
            assert (original, True) == (body["noticed"], 0 < body["drain_by_s"] <= 2)
            # it drains at the deadline less the margin, its replacement not up yet
            assert wait_until(lambda: original not in ctl.noticed, 30)
            assert new not in coord.instances and new in prov.pending
            kill(pids)  # the node goes
            # with no instance of the phase left, the model's new requests are held for the replacement
            assert wait_until(lambda: coord.held_requests > held, 30)
            assert wait_until(lambda: new in coord.instances, 60), f"{new} never registered"
            n = load.completed
            assert wait_until(lambda n=n: load.completed >= n + 4, 60), "the model stopped serving after the notice"
    finally:
        ctl.notice_margin_s, prov.init_s = 10.0, INIT_S
    assert load.sent == load.completed + len(load.errors)
    assert [] == load.errors  # held, not refused, and nothing cut
    assert original in coord.retired


def test_a_notice_for_an_unknown_node_or_a_bad_deadline_is_refused_and_changes_nothing(dep: Deployment) -> None:
    ctl = dep.controller
    assert ctl is not None
    before = dict(ctl.running)
    status, body = http("POST", dep.url + "/admin/preempt", {"node": "nope/0/0"})
    assert 404 == status and "no running instance 'nope' to drain; running: " in body["error"]["message"]
    status, body = http("POST", dep.url + "/admin/preempt", {"instance": "dec"})
    assert (400, "instance") == (status, body["error"]["param"])
    assert "unknown field 'instance'" in body["error"]["message"]
    status, body = http("POST", dep.url + "/admin/preempt", {"deadline_s": 60})
    assert (400, "node") == (status, body["error"]["param"])
    for bad in (0, -5, "120", True):
        status, body = http("POST", dep.url + "/admin/preempt", {"node": next(iter(before)), "deadline_s": bad})
        assert (400, "deadline_s") == (status, body["error"]["param"]), bad
        assert "deadline_s must be a positive number of seconds" in body["error"]["message"]
    assert before == ctl.running and {} == ctl.noticed
