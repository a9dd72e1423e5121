"""The HTTP front end over an in-process coordinator and no-op instances: API shape, errors, limits, metrics.

No-op engines produce token ``3 + (position + step) % 250`` (logit 30, every other token 0),
so outputs are known in advance: for a prompt of L tokens the first token is 3, then
``3 + (L + 2k - 1) % 250`` for the k-th.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest

from coral.runtime.serving.app import ServerOptions
from coral.runtime.serving.tokenizer import ByteTokenizer

from .api_server import AUTH, WEIRD, Api, noop_tokens, raw_request, start_api, stop_api
from .conftest import http, wait_until


@pytest.fixture
def api() -> Iterator[Api]:
    a = start_api(ServerOptions(api_key="sekret", token_timeout_s=10))
    yield a
    stop_api(a)


def test_completion_chat_and_models(api: Api) -> None:
    status, body = http("POST", api.url + "/v1/completions", {"model": "a", "prompt": [5, 6], "max_tokens": 4, "temperature": 0}, AUTH)
    assert 200 == status
    choice = body["choices"][0]
    assert noop_tokens(2, 4) == choice["token_ids"] and "length" == choice["finish_reason"]
    assert {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6} == body["usage"]
    status, body = http("POST", api.url + "/v1/chat/completions", {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, AUTH)
    assert 200 == status and "assistant" == body["choices"][0]["message"]["role"]
    assert len(ByteTokenizer().encode("<|user|>\nhi\n<|assistant|>\n")) == body["usage"]["prompt_tokens"]
    status, body = http("GET", api.url + "/v1/models", headers=AUTH)
    assert ["a", "b", "long", WEIRD] == [m["id"] for m in body["data"]]
    status, card = http("GET", api.url + "/v1/models/long", headers=AUTH)
    assert 200 == status and 100_000 == card["max_model_len"] and "long" == card["id"]
    status, err = http("GET", api.url + "/v1/models/nope", headers=AUTH)
    assert 404 == status and "model_not_found" == err["error"]["code"]


def test_chat_defaults_to_the_rest_of_the_context(api: Api) -> None:
    prompt = ByteTokenizer().encode("<|user|>\nhi\n<|assistant|>\n")
    s, body = http("POST", api.url + "/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": "hi"}]}, AUTH)
    assert 200 == s and 64 - len(prompt) == body["usage"]["completion_tokens"]


def test_streaming_chunks_on_a_kept_alive_connection(api: Api) -> None:
    import http.client

    conn = http.client.HTTPConnection(api.server.host, api.server.port, timeout=10)
    for _ in range(2):  # two streams on one connection: the server keeps it open
        conn.request("POST", "/v1/completions", json.dumps({"model": "a", "prompt": "hey", "max_tokens": 5, "stream": True,
                                                            "stream_options": {"include_usage": True}}), {**AUTH, "Content-Type": "application/json"})  # fmt: skip
        r = conn.getresponse()
        assert "text/event-stream" in r.headers["Content-Type"]
        assert "close" != (r.headers.get("Connection") or "").lower()
        lines = [ln for ln in r.read().decode().split("\n\n") if ln]
        assert "data: [DONE]" == lines[-1]
        events = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
        assert noop_tokens(3, 5) == [t for e in events if e["choices"] for t in e["choices"][0]["token_ids"]]
        assert 5 == events[-1]["usage"]["completion_tokens"] and [] == events[-1]["choices"]
    conn.close()


def test_errors_in_openai_shape(api: Api) -> None:
    url = api.url
    s, b = http("POST", url + "/v1/completions", {"model": "zzz", "prompt": "x"}, AUTH)
    assert 404 == s and "model_not_found" == b["error"]["code"] and "a, b" in b["error"]["message"]
    s, b = http("POST", url + "/v1/completions", raw=b'{"model": "a", "prompt": ', headers=AUTH)
    assert 400 == s and "malformed JSON" in b["error"]["message"]
    s, b = http("POST", url + "/v1/completions", {"model": "a", "prompt": "x", "max_tokens": -1}, AUTH)
    assert 400 == s and "max_tokens" == b["error"]["param"]
    s, b = http("POST", url + "/v1/chat/completions", {"model": "a", "messages": [{"role": "wizard", "content": "x"}]}, AUTH)
    assert 400 == s and "messages" == b["error"]["param"]
    s, b = http("POST", url + "/v1/completions", {"model": "a", "prompt": [1] * 64}, AUTH)
    assert 400 == s and "context_length_exceeded" == b["error"]["code"] and "prompt" == b["error"]["param"]
    s, b = http("POST", url + "/v1/completions", {"model": "a", "prompt": [1] * 60, "max_tokens": 10}, AUTH)
    assert 400 == s and "max_tokens" == b["error"]["param"]
    s, b = http("POST", url + "/v1/completions", {"model": "a", "prompt": [512]}, AUTH)
    assert 400 == s and "vocabulary" in b["error"]["message"]
    s, b = http("POST", url + "/v1/completions", {"model": "a", "prompt": "x"})
    assert 401 == s and "invalid_api_key" == b["error"]["code"]
    s, b = http("POST", url + "/v1/completions", {"model": WEIRD, "prompt": "x"}, AUTH)
    assert 503 == s and "model_unavailable" == b["error"]["code"]
    s, b = http("GET", url + "/nowhere")
    assert 404 == s and "no route GET /nowhere" == b["error"]["message"]
    s, b = http("GET", url + "/health")  # open without a key
    assert 503 == s and {"a": 1, "b": 1, "long": 1, WEIRD: 0} == b["instances"]  # WEIRD has no instance


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("best_of", 2, "only best_of == n"),
        ("suffix", "!", "suffix is not supported"),
        ("use_beam_search", True, "beam search"),
        ("logit_bias", {"9999": 1.0}, "outside the model's vocabulary"),
        ("logit_bias", {"5": 101.0}, "between -100 and 100"),
        ("stop", [""], "must not be empty"),
    ],
)
def test_known_field_the_engine_cannot_honour_is_a_400_naming_it(api: Api, field: str, value: object, match: str) -> None:
    s, b = http("POST", api.url + "/v1/completions", {"model": "a", "prompt": "x", field: value}, AUTH)
    assert 400 == s and field == b["error"]["param"] and match in b["error"]["message"], b


def test_echo_with_logprobs_is_refused_and_tools_too(api: Api) -> None:
    s, b = http("POST", api.url + "/v1/completions", {"model": "a", "prompt": "x", "echo": True, "logprobs": 1}, AUTH)
    assert 400 == s and "echo" == b["error"]["param"]
    s, b = http("POST", api.url + "/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": "x"}],
                                                          "tools": [{"type": "function", "function": {"name": "f"}}]}, AUTH)  # fmt: skip
    assert 400 == s and "tools" == b["error"]["param"]
    s, b = http("POST", api.url + "/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": "x"}],
                                                          "response_format": {"type": "json_object"}}, AUTH)  # fmt: skip
    assert 400 == s and "response_format" == b["error"]["param"] and "'json_object'" in b["error"]["message"]


def test_unknown_fields_are_ignored_and_logged(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="coral.runtime.serving.models"):
        s, b = http("POST", api.url + "/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 2, "frobnicate": 1}, AUTH)
    assert 200 == s and 2 == b["usage"]["completion_tokens"]
    assert "ignored: ['frobnicate']" in caplog.text


def test_openapi_schema_from_the_request_models(api: Api) -> None:
    s, schema = http("GET", api.url + "/openapi.json")
    assert 200 == s
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "logit_bias", "stop", "logprobs", "echo", "top_k", "min_p", "seed", "n"} <= set(props)
    assert "max_completion_tokens" in schema["components"]["schemas"]["ChatRequest"]["properties"]


def test_metrics_vllm_names_and_errors(api: Api) -> None:
    url = api.url
    for i in range(3):
        assert 200 == http("POST", url + "/v1/completions", {"model": "a", "prompt": [i + 3], "max_tokens": 3}, AUTH)[0]
    assert 404 == http("POST", url + "/v1/completions", {"model": "zzz", "prompt": "x"}, AUTH)[0]
    assert 401 == http("POST", url + "/v1/completions", {"model": "a", "prompt": "x"})[0]
    s, text = http("GET", url + "/metrics")  # open by default
    assert 200 == s
    assert 'vllm:request_success_total{finished_reason="length",model_name="a"} 3.0' in text
    assert 'vllm:generation_tokens_total{model_name="a"} 9.0' in text
    assert 'vllm:prompt_tokens_total{model_name="a"} 3.0' in text
    assert 'vllm:time_to_first_token_seconds_count{model_name="a"} 3.0' in text
    assert 'vllm:inter_token_latency_seconds_count{model_name="a"} 6.0' in text  # 2 gaps per request
    assert 'vllm:e2e_request_latency_seconds_count{model_name="a"} 3.0' in text
    assert 'vllm:request_queue_time_seconds_count{model_name="a"} 3.0' in text
    assert 'vllm:num_requests_running{model_name="a"}' in text and 'vllm:num_requests_waiting{model_name="a"}' in text
    assert 'vllm:kv_cache_usage_perc{model_name="a"} 0.0' in text
    assert 'coral:http_request_errors_total{code="404",model_name=""} 1.0' in text
    assert 'coral:http_request_errors_total{code="401",model_name=""} 1.0' in text
    assert 'vllm:num_requests_waiting{model_name="we\\"ird\\\\name"} 0.0' in text  # label values escaped


def test_metrics_can_require_the_key() -> None:
    a = start_api(ServerOptions(api_key="k", metrics_require_key=True))
    try:
        assert 401 == http("GET", a.url + "/metrics")[0]
        assert 200 == http("GET", a.url + "/metrics", headers={"Authorization": "Bearer k"})[0]
    finally:
        stop_api(a)


def test_a_body_is_never_parsed_as_a_request(api: Api) -> None:
    """Request smuggling: an unauthenticated POST whose body is a whole authenticated request."""
    inner_body = json.dumps({"model": "a", "prompt": [5], "max_tokens": 2}).encode()
    inner = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\nContent-Type: application/json\r\n"
             b"Content-Length: " + str(len(inner_body)).encode() + b"\r\n\r\n" + inner_body)  # fmt: skip
    outer = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(inner)).encode() + b"\r\n\r\n" + inner
    follow = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    got = raw_request(api.server.host, api.server.port, outer + follow, wait_s=1.0)
    assert 2 == got.count(b"HTTP/1.1 "), got  # the 401, then the health check: nothing in between
    assert got.startswith(b"HTTP/1.1 401") and b"HTTP/1.1 503" in got  # health: WEIRD has no instance
    assert b"token_ids" not in got
    for path in ("/nowhere", "/v1/models/zzz"):  # 404s on a kept-alive connection too
        got = raw_request(api.server.host, api.server.port, outer.replace(b"/v1/completions", path.encode(), 1) + follow, wait_s=1.0)
        assert 2 == got.count(b"HTTP/1.1 ") and b"token_ids" not in got, got
    s, text = http("GET", api.url + "/metrics")
    assert "vllm:request_success_total{" not in text  # the smuggled completion never ran


def test_conflicting_framing_is_refused_and_closed(api: Api) -> None:
    body = b"0\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    req = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    got = raw_request(api.server.host, api.server.port, req, wait_s=1.0)
    assert got.startswith(b"HTTP/1.1 400") and 1 == got.count(b"HTTP/1.1 "), got


def test_body_over_the_limit_is_413_and_closed() -> None:
    a = start_api(ServerOptions(max_body_bytes=2048))
    try:
        req = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n" + b" " * 5000
        got = raw_request(a.server.host, a.server.port, req)
        assert got.startswith(b"HTTP/1.1 413") and b"connection: close" in got.lower()
        chunked = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1000\r\n" + b" " * 4096 + b"\r\n0\r\n\r\n"
        assert raw_request(a.server.host, a.server.port, chunked).startswith(b"HTTP/1.1 413")  # no Content-Length: counted as it comes
    finally:
        stop_api(a)


def test_idle_slow_header_and_slow_body_clients_are_cut_off() -> None:
    a = start_api(ServerOptions(idle_timeout_s=0.5, header_timeout_s=1.0, body_timeout_s=0.5))
    try:
        host, port = a.server.host, a.server.port
        idle = socket.create_connection((host, port), timeout=5)
        t0 = time.monotonic()
        assert b"" == idle.recv(10)  # closed by the server, having sent nothing
        assert 0.3 < time.monotonic() - t0 < 3.0
        idle.close()
        slow = socket.create_connection((host, port), timeout=5)
        t0 = time.monotonic()
        slow.sendall(b"GET /health HTTP/1.1\r\n")
        closed = False
        for _ in range(40):  # one header byte every 0.1 s: never a whole head
            try:
                slow.sendall(b"X")
            except OSError:
                closed = True
                break
            time.sleep(0.1)
            slow.setblocking(False)
            try:
                if slow.recv(10) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            finally:
                slow.setblocking(True)
        slow.close()
        assert closed and time.monotonic() - t0 < 3.0
        got = raw_request(host, port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mod", wait_s=3.0)
        assert got.startswith(b"HTTP/1.1 408"), got
        assert wait_until(lambda: a.server.connections == 0, 3)  # all three are gone
    finally:
        stop_api(a)


def test_client_disconnect_cancels_the_request_upstream(api: Api) -> None:
    body = json.dumps({"model": "long", "prompt": [5], "max_tokens": 90_000, "stream": True}).encode()
    req = urllib.request.Request(api.url + "/v1/completions", data=body, method="POST", headers={**AUTH, "Content-Type": "application/json"})
    r = urllib.request.urlopen(req, timeout=10)
    assert r.readline().startswith(b"data: ")
    sched = api.insts[2].scheduler.core
    assert wait_until(lambda: len(sched.reqs) == 1, 5)
    r.close()  # the client goes away mid-stream
    assert wait_until(lambda: len(sched.reqs) == 0, 5)  # Cancel reached the scheduler
    assert wait_until(lambda: not api.coord._handles, 5)
    s, text = http("GET", api.url + "/metrics")
    assert 'vllm:request_success_total{finished_reason="abort",model_name="long"} 1.0' in text


def test_non_streaming_client_disconnect_cancels_too(api: Api) -> None:
    body = json.dumps({"model": "long", "prompt": [5], "max_tokens": 90_000}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\nContent-Type: application/json\r\n"
           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
    s = socket.create_connection((api.server.host, api.server.port), timeout=5)
    s.sendall(req)
    sched = api.insts[2].scheduler.core
    assert wait_until(lambda: len(sched.reqs) == 1, 5)
    s.close()
    assert wait_until(lambda: len(sched.reqs) == 0, 5)


def test_tokens_from_the_coordinator_thread_wake_the_loop_once_per_burst() -> None:
    """A batched step's tokens, put from another thread before the loop runs again, arrive in order on one wake-up."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from coral.runtime.serving.app import LoopInbox

    async def run() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        wakeups = 0

        def counting(*args: object) -> object:
            nonlocal wakeups
            wakeups += 1
            return loop.call_soon_threadsafe(*args)  # type: ignore[arg-type]

        box = LoopInbox(loop)
        box._loop = SimpleNamespace(call_soon_threadsafe=counting)  # type: ignore[assignment]
        got: list[int] = []
        done = asyncio.Event()

        def take(x: int) -> None:
            got.append(x)
            if len(got) == 100:
                done.set()

        t = threading.Thread(target=lambda: [box.put(take, i) for i in range(100)])
        t.start()
        t.join()  # the loop has not run since: all 100 ride on the first wake-up
        await asyncio.wait_for(done.wait(), 5)
        box.put(take, 100)  # after a drain, the next token schedules a new one
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return got, wakeups

    got, wakeups = asyncio.run(run())
    assert list(range(101)) == got
    assert 2 == wakeups


def test_a_token_for_a_stopped_loop_is_dropped() -> None:
    import asyncio

    from coral.runtime.serving.app import LoopInbox

    loop = asyncio.new_event_loop()
    loop.close()
    box = LoopInbox(loop)
    box.put(print, "never")  # no exception on the coordinator's thread
    box.put(print, "never either")
    assert [] == box._items
