"""Runtime benchmark: coordinator overhead, 2-stage pipeline vs one process, batched engine throughput.

The engine rows (``bench_engine``) serve one instance with the real ``coral serve`` stack
(coordinator, HTTP, scheduler and engine processes over ZeroMQ) and compare its output
tok/s at concurrency 16 with Hugging Face ``generate()`` at batch 16 in this process (same
model, weights, lengths and torch threads), and with concurrency 1. For tiny-llama the
per-token time is broken down into the forward pass, the ZeroMQ hops, the coordinator and
scheduler, and HTTP; the forward pass is also given per step, for the engine's lean step and
for the same step through the ``transformers`` decoder modules (alternated in one process).

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
    from coral.runtime.engine.inproc import start_inproc_instance
    from coral.runtime.serving import ApiServer
    from coral.runtime.serving.coordinator import Coordinator, ModelInfo
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
    from coral.runtime.deploy.cluster_config import parse_cluster

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


def _hf_generate_tok_per_s(arch: str, batch: int, tokens: int, prompt_len: int, threads: int) -> float:
    """Output tok/s of plain transformers generate() at ``batch`` in this process."""
    import torch
    from transformers import AutoModelForCausalLM

    from coral.runtime.engine.model import BUILTIN_CONFIGS, make_config, seeded_state_dict

    cfg = BUILTIN_CONFIGS[arch]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = AutoModelForCausalLM.from_config(make_config(cfg))
        model.load_state_dict(seeded_state_dict(cfg, 0))
        model.eval()
        ids = torch.tensor([[(7 * i + k) % 8000 % cfg["vocab_size"] + 3 for k in range(prompt_len)] for i in range(batch)])
        with torch.inference_mode():
            model.generate(ids[:, :4], max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)  # warm-up
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            return batch * tokens / (time.perf_counter() - t)
    finally:
        torch.set_num_threads(old)


def _serve_one(arch: str, threads: int, noop: bool = False) -> Any:
    from coral.runtime.deploy.cluster_config import parse_cluster
    from coral.runtime.deploy.deployment import Deployment
    from coral.runtime.deploy.provisioner import LocalProvisioner

    spec = parse_cluster({
        "coordinator": {"port": 0}, "device": "cpu", "torch_threads": threads,
        "models": [{"name": "small", "builtin": arch, "weights": {"seed": 0}}],
        "instances": [{"name": "i", "model": "small", "phase": "mixed", "stages": [{"layers": [0, _layers(arch)]}]}],
    })  # fmt: skip
    dep = Deployment(spec, http_port=0, provisioner=LocalProvisioner(noop_engines=noop))
    dep.start(timeout_s=300)
    return dep


def _coord_tok_per_s(dep: Any, streams: int, tokens: int, prompt_len: int) -> float:
    """Like :func:`_tok_per_s` but calling the deployment's coordinator directly (no HTTP)."""
    coord = dep.coordinator

    def one(i: int) -> int:
        h = coord.submit("small", [(7 * i + k) % 500 + 3 for k in range(prompt_len)], tokens, 0.0, i)
        n = sum(len(m.tokens) for m in coord.tokens(h, 60))
        coord.close(h, "ok")
        return n

    one(0)
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(streams) as ex:
        n = sum(ex.map(one, range(streams)))
    return n / (time.perf_counter() - t)


def _layers(arch: str) -> int:
    from coral.runtime.engine.model import BUILTIN_CONFIGS

    return int(BUILTIN_CONFIGS[arch]["num_hidden_layers"])


def _forward_ms_per_step(arch: str, batch: int, prompt_len: int, threads: int, steps: int = 16, lean: bool = True) -> float:
    """Median time of one batched decode step of the whole model, in this process (no messaging).

    The step is what an engine does per micro-batch: ``PagedKvCache.prepare`` (block tables
    to index tensors), ``Shard.forward_batch`` and the argmax to the host. ``lean=False`` runs
    the same step through the ``transformers`` decoder modules instead of the engine's lean
    step (``coral.runtime.engine.layers``).
    """
    import torch

    from coral.runtime.engine.model import BUILTIN_CONFIGS, ShardSpec, load_shard

    cfg = BUILTIN_CONFIGS[arch]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        shard = load_shard(ShardSpec(config=cfg, layer_start=0, layer_end=cfg["num_hidden_layers"], seed=0))
        if not lean:
            from coral.runtime.engine.layers import LeanStep

            shard.lean = LeanStep(shard.model, lean=False)
        kv = shard.new_kv_cache(max_tokens_wanted=batch * (prompt_len + steps + 1))
        meta = kv.prepare([(f"r{i}", 0, prompt_len) for i in range(batch)])
        shard.forward_batch(meta, torch.randint(3, 500, (batch * prompt_len,)), None)
        times = []
        for k in range(steps):
            t = time.perf_counter()
            meta = kv.prepare([(f"r{i}", prompt_len + k, 1) for i in range(batch)])
            out = shard.forward_batch(meta, torch.randint(3, 500, (batch,)), None)
            out.argmax(-1).tolist()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3
    finally:
        torch.set_num_threads(old)


