"""Self-repair on real processes (127.0.0.1): a failed instance is replaced at once with no hand action and
no epoch, a data-parallel stage that lost a node shows `degraded` (the node named) and is swapped for a
new instance, and /health reports each model's real state. Load runs through every kill; each request
is completed or refused with a clear error, none is cut."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from coral.runtime.deploy.deployment import Deployment
from coral.runtime.deploy.lifecycle import shape_key

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


class Health:
    """Samples /health every 20 ms: the sequence of states each model went through."""

    def __init__(self, url: str) -> None:
        self.url, self.seen, self.stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            status, body = http("GET", self.url + "/health", timeout_s=5)
            self.seen.append((time.monotonic(), status, body["models"]["llama"]))

    def __enter__(self) -> Health:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def dep() -> Iterator[Deployment]:
    yield from deployment(CLUSTER)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _current(dep: Deployment, original: str) -> str:
    """The running instance of the original one's shape (itself, or the replacement that took its place)."""
    ctl = dep.controller
    want = shape_key(next(i for i in dep.cluster.instances if i.name == original))
    return next(n for n, spec in ctl.running.items() if shape_key(spec) == want and n in dep.coordinator.instances)


def test_health_reports_each_model_and_every_instance_starts_ok(dep: Deployment) -> None:
    status, body = http("GET", dep.url + "/health")
    assert 200 == status and {"status": "ok", "models": {"llama": "ok"}, "instances": {"llama": 2}} == body


def test_every_engine_killed_in_turn_under_load_comes_back_without_a_hand_action(dep: Deployment) -> None:
    """The issue's probe: kill -9 engines of a model's instances, one after the other, under load."""
    coord, ctl, prov = dep.coordinator, dep.controller, dep.provisioner
    assert coord is not None and ctl is not None
    # every engine position of the model: the prefill pipeline's two stages (each the last engine of its
    # stage: the instance fails), the decode stage-0 data-parallel pair (degraded), its last stage (fails)
    positions = [("pre", "0/0"), ("pre", "1/0"), ("dec", "0/1"), ("dec", "1/0")]
    kills: list[float] = []
    with Load(dep.url, clients=3, max_tokens=24) as load, Health(dep.url) as health:
        assert wait_until(lambda: load.completed >= 6, 60)
        for original, node in positions:
            name = _current(dep, original)
            victim = prov.pids(name)[f"{name}/{node}"]
            n = load.completed
            kills.append(time.monotonic())
            os.kill(victim, signal.SIGKILL)
            # the loss shows (the heartbeat timeout is 2 s), then, with no hand action (no epoch, no POST
            # /admin/plan), the model is back to ok and serves again
            assert wait_until(lambda: any(ts > kills[-1] and h != "ok" for ts, _s, h in health.seen), 20), f"{name}/{node}"
            assert wait_until(lambda n=n: load.completed >= n + 3 and health.seen[-1][2] == "ok", 60), f"{name}/{node}: {health.seen[-5:]}"
            assert wait_until(lambda: not ctl.repairs, 30), ctl.repairs
    assert load.sent == load.completed + len(load.errors)
    # the requests hit by a failure were resent (or held for the replacement), so none surfaced to a client
    assert [] == load.errors
    for k, t in enumerate(kills):  # after each kill the model left "ok" and came back; never "starting" again
        after = [h for ts, _s, h in health.seen if ts > t and (k + 1 == len(kills) or ts < kills[k + 1])]
        assert after[-1] == "ok" and set(after) - {"ok", "degraded", "unavailable"} == set(), after
        assert set(after) & {"degraded", "unavailable"}, f"kill {k}: the health check never saw the loss: {after}"
    reasons = sorted(r["reason"] for r in ctl.repaired)
    assert ["degraded", "failed", "failed", "failed"] == reasons
    assert all(r["up"] - r["started"] < 30 for r in ctl.repaired), ctl.repaired
    # the originals are gone, their replacements (fresh names, same shapes) take the traffic
    assert {"pre", "dec"}.isdisjoint(coord.instances) and 2 == len(coord.instances)
    m = samples(http("GET", dep.url + "/metrics")[1])
    assert 3.0 == m[("coral:repairs_total", (("model_name", "llama"), ("reason", "failed")))]
    assert 1.0 == m[("coral:repairs_total", (("model_name", "llama"), ("reason", "degraded")))]
    assert 1.0 == m[("coral:model_health", (("model_name", "llama"), ("status", "ok")))]


def test_a_lost_data_parallel_node_shows_degraded_with_the_node_named(dep: Deployment) -> None:
    coord, ctl, prov = dep.coordinator, dep.controller, dep.provisioner
    assert coord is not None and ctl is not None
    name = _current(dep, "dec")
    seen: list[dict] = []
    metrics: list[str] = []
    with Load(dep.url, clients=2, max_tokens=16) as load:
        assert wait_until(lambda: load.completed >= 3, 60)
        os.kill(prov.pids(name)[f"{name}/0/0"], signal.SIGKILL)

        def degraded() -> bool:
            st = http("GET", dep.url + "/admin/instances")[1]
            rec = next((i for i in st["instances"] if i["id"] == name), None)
            if rec is not None and rec["state"] == "degraded":
                seen.append(rec)
                metrics.append(http("GET", dep.url + "/metrics")[1])
                return True
            return False

        assert wait_until(degraded, 30, poll_s=0.01), "the instance was never shown degraded"
        # it is repaired the same way: a new instance of its shape, then the degraded one drains and stops
        assert wait_until(lambda: coord.retired.get(name) == "stopped", 60), coord.retired.get(name)
    assert ["0/0"] == seen[0]["lost_nodes"]
    assert 1.0 == samples(metrics[0])[("coral:engine_node_lost", (("instance", name), ("model_name", "llama"), ("node", "0/0")))]
    assert [] == load.errors and load.sent == load.completed
    assert "ok" == http("GET", dep.url + "/health")[1]["models"]["llama"]
