"""Live re-planning and faults on real processes (127.0.0.1): drain without loss, kill -9 of an engine, coordinator restart.

Load runs in client threads for the whole of each test; every request sent is counted as
completed or errored, and the runtime's promise is that none is lost.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coral.runtime.deploy.cluster_config import InstanceSpec, StageSpec
from coral.runtime.deploy.deployment import Deployment
from coral.runtime.deploy.lifecycle import reconcile
from coral.runtime.serving.loadgen import one_request, run_bench, workload

from .conftest import ClientThreads, deployment, http, wait_until

CLUSTER = {
    "coordinator": {"port": 0, "heartbeat_s": 0.1, "heartbeat_timeout_s": 2.0, "max_retries": 3},
    "device": "cpu",
    "models": [{"name": "llama", "builtin": "tiny-llama", "weights": {"seed": 3}}],
    "instances": [
        {"name": "a", "model": "llama", "stages": [{"layers": [0, 6]}]},
        {"name": "b", "model": "llama", "stages": [{"layers": [0, 3]}, {"layers": [3, 6]}]},
    ],
}  # fmt: skip
NEW_C = {"name": "c", "model": "llama", "stages": [{"layers": [0, 2]}, {"layers": [2, 6]}]}


@dataclass
class Load(ClientThreads):
    """Closed-loop clients sending requests until stopped; counts every outcome."""

    url: str
    clients: int = 3
    max_tokens: int = 24

    def _client(self, k: int) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            with self.lock:
                self.sent += 1
            r = one_request(self.url, "llama", [3 + (k * 31 + i) % 200, 7, 9], self.max_tokens, timeout_s=30)
            with self.lock:
                if r.ok and r.output_tokens == self.max_tokens:
                    self.completed += 1
                else:
                    self.errors.append(r.error or f"{r.output_tokens} tokens")


@pytest.fixture(scope="module")
def dep() -> Iterator[Deployment]:
    yield from deployment(CLUSTER)


def _spec(name: str, stages: list[tuple[int, int]]) -> InstanceSpec:
    return InstanceSpec(
        name=name, model="m", phase="mixed", region="r", throughput_tok_per_s=1.0,
        stages=tuple(StageSpec(layer_start=a, layer_end=b, node_throughputs=(1.0,)) for a, b in stages), seed=0, weights_path=None,
    )  # fmt: skip


def test_reconcile_drains_lowest_load_and_names_new_instances() -> None:
    one, two = [(0, 6)], [(0, 3), (3, 6)]
    running = {"x": _spec("x", one), "y": _spec("y", one), "z": _spec("z", two)}
    desired = [_spec("p", one), _spec("q", two), _spec("x", two)]
    acts = reconcile(desired, running, {"x": 5, "y": 1, "z": 0}, taken={"x", "y", "z"})
    kinds = sorted((a.kind, a.name) for a in acts)
    # one single-stage instance stays (the busier x), y (load 1) drains; z matches one
    # two-stage slot, the second is started under a fresh name ("x" is taken)
    assert [("drain", "y"), ("keep", "x"), ("keep", "z"), ("start", "x-2")] == kinds
    assert [] == [a for a in reconcile(list(running.values()), running, {}, set(running)) if a.kind != "keep"]


def test_plan_change_under_load_loses_nothing_and_drain_waits(dep: Deployment) -> None:
    coord, prov = dep.coordinator, dep.provisioner
    assert coord is not None
    t_change = 0.0
    with Load(dep.url, clients=4, max_tokens=32) as load:
        assert wait_until(lambda: load.completed >= 6 and coord.loads().get("a", 0) > 0, 30)
        t_change = time.monotonic()
        plan = {"instances": [CLUSTER["instances"][1], NEW_C]}
        s, body = http("POST", dep.url + "/admin/plan", plan)
        assert 200 == s, body
        assert {("drain", "a"), ("start", "c")} == {(a["kind"], a["instance"]) for a in body["actions"] if a["kind"] != "keep"}
        # while "a" still holds requests its processes run; it exits only after the last one
        deadline = time.monotonic() + 30
        while "a" not in coord.retired and time.monotonic() < deadline:
            if coord.loads().get("a", 0) > 0:
                assert prov.instance_alive("a")
            time.sleep(0.005)
        assert "stopped" == coord.retired.get("a")
        assert wait_until(lambda: not prov.instance_alive("a"), 10), "drained instance did not exit"
        assert wait_until(lambda: coord.loads().get("c", 0) > 0 or any(e[1] == "c" and e[2] == "first request" for e in coord.events), 60)
        n_before = load.completed
        assert wait_until(lambda: load.completed >= n_before + 6, 30)
    assert coord.load_at_drain["a"] > 0, "the drain began with no request in flight; the test proved nothing"
    assert [] == load.errors
    assert load.sent == load.completed
    ev = {(i, w): t for t, i, w in coord.events}
    assert ev[("a", "draining")] >= t_change and ev[("a", "stopped")] > ev[("a", "draining")]
    assert ev[("c", "first request")] > ev[("c", "ready")] > t_change
    s, st = http("GET", dep.url + "/admin/instances")
    assert 200 == s and ["b", "c"] == st["running"] and {"b", "c"} == {i["id"] for i in st["instances"]}


def test_kill9_engine_under_load_every_request_accounted(dep: Deployment) -> None:
    coord, prov, ctl = dep.coordinator, dep.provisioner, dep.controller
    assert coord is not None and {"b", "c"} <= set(coord.instances)
    victim = next(pid for name, pid in prov.pids("c").items() if name.endswith("/1/0"))  # c's second stage
    with Load(dep.url, clients=4) as load:
        assert wait_until(lambda: load.completed >= 4 and coord.loads().get("c", 0) > 0, 30)
        os.kill(victim, signal.SIGKILL)
        assert wait_until(lambda: "c" in coord.retired, 10), "dead engine not detected"
        n = load.completed
        assert wait_until(lambda: load.completed >= n + 6, 30), "service stopped serving"
        ctl.epoch()  # the next epoch replaces the lost capacity
        assert wait_until(lambda: "c-2" in coord.instances, 60)
    assert load.sent == load.completed + len(load.errors)
    assert [] == load.errors  # retried on b: nothing surfaced to clients
    assert coord.retried >= 1
    assert wait_until(lambda: not prov.instance_alive("c"), 10), "the failed instance's other processes linger"
    s, b = http("POST", dep.url + "/v1/completions", {"model": "llama", "prompt": [5, 6], "max_tokens": 4, "temperature": 0})
    assert 200 == s and 4 == len(b["choices"][0]["token_ids"])


def test_coordinator_restart_rebuilds_registry(dep: Deployment) -> None:
    assert dep.coordinator is not None
    before = set(dep.coordinator.instances)
    dep.restart_coordinator()
    coord = dep.coordinator
    assert coord is not None and {} == coord.instances
    assert wait_until(lambda: set(coord.instances) == before, 10), f"re-registered {set(coord.instances)} of {before}"
    s, b = http("POST", dep.url + "/v1/completions", {"model": "llama", "prompt": [5, 6], "max_tokens": 4, "temperature": 0})
    assert 200 == s and 4 == len(b["choices"][0]["token_ids"])


def test_bench_tool_reports_every_request(dep: Deployment) -> None:
    arrival, prompt, output = workload(trace=None, rate_per_s=6.0, duration_s=2.0, seed=1, prompt_tokens=8, output_tokens=6, max_context=128)
    report, results = run_bench(dep.url, "llama", arrival, prompt, output, max_concurrency=8, goodput_ms={"ttft": 10_000, "tpot": 10_000})
    assert len(arrival) == report.sent == report.completed + report.failed
    assert 0 == report.failed, report.errors
    assert sum(int(x) for x in output) == report.total_output_tokens
    assert report.stats_ms["ttft"]["median"] > 0 and report.goodput_req_per_s == pytest.approx(report.request_throughput)
    text = report.render()
    assert "Successful requests:" in text and "P99 ITL (ms):" in text and "Median TPOT (ms):" in text
    j = report.to_json()
    assert {"mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "mean_e2el_ms", "request_throughput"} <= set(j)


def test_bench_takes_the_context_from_the_server(dep: Deployment) -> None:
    from coral.runtime.serving.loadgen import server_max_context

    assert dep.coordinator is not None
    assert dep.coordinator.models["llama"].max_context == server_max_context(dep.url, "llama")
    with pytest.raises(Exception, match="does not serve model 'nope'; it serves: llama"):
        server_max_context(dep.url, "nope")


def test_bench_cli_arguments(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from coral.runtime.serving.loadgen import bench_serve, parse_goodput

    assert {"ttft": 500.0, "tpot": 50.0} == parse_goodput(["ttft:500 tpot:50"]) == parse_goodput(["ttft:500", "tpot:50"])
    r = CliRunner().invoke(bench_serve, ["--url", "http://127.0.0.1:9", "--model", "m", "--duration-s", "1"])
    assert 0 != r.exit_code and "exactly one of --trace and --rate" in r.output
    r = CliRunner().invoke(bench_serve, ["--url", "http://127.0.0.1:9", "--model", "m", "--rate", "1", "--duration-s", "1", "--goodput", "ttfb:5"])
    assert 0 != r.exit_code and "unknown goodput metric" in r.output
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,4,2\n0.1,5,3\n")
    # nothing listens on port 9: without --max-context the server's /v1/models is asked first
    r = CliRunner().invoke(bench_serve, ["--url", "http://127.0.0.1:9", "--model", "m", "--trace", str(trace), "--duration-s", "5"])
    assert 1 == r.exit_code and "cannot reach http://127.0.0.1:9/v1/models" in r.output
    # with it, both requests are sent and both fail, explicitly, and the exit status says so
    r = CliRunner().invoke(bench_serve, ["--url", "http://127.0.0.1:9", "--model", "m", "--trace", str(trace), "--duration-s", "5",
                                         "--json", "--timeout-s", "2", "--max-context", "64"])  # fmt: skip
    assert 1 == r.exit_code, r.output
    out = json.loads(r.output[: r.output.rindex("}") + 1])
    assert (2, 0, 2) == (out["sent"], out["completed"], out["failed"])
    assert "every request to http://127.0.0.1:9 failed" in r.output and "Traceback" not in r.output