def _zmq_hop_ms(batch: int, hidden: int = 0, n: int = 200) -> float:
    """Median one-way time of a batch-sized ForwardBatch over ZeroMQ on loopback (round trip / 2)."""
    from coral.runtime.protocol import BatchItem, ForwardBatch, ForwardResult, TensorBlob, TokenItem
    from coral.runtime.transport import ZmqTransport

    a, b = ZmqTransport(host="127.0.0.1"), ZmqTransport(host="127.0.0.1")
    try:
        items = tuple(BatchItem(request_id=f"r{i}", position=40, token_ids=(5,), hidden=None, route=(b.address,), temperature=0.0, seed=0, step=3) for i in range(batch))
        blob = TensorBlob(dtype="float32", shape=(batch, hidden), data=bytes(4 * batch * hidden)) if hidden else None
        fb = ForwardBatch(batch_id=1, reply_to=a.address, items=items, hidden=blob)
        res = ForwardResult(batch_id=1, items=tuple(TokenItem(request_id=f"r{i}", token=7) for i in range(batch)))
        times = []
        for _ in range(n):
            t = time.perf_counter()
            a.send(b.address, fb)
            b.recv(5)
            b.send(a.address, res)
            a.recv(5)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3 / 2
    finally:
        a.close()
        b.close()


def _noop_per_token_ms(streams: int, tokens: int, via_http: bool) -> float:
    """Wall time per output token of a no-op instance at ``streams`` concurrent requests (coordinator + scheduler [+ HTTP])."""
    from coral.runtime.engine.inproc import start_inproc_instance
    from coral.runtime.serving import ApiServer
    from coral.runtime.serving.coordinator import Coordinator, ModelInfo
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

        def direct(i: int) -> int:
            h = coord.submit("noop", [1, 2, 3], tokens, 0.0, i)
            n = sum(len(m.tokens) for m in coord.tokens(h, 30))
            coord.close(h, "ok")
            return n

        def http_one(i: int) -> int:
            conn = http.client.HTTPConnection(api.host, api.port, timeout=30)
            out = _post(conn, {"model": "noop", "prompt": [1, 2, 3], "max_tokens": tokens, "temperature": 0})
            conn.close()
            return int(out["usage"]["completion_tokens"])

        one = http_one if via_http else direct
        one(0)
        t = time.perf_counter()
        with cf.ThreadPoolExecutor(streams) as ex:
            n = sum(ex.map(one, range(streams)))
        return (time.perf_counter() - t) / n * 1e3
    finally:
        api.stop()
        coord.stop()
        inst.stop()


