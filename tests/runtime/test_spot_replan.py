"""A spot instance's preemption notice under a spot-aware planner (issue 30), on real processes (127.0.0.1), under
load from the official `openai` client: the planner is told which spot instance was lost and re-plans without its
pools; what it starts replaces the lost instance (here an on-demand copy in another region, as a re-plan with the
region's spot pool down would), `POST /admin/preempt` reports it, the noticed instance serves until that one does
(make before break: no request waits for it), and every request sent is completed or cleanly refused (a retryable
503 / 429): no hang, no 500, nothing cut. An on-demand instance's notice still starts a copy of its shape, without
asking the planner."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest

from coral.runtime.deploy.cluster_config import InstanceSpec
from coral.runtime.deploy.deployment import Deployment
from coral.runtime.deploy.lifecycle import SpotAware

from .conftest import ClientThreads, deployment, http, wait_until
from .test_spot_notice import SlowStart, kill, routed, state

openai = pytest.importorskip("openai")

CLUSTER = {
    "coordinator": {"port": 0, "heartbeat_s": 0.1, "heartbeat_timeout_s": 2.0, "max_retries": 3},
    "device": "cpu",
    "models": [{"name": "llama", "builtin": "tiny-llama", "weights": {"seed": 3}}],
    "instances": [
        {"name": "pre", "model": "llama", "phase": "prefill", "region": "r1", "stages": [{"layers": [0, 3]}, {"layers": [3, 6]}]},
        {"name": "dec", "model": "llama", "phase": "decode", "region": "r1", "spot": True, "stages": [{"layers": [0, 6]}]},
    ],
}  # fmt: skip

MAX_TOKENS = 16
INIT_S = 3.0  # the replacement's boot (AWS: minutes)


@dataclass
class OffSpot:
    """A spot-aware planner standing in for the live allocator: after a notice, the running plan plus the lost
    instance on-demand in region r2 (what `allocate(..., spot_down={(r1, ...)})` falls back to); between
    notices it keeps the running plan."""

    lost: list[str] = field(default_factory=list)

    def after_notice(self, lost: InstanceSpec, running: tuple[InstanceSpec, ...]) -> Sequence[InstanceSpec]:
        self.lost.append(lost.name)
        return [*running, dataclasses.replace(lost, name="dec-od", region="r2", spot=False)]

    def __call__(self, seen: object, running: tuple[InstanceSpec, ...]) -> list[InstanceSpec]:
        return list(running)


@dataclass
class Streams(ClientThreads):
    """Closed-loop `openai` clients streaming completions until stopped; every request is counted once: completed
    (all its tokens), refused (a retryable status the client may resend), or an error."""

    url: str
    clients: int = 4
    refused: int = 0

    def _one(self, client: openai.OpenAI, prompt: list[int]) -> str:
        try:
            stream = client.completions.create(model="llama", prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                               extra_body={"ignore_eos": True})
            tokens = sum(len(chunk.choices[0].text) > 0 or chunk.choices[0].finish_reason is None
                         for chunk in stream if chunk.choices)
            return "completed" if tokens >= MAX_TOKENS else f"cut after {tokens} chunks"
        except openai.APIStatusError as e:
            return "refused" if e.status_code in (429, 503) else f"HTTP {e.status_code}: {e.message}"
        except openai.APIError as e:  # a dropped connection, a timeout: not clean
            return f"{type(e).__name__}: {e}"

    def _client(self, k: int) -> None:
        client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=30)
        i = 0
        while not self.stop.is_set():
            i += 1
            with self.lock:
                self.sent += 1
            outcome = self._one(client, [3 + (k * 31 + i) % 200, 7, 9])
            with self.lock:
                if outcome == "completed":
                    self.completed += 1
                elif outcome == "refused":
                    self.refused += 1
                else:
                    self.errors.append(outcome)
        client.close()


@pytest.fixture(scope="module")
def planner() -> OffSpot:
    return OffSpot()


@pytest.fixture(scope="module")
def dep(planner: OffSpot) -> Iterator[Deployment]:
    prov = SlowStart()
    for d in deployment(CLUSTER, planner=planner, provisioner=prov):
        prov.init_s = INIT_S  # the first plan started at once; what starts from now on boots first
        yield d


def test_a_spot_notice_replans_off_the_lost_pool_under_load_and_loses_nothing(dep: Deployment, planner: OffSpot) -> None:
    coord, ctl, prov = dep.coordinator, dep.controller, dep.provisioner
    assert coord is not None and ctl is not None and isinstance(planner, SpotAware)
    with Streams(dep.url) as load:
        assert wait_until(lambda: load.completed >= 4, 60)
        pids, held = prov.pids("dec"), coord.held_requests
        status, body = http("POST", dep.url + "/admin/preempt", {"node": "dec/0/0"})  # AWS's 120 s: the default
        assert 200 == status, body
        at_notice = routed(coord, "dec")
        assert ["dec"] == planner.lost  # the planner was told which spot instance went
        # the re-plan's on-demand instance in r2 replaces it, and the answer says so
        assert {"noticed": "dec", "replacement": "dec-od", "replanned": True, "drained": []} == {
            k: body[k] for k in ("noticed", "replacement", "replanned", "drained")}
        assert 100 < body["drain_by_s"] <= 110  # it drains 10 s before the node goes, at the latest
        assert [("dec-od", "r2", False)] == [(s["instance"], s["region"], s["spot"]) for s in body["started"]]
        assert "dec" not in ctl.running and (ctl.running["dec-od"].region, ctl.running["dec-od"].spot) == ("r2", False)
        assert "active" == state(coord, "dec")  # it still serves while dec-od boots
        seen = [at_notice]
        assert wait_until(lambda: seen.append(routed(coord, "dec")) or "dec-od" in coord.instances, 60), \
            "the replacement never registered"
        assert at_notice is not None and max(r for r in seen if r is not None) > at_notice, seen
        assert held == coord.held_requests  # no request waited for the replacement
        assert wait_until(lambda: state(coord, "dec") in ("draining", "gone"), 30), "it did not drain once replaced"
        kill(pids)  # the node goes
        n = load.completed
        assert wait_until(lambda: load.completed >= n + 4, 60), "the model stopped serving after the notice"
        assert wait_until(lambda: not ctl.repairs, 30), ctl.repairs
    assert load.sent == load.completed + load.refused + len(load.errors)
    assert [] == load.errors  # nothing cut, no 500, no dropped connection
    assert "dec" in coord.retired
    # (on a loaded host a heartbeat can go missing; self-repair replaces what that fails: those come after)
    assert ("preempted", "dec", "dec-od") == next((r["reason"], r["replaced"], r["by"]) for r in ctl.repaired)
    assert wait_until(lambda: "ok" == http("GET", dep.url + "/health")[1]["models"]["llama"], 60)


def test_an_on_demand_notice_starts_a_copy_without_asking_the_planner(dep: Deployment, planner: OffSpot) -> None:
    ctl = dep.controller
    assert ctl is not None
    asked = list(planner.lost)
    status, body = http("POST", dep.url + "/admin/preempt", {"node": "pre"})
    assert 200 == status, body
    assert asked == planner.lost  # not spot: no pool was lost, nothing to re-plan
    assert (False, "pre", True) == (body["replanned"], body["noticed"], body["drain_by_s"] > 0)
    new = body["replacement"]
    spec = ctl.running[new]
    assert ("llama", "prefill", "r1", False, 2) == (spec.model, spec.phase, spec.region, spec.spot, len(spec.stages))
    assert wait_until(lambda: not ctl.repairs, 60), ctl.repairs
    assert wait_until(lambda: "pre" not in ctl.noticed, 30)  # replaced: it drains
