"""The HTTP front end over an in-process coordinator and no-op instances: API shape, errors, auth, metrics."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from coral.runtime.coordinator import Coordinator, ModelInfo
from coral.runtime.http_api import ApiServer, ByteTokenizer
from coral.runtime.inproc import start_inproc_instance
from coral.runtime.transport import InprocHub, InprocTransport

from .conftest import http, wait_until


@pytest.fixture
def api() -> Iterator[tuple[str, Coordinator]]:
    hub = InprocHub()
    coord = Coordinator(InprocTransport(hub, "coord"), [
        ModelInfo(name="a", max_context=64, vocab_size=512, eos_ids=()),
        ModelInfo(name="b", max_context=64, vocab_size=512, eos_ids=()),
    ])  # fmt: skip
    coord.start()
    insts = [
        start_inproc_instance(hub, "a1", config=None, stages=[(0, 2, 1), (2, 4, 1)], model="a", coordinator="coord"),
        start_inproc_instance(hub, "b1", config=None, stages=[(0, 4, 1)], model="b", coordinator="coord"),
    ]
    server = ApiServer(coord, api_key="sekret", token_timeout_s=10)
    server.start()
    assert wait_until(lambda: len(coord.instances) == 2, 10)
    yield server.url, coord
    server.stop()
    coord.stop()
    for i in insts:
        i.stop()


AUTH = {"Authorization": "Bearer sekret"}


def test_completion_chat_and_models(api: tuple[str, Coordinator]) -> None:
    url, _ = api
    status, body = http("POST", url + "/v1/completions", {"model": "a", "prompt": [5, 6], "max_tokens": 4, "temperature": 0}, AUTH)
    assert 200 == status
    choice = body["choices"][0]
    assert 4 == len(choice["token_ids"]) and "length" == choice["finish_reason"]
    assert {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6} == body["usage"]
    status, body = http("POST", url + "/v1/chat/completions", {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, AUTH)
    assert 200 == status and "assistant" == body["choices"][0]["message"]["role"]
    assert len(ByteTokenizer.encode("<|user|>\nhi\n<|assistant|>\n")) == body["usage"]["prompt_tokens"]
    status, body = http("GET", url + "/v1/models", headers=AUTH)
    assert ["a", "b"] == [m["id"] for m in body["data"]]


def test_streaming_chunks(api: tuple[str, Coordinator]) -> None:
    url, _ = api
    import json
    import urllib.request

    req = urllib.request.Request(url + "/v1/completions", method="POST", headers=AUTH,
                                 data=json.dumps({"model": "a", "prompt": "hey", "max_tokens": 5, "stream": True,
                                                  "stream_options": {"include_usage": True}}).encode())  # fmt: skip
    with urllib.request.urlopen(req, timeout=10) as r:
        assert "text/event-stream" == r.headers["Content-Type"]
        lines = [ln for ln in r.read().decode().split("\n\n") if ln]
    assert "data: [DONE]" == lines[-1]
    events = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert 5 == sum(len(e["choices"][0]["token_ids"]) for e in events if e["choices"])
    assert 5 == events[-1]["usage"]["completion_tokens"]


def test_errors_in_openai_shape(api: tuple[str, Coordinator]) -> None:
    url, coord = api
    s, b = http("POST", url + "/v1/completions", {"model": "zzz", "prompt": "x"}, AUTH)
    assert 404 == s and "model_not_found" == b["error"]["code"] and "a, b" in b["error"]["message"]
    s, b = http("POST", url + "/v1/completions", raw=b'{"model": "a", "prompt": ', headers=AUTH)
    assert 400 == s and "malformed JSON" in b["error"]["message"]
    s, b = http("POST", url + "/v1/completions", {"model": "a", "prompt": "x", "max_tokens": -1}, AUTH)
    assert 400 == s and "max_tokens" == b["error"]["param"]
    s, b = http("POST", url + "/v1/completions", {"model": "a", "prompt": "x", "frobnicate": 1}, AUTH)
    assert 400 == s and "frobnicate" == b["error"]["param"]
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
    s, b = http("GET", url + "/nowhere")
    assert 404 == s and "error" in b
    s, b = http("GET", url + "/health")  # open without a key
    assert 200 == s and {"a": 1, "b": 1} == b["instances"]


def test_metrics_account_every_request(api: tuple[str, Coordinator]) -> None:
    url, _ = api
    for i in range(3):
        assert 200 == http("POST", url + "/v1/completions", {"model": "a", "prompt": [i + 3], "max_tokens": 3}, AUTH)[0]
    s, text = http("GET", url + "/metrics", headers=AUTH)
    assert 200 == s
    assert 'coral_requests_total{model="a",status="ok"} 3' in text
    assert 'coral_generation_tokens_total{model="a"} 9' in text
    assert 'coral_ttft_seconds_count{model="a"} 3' in text
    assert 'coral_tpot_seconds_bucket{model="a",le="+Inf"} 3' in text
