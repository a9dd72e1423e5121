"""Runtime benchmark: coordinator overhead with a no-op engine, and a 2-stage pipeline vs one process.

Run ``python bench/runtime_bench.py [--quick]``; prints a table. ``run(quick)`` returns the
rows for the main bench runner. Every figure is measured here, on this machine.
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import statistics
import time
from typing import Any

__all__ = ["run"]


def _post(conn: http.client.HTTPConnection, body: dict[str, Any]) -> dict[str, Any]:
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    data = json.loads(r.read())
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {data}")
    return data


def bench_overhead(n: int) -> list[dict[str, Any]]:
    """p50 per-request time through coordinator + router with a no-op instance (in-process hub)."""
    from coral.runtime.coordinator import Coordinator, ModelInfo
    from coral.runtime.http_api import ApiServer
    from coral.runtime.inproc import start_inproc_instance
    from coral.runtime.transport import InprocHub, InprocTransport

    hub = InprocHub()
    coord = Coordinator(InprocTransport(hub, "coord"), [ModelInfo(name="noop", max_context=4096, vocab_size=1024)])
    coord.start()
    inst = start_inproc_instance(hub, "i", config=None, stages=[(0, 1, 1)], model="noop", coordinator="coord")
    api = ApiServer(coord)
    api.start()
    try:
        deadline = time.monotonic() + 10
        while not coord.instances and time.monotonic() < deadline:
            time.sleep(0.01)
        direct, via_http = [], []
        for _ in range(n):
            t = time.perf_counter()
            h = coord.submit("noop", [1, 2, 3], 1, 0.0, 0)
            for _msg in coord.tokens(h, 10):
                pass
            coord.close(h, "ok")
            direct.append(time.perf_counter() - t)
        conn = http.client.HTTPConnection(api.host, api.port, timeout=10)
        for _ in range(n):
            t = time.perf_counter()
            _post(conn, {"model": "noop", "prompt": [1, 2, 3], "max_tokens": 1})
            via_http.append(time.perf_counter() - t)
        conn.close()
    finally:
        api.stop()
        coord.stop()
        inst.stop()
    return [
        {"bench": "router+coordinator+no-op instance, p50", "value": statistics.median(direct) * 1e3, "unit": "ms", "goal": "<= 1 ms"},
        {"bench": "same through HTTP (keep-alive), p50", "value": statistics.median(via_http) * 1e3, "unit": "ms", "goal": ""},
    ]


def _cluster(stages: list[list[int]], threads: int) -> Any:
    from coral.runtime.cluster_config import parse_cluster

    return parse_cluster({
        "coordinator": {"port": 0}, "device": "cpu", "torch_threads": threads,
        "models": [{"name": "small", "builtin": "small-llama", "weights": {"seed": 0}}],
        "instances": [{"name": "i", "model": "small", "phase": "mixed", "stages": [{"layers": s} for s in stages]}],
    })  # fmt: skip


def _tok_per_s(url: str, streams: int, tokens: int, prompt_len: int) -> float:
    host, port = url.removeprefix("http://").split(":")

    def one(i: int) -> int:
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        body = {"model": "small", "prompt": [(7 * i + k) % 8000 + 3 for k in range(prompt_len)], "max_tokens": tokens, "temperature": 0}
        out = _post(conn, body)["usage"]["completion_tokens"]
        conn.close()
        return int(out)

    one(0)  # warm-up
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(streams) as ex:
        n = sum(ex.map(one, range(streams)))
    return n / (time.perf_counter() - t)


def bench_pipeline(quick: bool) -> list[dict[str, Any]]:
    """small-llama (~67M): one engine process (1 thread, and all cores) vs 2 stages in 2 processes."""
    import os

    from coral.runtime.deploy.deployment import Deployment

    tokens = 24 if quick else 64
    streams_many = 4
    cores = os.cpu_count() or 1
    rows = []
    results: dict[str, dict[int, float]] = {}
    configs = [("1 process", [[0, 16]], 1), ("2-stage pipeline", [[0, 8], [8, 16]], max(1, cores // 2))]
    if cores > 1:
        configs.insert(1, (f"1 process, {cores} threads", [[0, 16]], cores))
    for label, stages, threads in configs:
        dep = Deployment(_cluster(stages, threads), http_port=0)
        dep.start(timeout_s=300)
        try:
            results[label] = {s: _tok_per_s(dep.url, s, tokens, 32) for s in (1, streams_many)}
        finally:
            dep.stop()
    for s, goal in ((1, ">= 0.8"), (streams_many, "> 1.0")):
        two = results["2-stage pipeline"][s]
        for label, r in results.items():
            if label != "2-stage pipeline":
                rows.append({"bench": f"small-llama, {s} stream(s): {label} tok/s", "value": r[s], "unit": "tok/s", "goal": ""})
        one = max(r[s] for label, r in results.items() if label != "2-stage pipeline")  # the better single process
        rows.append({"bench": f"small-llama, {s} stream(s): 2-stage tok/s", "value": two, "unit": "tok/s", "goal": ""})
        rows.append({"bench": f"small-llama, {s} stream(s): ratio 2-stage / best 1 process", "value": two / one, "unit": "x", "goal": goal})
    return rows


def run(quick: bool) -> list[dict[str, Any]]:
    """All runtime benchmarks.

    Args:
        quick: fewer requests and tokens (about a minute in all).

    Returns:
        One dict per figure: bench, value, unit, goal.
    """
    return bench_overhead(200 if quick else 1000) + bench_pipeline(quick)


def main() -> None:
    """Print the table."""
    from common import main_for

    main_for(run, __doc__)


if __name__ == "__main__":
    main()