def bench_engine(quick: bool) -> list[dict[str, Any]]:
    """Batched engine: conc 16 vs HF generate batch 16 and vs conc 1; tiny-llama per-token breakdown."""
    tokens = 32 if quick else 64
    prompt_len = 32
    threads = 1
    rows: list[dict[str, Any]] = []
    for arch in ("small-llama", "tiny-llama"):
        dep = _serve_one(arch, threads)
        try:
            # side by side: HF, conc 16, conc 1, HF again (the mean of the two HF runs is the reference)
            hf_a = _hf_generate_tok_per_s(arch, 16, tokens, prompt_len, threads)
            c16 = _tok_per_s(dep.url, 16, tokens, prompt_len)
            c1 = _tok_per_s(dep.url, 1, tokens, prompt_len)
            hf_b = _hf_generate_tok_per_s(arch, 16, tokens, prompt_len, threads)
        finally:
            dep.stop()
        hf = (hf_a + hf_b) / 2
        is_small = arch == "small-llama"
        rows += [
            {"bench": f"{arch}: HF generate batch 16 tok/s", "value": hf, "unit": "tok/s", "goal": ""},
            {"bench": f"{arch}: coral serve conc 16 tok/s", "value": c16, "unit": "tok/s", "goal": ""},
            {"bench": f"{arch}: coral serve conc 1 tok/s", "value": c1, "unit": "tok/s", "goal": ""},
            {"bench": f"{arch}: conc 16 / HF batch 16", "value": c16 / hf, "unit": "x", "goal": ">= 0.8" if is_small else ""},
            {"bench": f"{arch}: conc 16 / conc 1", "value": c16 / c1, "unit": "x", "goal": ">= 4" if is_small else ""},
        ]
        if not is_small:
            e2e = 1e3 / c16
            # the lean step and the transformers modules, alternated so that both see the same host
            lean_ms, modules_ms = [], []
            for _ in range(3):
                lean_ms.append(_forward_ms_per_step("tiny-llama", 16, prompt_len, threads))
                modules_ms.append(_forward_ms_per_step("tiny-llama", 16, prompt_len, threads, lean=False))
            step_ms, modules_step_ms = statistics.median(lean_ms), statistics.median(modules_ms)
            fwd = step_ms / 16
            hop = 2 * _zmq_hop_ms(16) / 16  # scheduler -> engine -> scheduler, per step
            noop = _serve_one(arch, threads, noop=True)
            try:
                stack_http = 1e3 / _tok_per_s(noop.url, 16, tokens, prompt_len)
                stack_coord = 1e3 / _coord_tok_per_s(noop, 16, tokens, prompt_len)
            finally:
                noop.stop()
            rows += [
                {"bench": "tiny-llama conc 16: ms per output token, end to end", "value": e2e, "unit": "ms", "goal": ""},
                {"bench": "  forward pass (batch-16 decode step / 16)", "value": fwd, "unit": "ms", "goal": ""},
                {"bench": "    one batch-16 decode step (prepare + forward + argmax)", "value": step_ms, "unit": "ms", "goal": ""},
                {"bench": "    same step through the transformers modules", "value": modules_step_ms, "unit": "ms", "goal": ""},
                {"bench": "    HF generate() batch 16 per output token (reference)", "value": 1e3 / hf, "unit": "ms", "goal": ""},
                {"bench": "  ZeroMQ hops sched->engine->sched (/ 16)", "value": hop, "unit": "ms", "goal": ""},
                {"bench": "  coordinator+scheduler+ZeroMQ, no-op engine", "value": stack_coord, "unit": "ms", "goal": ""},
                {"bench": "  HTTP (no-op stack via HTTP minus direct)", "value": stack_http - stack_coord, "unit": "ms", "goal": ""},
            ]
    return rows


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _gauges(url: str) -> dict[str, float]:
    """The server's gauges from its Prometheus `/metrics` (summed over models), as a user scrapes them."""
    import urllib.request

    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            v = float(line.rsplit(" ", 1)[1])
            out[name] = max(out.get(name, 0.0), v) if name.endswith("perc") else out.get(name, 0.0) + v
    return out


