"""Front-end benchmark: overhead per request, many concurrent streams, idle connections (bounded, 127.0.0.1 only).

1. Overhead: p50 time of a 1-token request sent straight to a no-op instance (its scheduler
   and engine are processes of their own, as deployed) over ZeroMQ, through the coordinator
   (router), and through HTTP (FastAPI on uvicorn, kept-alive connection, client in another
   process); front end + router overhead = HTTP p50 - instance p50 (goal <= 1 ms). The
   first tenth of each series is warm-up and not counted.
2. Concurrency: 256 and 1,024 clients open a streaming completion each, at once, from a
   child process (the async load generator); goal: 0 connection errors, 0 failed requests.
3. Idle connections: 1,000 TCP connections that never send a byte, opened by a child
   process, held, then left to the server's idle timeout; reports the server process's
   RSS before, while held and after they were closed (twice, to see it is flat) and how
   many the server closed by itself (goal: all).

Run ``python bench/frontend_bench.py [--quick]``; ``run(quick)`` returns the rows.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import resource
import statistics
import time
from typing import Any

__all__ = ["run"]


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))


class _Server:
    """Coordinator + one no-op in-process instance + the HTTP front end, in this process."""

    def __init__(self, **options: Any) -> None:
        from coral.runtime.engine.inproc import start_inproc_instance
        from coral.runtime.serving import ApiServer, ServerOptions
        from coral.runtime.serving.coordinator import Coordinator, ModelInfo
        from coral.runtime.transport import InprocHub, InprocTransport

        self.hub = InprocHub()
        self.coord = Coordinator(InprocTransport(self.hub, "coord"), [ModelInfo(name="noop", max_context=4096, vocab_size=1024)])
        self.coord.start()
        self.inst = start_inproc_instance(self.hub, "i", config=None, stages=[(0, 1, 1)], model="noop", coordinator="coord")
        self.api = ApiServer(self.coord, options=ServerOptions(token_timeout_s=120, **options))
        self.api.start()
        deadline = time.monotonic() + 10
        while not self.coord.instances and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        self.api.stop()
        self.coord.stop()
        self.inst.stop()


def _http_child(q: Any, host: str, port: int, n: int, path: str) -> None:
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1})
    conn = http.client.HTTPConnection(host, port, timeout=10)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        if path == "/health":
            conn.request("GET", path)
        else:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}")
        ts.append(time.perf_counter() - t)
    conn.close()
    q.put({"p50_ms": statistics.median(ts[n // 10 :]) * 1e3})


def bench_overhead(n: int) -> list[dict[str, Any]]:
    """The instance (a scheduler and a no-op engine, each its own process, as deployed) straight over
    ZeroMQ, then through the coordinator in this process, then through HTTP from a client process."""
    from coral.runtime.deploy.cluster_config import parse_cluster
    from coral.runtime.deploy.deployment import Deployment
    from coral.runtime.deploy.provisioner import LocalProvisioner
    from coral.runtime.protocol import Submit, TokenOut
    from coral.runtime.transport import ZmqTransport

    cluster = parse_cluster({
        "coordinator": {"port": 0}, "device": "cpu",
        "models": [{"name": "tiny", "builtin": "tiny-llama", "weights": {"seed": 0}}],
        "instances": [{"name": "i", "model": "tiny", "stages": [{"layers": [0, 6]}]}],
    })  # fmt: skip
    dep = Deployment(cluster, LocalProvisioner(noop_engines=True), http_port=0)
    dep.start(timeout_s=120)
    try:
        assert dep.coordinator is not None and dep.api is not None
        coord = dep.coordinator
        sched = coord.instances["i"].address
        client = ZmqTransport()
        direct, routed = [], []
        for k in range(n):
            t = time.perf_counter()
            client.send(sched, Submit(request_id=f"d{k}", prompt=(1, 2, 3), max_tokens=1, temperature=0.0, seed=0, eos_ids=(), reply_to=client.address))
            while not isinstance(msg := client.recv(10), TokenOut) or not msg.finished:
                if msg is None:
                    raise RuntimeError("the no-op instance did not answer within 10 s")
            if msg.error:
                raise RuntimeError(msg.error)
            direct.append(time.perf_counter() - t)
        client.close()
        for _ in range(n):
            t = time.perf_counter()
            h = coord.submit("tiny", [1, 2, 3], 1, 0.0, 0)
            for _msg in coord.tokens(h, 10):
                pass
            coord.close(h)
            routed.append(time.perf_counter() - t)
        health = _in_child(_http_child, dep.api.host, dep.api.port, n, "/health")["p50_ms"]
        via_http = _in_child(_http_child, dep.api.host, dep.api.port, n, "/v1/completions")["p50_ms"]
    finally:
        dep.stop()
    p50 = {"direct": statistics.median(direct[n // 10 :]) * 1e3, "routed": statistics.median(routed[n // 10 :]) * 1e3}
    return [
        {"bench": "1-token request, no-op instance (2 processes) over ZMQ, p50", "value": p50["direct"], "unit": "ms", "goal": ""},
        {"bench": "same through the coordinator (router), p50", "value": p50["routed"], "unit": "ms", "goal": ""},
        {"bench": "same through HTTP (FastAPI/uvicorn, keep-alive), p50", "value": via_http, "unit": "ms", "goal": ""},
        {"bench": "GET /health (the HTTP stack alone), p50", "value": health, "unit": "ms", "goal": ""},
        {"bench": "front end + router overhead (HTTP - instance), p50", "value": via_http - p50["direct"], "unit": "ms", "goal": "<= 1 ms"},
    ]


def _streams_child(q: Any, url: str, clients: int, tokens: int) -> None:
    import asyncio

    from coral.runtime.serving.loadgen import replay_async

    _raise_fd_limit()
    prompts = [[3 + i % 500, 7] for i in range(clients)]
    results, wall = asyncio.run(replay_async(url, "noop", [0.0] * clients, prompts, [tokens] * clients,
                                             max_concurrency=clients, timeout_s=120))  # fmt: skip
    conn_errors = sum(1 for r in results if not r.ok and any(w in r.error for w in ("Connect", "Read", "Remote", "Reset", "Pool", "Write")))
    q.put({"failed": sum(1 for r in results if not r.ok), "conn_errors": conn_errors, "wall_s": wall,
           "tokens": sum(r.output_tokens for r in results if r.ok),
           "p99_ttft_ms": statistics.quantiles([r.ttft_s * 1e3 for r in results if r.ok] or [0.0, 0.0], n=100)[98],
           "first_error": next((r.error for r in results if not r.ok), "")})  # fmt: skip


def _in_child(target: Any, *args: Any, timeout_s: float = 600) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(q, *args), daemon=True)
    p.start()
    try:
        return q.get(timeout=timeout_s)  # type: ignore[no-any-return]
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()


def bench_streams(counts: tuple[int, ...], tokens: int) -> list[dict[str, Any]]:
    _raise_fd_limit()
    s = _Server()
    rows = []
    try:
        for n in counts:
            r = _in_child(_streams_child, s.api.url, n, tokens)
            note = f" ({r['first_error'][:60]})" if r["first_error"] else ""
            rows.append({"bench": f"{n} concurrent streams: connection errors{note}", "value": r["conn_errors"], "unit": "", "goal": "<= 0"})
            rows.append({"bench": f"{n} concurrent streams: failed requests", "value": r["failed"], "unit": "", "goal": "<= 0"})
            rows.append({"bench": f"{n} concurrent streams: wall (s), {tokens} tokens each", "value": r["wall_s"], "unit": "s", "goal": ""})
            rows.append({"bench": f"{n} concurrent streams: p99 TTFT", "value": r["p99_ttft_ms"], "unit": "ms", "goal": ""})
    finally:
        s.stop()
    return rows


def _idle_child(q: Any, host: str, port: int, n: int, cmd: Any) -> None:
    import socket

    _raise_fd_limit()
    socks = []
    for _ in range(n):
        socks.append(socket.create_connection((host, port), timeout=10))
    q.put({"opened": len(socks)})
    cmd.get(timeout=300)  # hold them until told
    closed = 0
    for s in socks:
        s.setblocking(False)
        try:
            closed += s.recv(1) == b""  # the server closed it: EOF
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        s.close()
    q.put({"closed_by_server": closed})


def bench_idle(n: int, idle_timeout_s: float) -> list[dict[str, Any]]:
    _raise_fd_limit()
    s = _Server(idle_timeout_s=idle_timeout_s)
    rows = []
    try:
        # warm up the allocator with one full cycle, then measure two more
        ctx = mp.get_context("spawn")
        rss: list[tuple[float, float, float]] = []
        closed: list[int] = []
        for _cycle in range(3):
            q, cmd = ctx.Queue(), ctx.Queue()
            before = _rss_mib()
            p = ctx.Process(target=_idle_child, args=(q, s.api.host, s.api.port, n, cmd), daemon=True)
            p.start()
            q.get(timeout=120)
            deadline = time.monotonic() + 30
            while s.api.connections < n and time.monotonic() < deadline:
                time.sleep(0.05)
            held = _rss_mib()
            peak_conns = s.api.connections
            deadline = time.monotonic() + idle_timeout_s + 30
            while s.api.connections > 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            cmd.put("check")
            closed.append(int(q.get(timeout=120)["closed_by_server"]))
            p.join(timeout=30)
            time.sleep(0.5)
            rss.append((before, held, _rss_mib()))
            if peak_conns < n:
                raise RuntimeError(f"only {peak_conns} of {n} idle connections were accepted")
        (b1, _h1, a1), (b2, h2, a2) = rss[1], rss[2]
        rows += [
            {"bench": f"{n} idle conns: closed by the server (last cycle)", "value": closed[-1], "unit": "", "goal": f">= {n}"},
            {"bench": f"{n} idle conns: server RSS growth while held", "value": h2 - b2, "unit": "MiB", "goal": ""},
            {"bench": f"{n} idle conns: RSS after close - before (cycle 2)", "value": a1 - b1, "unit": "MiB", "goal": "<= 5 MiB"},
            {"bench": f"{n} idle conns: RSS after close - before (cycle 3)", "value": a2 - b2, "unit": "MiB", "goal": "<= 5 MiB"},
        ]
    finally:
        s.stop()
    return rows


def run(quick: bool) -> list[dict[str, Any]]:
    """All front-end benchmarks.

    Args:
        quick: fewer requests (about a minute in all).

    Returns:
        One dict per figure: bench, value, unit, goal.
    """
    return bench_overhead(300 if quick else 1000) + bench_streams((256, 1024), 16 if quick else 32) + bench_idle(1000, 2.0)


def main() -> None:
    """Print the table."""
    from common import main_for

    main_for(run, __doc__)


if __name__ == "__main__":
    main()
