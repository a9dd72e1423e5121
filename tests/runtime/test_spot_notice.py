"""A spot preemption notice under load (issue 30), on real processes (127.0.0.1): `POST /admin/preempt`
drains the node's instance at once and starts a replacement of its shape; then the node goes (its
engines are killed, as the cloud would at the notice's end). Every request sent is completed or
cleanly refused: none is cut."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest

from coral.runtime.deploy.deployment import Deployment

from .conftest import deployment, http, wait_until
from .test_lifecycle import Load

CLUSTER = {
    "coordinator": {"port": 0, "heartbeat_s": 0.1, "heartbeat_timeout_s": 1.0, "max_retries": 3},
    "device": "cpu",
    "models": [{"name": "llama", "builtin": "tiny-llama", "weights": {"seed": 3}}],
    "instances": [
        {"name": "pre", "model": "llama", "phase": "prefill", "stages": [{"layers": [0, 3]}, {"layers": [3, 6]}]},
        {"name": "dec", "model": "llama", "phase": "decode", "stages": [{"layers": [0, 3], "nodes": 2}, {"layers": [3, 6]}]},
    ],
}  # fmt: skip

NOTICE_S = 2.0  # the notice's lead time here (AWS gives 120 s); the node goes after it


@pytest.fixture(scope="module")
def dep() -> Iterator[Deployment]:
    yield from deployment(CLUSTER)


def test_a_notice_drains_the_instance_and_a_replacement_takes_its_place_under_load(dep: Deployment) -> None:
    coord, ctl, prov = dep.coordinator, dep.controller, dep.provisioner
    assert coord is not None and ctl is not None
    for original in ("dec", "pre"):  # a decode instance (data-parallel stage), then a prefill pipeline
        with Load(dep.url, clients=3, max_tokens=24) as load:
            assert wait_until(lambda: load.completed >= 4, 60)
            pids = prov.pids(original)
            status, body = http("POST", dep.url + "/admin/preempt", {"node": f"{original}/0/0"})
            assert 200 == status, body
            assert original == body["draining"]
            new = body["replacement"]
            t_notice = time.monotonic()
            # from the notice on, no new request goes to it; the replacement of the same shape comes up
            assert original not in ctl.running and new in ctl.running
            state = next((i["state"] for i in coord.snapshot() if i["id"] == original), "gone")
            assert state in ("draining", "gone"), state
            assert wait_until(lambda new=new: new in coord.instances, 60), f"{new} never registered"
            time.sleep(max(0.0, NOTICE_S - (time.monotonic() - t_notice)))
            for pid in pids.values():  # the node goes at the end of the notice
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            n = load.completed
            assert wait_until(lambda n=n: load.completed >= n + 4, 60), "the model stopped serving after the notice"
            assert wait_until(lambda: not ctl.repairs, 30), ctl.repairs
        assert load.sent == load.completed + len(load.errors)
        assert [] == load.errors  # nothing cut, nothing refused: drained, finished or resent
        assert original in coord.retired
    assert [("preempted", "dec"), ("preempted", "pre")] == [(r["reason"], r["replaced"]) for r in ctl.repaired]
    assert "ok" == http("GET", dep.url + "/health")[1]["models"]["llama"]


def test_a_notice_for_an_unknown_node_is_refused_and_changes_nothing(dep: Deployment) -> None:
    ctl = dep.controller
    assert ctl is not None
    before = dict(ctl.running)
    status, body = http("POST", dep.url + "/admin/preempt", {"node": "nope/0/0"})
    assert 404 == status and "no running instance 'nope' to drain; running: " in body["error"]["message"]
    status, body = http("POST", dep.url + "/admin/preempt", {"instance": "dec"})
    assert 400 == status and "node" == body["error"]["param"]
    assert before == ctl.running