def bench_overload(quick: bool) -> list[dict[str, Any]]:
    """Poisson load at 2x the served rate into a small KV pool: it queues, nothing fails for memory, RSS stays flat."""
    import random
    import threading

    from coral.runtime.deploy.cluster_config import parse_cluster
    from coral.runtime.deploy.deployment import Deployment

    duration_s = 60.0 if quick else 600.0
    prompt_len, tokens = 32, 32
    kv_tokens = 2048  # per engine: 32 requests of prompt + output at once
    kv_gib = kv_tokens * 2 * 3 * 2 * 16 * 4 / 2**30  # tiny-llama, 3 layers per stage
    spec = parse_cluster({
        "coordinator": {"port": 0}, "device": "cpu", "kv_cache_gib": kv_gib,
        "models": [{"name": "small", "builtin": "tiny-llama", "weights": {"seed": 0}}],
        "instances": [{"name": "i", "model": "small", "phase": "mixed", "stages": [{"layers": [0, 3]}, {"layers": [3, 6]}]}],
    })  # fmt: skip
    dep = Deployment(spec, http_port=0)
    dep.start(timeout_s=300)
    try:
        served_tok_s = _tok_per_s(dep.url, 64, tokens, prompt_len)
        rate = 2 * served_tok_s / tokens  # requests per second offered
        host, port = dep.url.removeprefix("http://").split(":")
        outcomes: list[str] = []
        lock = threading.Lock()
        slots = threading.BoundedSemaphore(512)  # the client's own connection limit

        def one(i: int) -> None:
            try:
                conn = http.client.HTTPConnection(host, int(port), timeout=600)
                body = {"model": "small", "prompt": [(7 * i + k) % 500 + 3 for k in range(prompt_len)], "max_tokens": tokens, "temperature": 0}
                conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
                r = conn.getresponse()
                data = json.loads(r.read())
                conn.close()
                what = "ok" if r.status == 200 else str(data.get("error", {}).get("message", r.status))
            except Exception as e:  # the client's own failure: counted, not hidden
                what = f"client: {type(e).__name__}"
            finally:
                slots.release()
            with lock:
                outcomes.append(what)

        pids = {n: p for n, p in dep.provisioner.pids("i").items()}
        rng = random.Random(0)
        t0 = time.monotonic()
        samples: list[tuple[float, dict[str, int]]] = []
        gauges: list[tuple[float, dict[str, float]]] = []  # what /metrics says while it runs
        threads_: list[threading.Thread] = []
        nxt, i, last_sample = t0, 0, 0.0
        while time.monotonic() - t0 < duration_s:
            now = time.monotonic()
            if now - last_sample >= 5.0:
                samples.append((now - t0, {n: _rss_bytes(p) for n, p in pids.items()}))
                gauges.append((now - t0, _gauges(dep.url)))
                last_sample = now
            if now < nxt:
                time.sleep(min(nxt - now, 0.05))
                continue
            slots.acquire()
            th = threading.Thread(target=one, args=(i,), daemon=True)
            th.start()
            threads_.append(th)
            i += 1
            nxt += rng.expovariate(rate)
        for th in threads_:
            th.join(timeout=600)
        samples.append((time.monotonic() - t0, {n: _rss_bytes(p) for n, p in pids.items()}))
    finally:
        dep.stop()
    warm = [m for t, m in samples if t >= 0.2 * duration_s]
    growth = max((max(m[n] for m in warm) - warm[0][n]) / max(warm[0][n], 1) for n in pids) if warm else float("nan")
    failed = [o for o in outcomes if o != "ok"]
    memory = [o for o in failed if "memory" in o.lower() or "kv" in o.lower()]
    if failed:
        import collections

        print("overload: failures by reason:", dict(collections.Counter(failed).most_common(5)), flush=True)
    late = [g for t, g in gauges if t >= 0.2 * duration_s]
    waiting = statistics.median(g.get("vllm:num_requests_waiting", 0.0) for g in late) if late else float("nan")
    kv_peak = max((g.get("vllm:kv_cache_usage_perc", 0.0) for _, g in gauges), default=float("nan"))
    return [
        {"bench": "overload: served rate (tiny-llama, 2 stages, 2048-token KV)", "value": served_tok_s / tokens, "unit": "req/s", "goal": ""},
        {"bench": f"overload: offered 2x for {duration_s:.0f} s, requests sent", "value": float(len(outcomes)), "unit": "req", "goal": ""},
        {"bench": "overload: requests sent per s / served rate", "value": len(outcomes) / duration_s / (served_tok_s / tokens), "unit": "x",
         "goal": ""},
        {"bench": "overload: vllm:num_requests_waiting, median after warm-up", "value": waiting, "unit": "req", "goal": "> 0"},
        {"bench": "overload: vllm:kv_cache_usage_perc, highest scraped", "value": kv_peak, "unit": "", "goal": "<= 1"},
        {"bench": "overload: requests failed (any reason)", "value": float(len(failed)), "unit": "req", "goal": "<= 0"},
        {"bench": "overload: requests failed for lack of memory", "value": float(len(memory)), "unit": "req", "goal": "<= 0"},
        {"bench": "overload: worst process RSS growth after warm-up", "value": 100 * growth, "unit": "%", "goal": "<= 10"},
        {"bench": "overload: KV pool per engine (fixed at start)", "value": kv_gib * 2**30 / 2**20, "unit": "MiB", "goal": ""},
    ]


def run(quick: bool) -> list[dict[str, Any]]:
    """All runtime benchmarks.

    Args:
        quick: fewer requests and tokens (about a minute in all).

    Returns:
        One dict per figure: bench, value, unit, goal.
    """
    return bench_overhead(200 if quick else 1000) + bench_pipeline(quick) + bench_engine(quick) + bench_overload(quick)


def main() -> None:
    """Print the table."""
    from common import main_for

    main_for(run, __doc__)


if __name__ == "__main__":
    main()
