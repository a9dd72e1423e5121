"""The issue's probes of the front end, repeated with their new outcomes: a body trickled byte by byte gets
408 at the whole-body deadline, a client that leaves mid-body is a debug line (no traceback), a body of
100k unknown fields logs one short line, ``Expect: 100-continue`` is answered only after the key is
checked, a draining server refuses new requests with 503 + Retry-After while its streams finish, and a
stop string releases the request's KV once (no engine warning)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest

from coral.runtime.engine.inproc import start_inproc_instance
from coral.runtime.engine.model import BUILTIN_CONFIGS
from coral.runtime.serving.app import ApiServer, ServerOptions
from coral.runtime.serving.coordinator import Coordinator, ModelInfo
from coral.runtime.transport import InprocHub, InprocTransport

from .api_server import AUTH, raw_request, start_api, stop_api
from .conftest import http, sse, wait_until


def _head(path: str, length: int, *, key: str | None = "sekret", expect: bool = False) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json", f"Content-Length: {length}"]
    if key:
        lines.append(f"Authorization: Bearer {key}")
    if expect:
        lines.append("Expect: 100-continue")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_body_trickled_byte_by_byte_gets_408_at_the_whole_body_deadline() -> None:
    # each read is quick (one byte every 0.1 s, far inside body_timeout_s), the whole body is not
    a = start_api(ServerOptions(api_key="sekret", body_timeout_s=30, body_deadline_s=1.0))
    try:
        s = socket.create_connection((a.server.host, a.server.port), timeout=10)
        s.sendall(_head("/v1/completions", 1000))
        t0, got = time.monotonic(), b""
        s.setblocking(False)
        while time.monotonic() - t0 < 10 and not got:
            try:
                s.send(b" ")
            except OSError:
                break
            time.sleep(0.1)
            try:
                got = s.recv(65536)
            except BlockingIOError:
                pass
        took = time.monotonic() - t0
        # the head and the body may come in two segments (under load they do): read to the close
        s.setblocking(True)
        s.settimeout(5)
        while chunk := s.recv(65536):
            got += chunk
        s.close()
        assert got.startswith(b"HTTP/1.1 408"), got
        assert b"not received whole within 1 s" in got and b"connection: close" in got.lower()
        assert 0.9 < took < 5.0, took
        assert wait_until(lambda: a.server.connections == 0, 5)
    finally:
        stop_api(a)


def test_a_client_leaving_mid_body_is_a_debug_line_not_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    a = start_api(ServerOptions(api_key="sekret"))
    try:
        with caplog.at_level(logging.DEBUG):
            for _ in range(5):
                s = socket.create_connection((a.server.host, a.server.port), timeout=5)
                s.sendall(_head("/v1/completions", 100_000) + b'{"model": "a", "prompt"')
                time.sleep(0.05)
                s.close()
            assert wait_until(lambda: sum("left before its POST /v1/completions body was read" in r.message
                                          for r in caplog.records) == 5, 10), [r.message for r in caplog.records]
            assert 200 == http("POST", a.url + "/v1/completions", {"model": "a", "prompt": [5], "max_tokens": 2}, headers=AUTH)[0]
        assert [] == [r for r in caplog.records if r.levelno >= logging.ERROR or "Traceback" in r.getMessage()]
        assert [] == [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]
    finally:
        stop_api(a)


def test_a_hundred_thousand_unknown_fields_log_one_short_line(caplog: pytest.LogCaptureFixture) -> None:
    a = start_api(ServerOptions(api_key="sekret"))
    try:
        body = {"model": "a", "prompt": [5], "max_tokens": 2, **{f"k{i}": 0 for i in range(100_000)}}
        chat = {"model": "long", "max_tokens": 2, "messages": [{"role": "user", "content": "hi", f"x{i}": 1} for i in range(1000)]}
        with caplog.at_level(logging.WARNING):
            assert 200 == http("POST", a.url + "/v1/completions", body, headers=AUTH)[0]
            assert 200 == http("POST", a.url + "/v1/chat/completions", chat, headers=AUTH)[0]
        lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
        assert [
            "100000 field(s) present in the request but ignored: ['k0', 'k1', 'k2', 'k3', 'k4'] and 99995 more",
            "1000 field(s) present in the request but ignored: ['x0', 'x1', 'x2', 'x3', 'x4'] and 995 more",
        ] == lines  # one line per request, whatever the body holds
    finally:
        stop_api(a)


def test_expect_100_continue_is_answered_only_after_the_key_is_checked() -> None:
    a = start_api(ServerOptions(api_key="sekret"))
    try:
        host, port = a.server.host, a.server.port
        body = json.dumps({"model": "a", "prompt": [5], "max_tokens": 2}).encode()
        # a wrong key: the final 401 at once, no "100 Continue" that would invite the body
        got = raw_request(host, port, _head("/v1/completions", len(body), key="wrong", expect=True), wait_s=2.0)
        assert got.startswith(b"HTTP/1.1 401"), got
        assert b"HTTP/1.1 100" not in got and b"connection: close" in got.lower()
        # the right key: 100 Continue, then the body, then the answer
        s = socket.create_connection((host, port), timeout=5)
        s.sendall(_head("/v1/completions", len(body), expect=True))
        assert s.recv(65536).startswith(b"HTTP/1.1 100")
        s.sendall(body)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            answer += s.recv(65536)
        s.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer
    finally:
        stop_api(a)


def test_a_draining_server_refuses_new_requests_and_finishes_its_streams() -> None:
    a = start_api(ServerOptions(api_key="sekret"))
    try:
        streams: list[list] = []

        def stream() -> None:
            body = {"model": "long", "prompt": [5], "max_tokens": 400, "stream": True}
            streams.append(sse_auth(a.url + "/v1/completions", body))

        clients = [threading.Thread(target=stream) for _ in range(4)]
        for t in clients:
            t.start()
        assert wait_until(lambda: a.server.in_flight == 4, 10)
        left: list[int] = []
        drainer = threading.Thread(target=lambda: left.append(a.server.drain(30)))
        drainer.start()
        assert wait_until(lambda: a.server.app.draining, 5)
        s, body = http("POST", a.url + "/v1/completions", {"model": "a", "prompt": [5], "max_tokens": 2}, headers=AUTH)
        assert 503 == s and "shutting_down" == body["error"]["code"]
        assert 503 == http("GET", a.url + "/health")[0] and "draining" == http("GET", a.url + "/health")[1]["status"]
        hdr = raw_request(a.server.host, a.server.port, _head("/v1/completions", 2) + b"{}")
        assert b"retry-after: 5" in hdr.lower()
        drainer.join(timeout=40)
        for t in clients:
            t.join(timeout=10)
        assert [0] == left  # every stream finished within the drain
        assert 4 == len(streams) and all(ev[-1][1] == "[DONE]" and ev[-2][1]["choices"][0]["finish_reason"] == "length" for ev in streams)
        assert all(400 == sum(len(e["choices"][0]["token_ids"]) for _t, e in ev[:-1]) for ev in streams)
    finally:
        stop_api(a)


def sse_auth(url: str, body: dict) -> list:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json", **AUTH})
    out = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: "):
                p = line[6:].strip()
                out.append((time.perf_counter(), p.decode() if p == b"[DONE]" else json.loads(p)))
    return out


def test_a_stop_string_frees_the_request_once(caplog: pytest.LogCaptureFixture) -> None:
    """Real engines on two stages: stop strings (and clients cancelling streams) cut requests mid-step; the
    release of their KV waits for the micro-batch in flight, so no stage looks for KV that is gone."""
    hub = InprocHub()
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    coord = Coordinator(InprocTransport(hub, "coord"), [ModelInfo(name="m", max_context=256, vocab_size=cfg["vocab_size"])])
    coord.start()
    inst = start_inproc_instance(hub, "i", config=cfg, seed=3, stages=[(0, 2, 1), (2, 4, 1), (4, 6, 1)], model="m",
                                 coordinator="coord", micro_batches=1)  # fmt: skip
    server = ApiServer(coord, options=ServerOptions())
    server.start()
    try:
        assert wait_until(lambda: len(coord.instances) == 1, 30)
        url = server.url + "/v1/completions"
        free = http("POST", url, {"model": "m", "prompt": [7, 8, 9], "max_tokens": 40, "temperature": 0})[1]
        text = free["choices"][0]["text"]
        stop = text[6:8]  # a stop string the greedy output hits a few tokens in
        assert stop and text.find(stop) >= 4
        with caplog.at_level(logging.WARNING):
            outs: list = []
            threads = [threading.Thread(target=lambda: outs.append(sse(url, {"model": "m", "prompt": [7, 8, 9], "max_tokens": 40,
                                                                            "temperature": 0, "stop": [stop], "stream": True})))
                       for _ in range(8)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert wait_until(lambda: not inst.scheduler.core.reqs and not inst.scheduler.core.stale, 10)
        assert 8 == len(outs) and all(ev[-2][1]["choices"][0]["finish_reason"] == "stop" for ev in outs)
        assert [] == [r.getMessage() for r in caplog.records if "no KV cache" in r.getMessage() or "failed" in r.getMessage()]
        # every node's pool is whole again: the stopped requests were released, once
        def held() -> dict[int, list[str]]:
            return {n.stage: sorted(n.kv.pool.tables) for n in inst.engines if n.kv.pool.num_free != n.kv.pool.num_blocks}

        assert wait_until(lambda: not held(), 10), held()
    finally:
        server.stop()
        coord.stop()
        inst.stop()
