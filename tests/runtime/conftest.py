"""Shared fixtures of the runtime tests: every test here is marked ``runtime``."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("zmq")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/runtime" in str(item.fspath):
            item.add_marker(pytest.mark.runtime)


def deployment(cluster: Any, timeout_s: float = 120, **kw: Any) -> Iterator[Any]:
    """A module fixture's body: the deployment of `cluster` (a cluster file's dict, or a parsed one) on
    127.0.0.1 (any free port), stopped after."""
    from coral.runtime.deploy.cluster_config import parse_cluster
    from coral.runtime.deploy.deployment import Deployment

    d = Deployment(parse_cluster(cluster) if isinstance(cluster, dict) else cluster, http_port=0, **kw)
    d.start(timeout_s=timeout_s)
    try:
        yield d
    finally:
        d.stop()


def wait_until(pred: Callable[[], bool], timeout_s: float, poll_s: float = 0.01) -> bool:
    """Poll ``pred`` until true or ``timeout_s`` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(poll_s)
    return bool(pred())


def http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None, raw: bytes | None = None, timeout_s: float = 30) -> tuple[int, Any]:
    """One HTTP request; returns (status, parsed JSON or text)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def sse(url: str, body: Any, timeout_s: float = 30) -> list[tuple[float, Any]]:
    """POST a streaming request; returns (arrival time, parsed event) per ``data:`` line."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"})
    out: list[tuple[float, Any]] = []
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: "):]
            out.append((time.perf_counter(), payload.decode() if payload == b"[DONE]" else json.loads(payload)))
    return out


@pytest.fixture
def threads() -> Iterator[list[tuple[threading.Thread, threading.Event]]]:
    """Collects (thread, stop event) pairs and stops them all after the test."""
    started: list[tuple[threading.Thread, threading.Event]] = []
    yield started
    for _t, ev in started:
        ev.set()
    for t, _ev in started:
        t.join(timeout=5)


@dataclass(kw_only=True)
class ClientThreads:
    """Closed-loop load: `clients` threads run `_client(k)` until `stop` is set; `with` starts them
    and joins them on exit (a thread still alive 40 s after the stop fails the test: a hung client).
    A subclass, a dataclass, declares `clients` (with its own fields): a field here would be
    ordered before the subclass's own. These are the counters and handles every load shares."""

    sent: int = 0
    completed: int = 0
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)

    def _client(self, k: int) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        self.threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(self.clients)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=40)
        assert not any(t.is_alive() for t in self.threads), "a client hung"
