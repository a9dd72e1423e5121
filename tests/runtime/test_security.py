"""Security on real processes: CurveZMQ between processes, API key on HTTP, size limits, fuzzed input, no pickle."""

from __future__ import annotations

import ast
import json
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coral.runtime.deploy.cluster_config import parse_cluster
from coral.runtime.deploy.deployment import Deployment
from coral.runtime.deploy.serve_cli import keys
from coral.runtime.protocol import Drain, Shutdown, encode
from coral.runtime.transport import CurveKeys

from .conftest import http

KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, CurveKeys]]:
    folder = tmp_path_factory.mktemp("curve") / "keys"
    result = CliRunner().invoke(keys, ["--dir", str(folder)])
    assert 0 == result.exit_code, result.output
    assert 0o600 == (folder / "cluster.key_secret").stat().st_mode & 0o777
    again = CliRunner().invoke(keys, ["--dir", str(folder)])
    assert 0 != again.exit_code and "already holds" in again.output  # never overwritten
    cluster = parse_cluster({
        "coordinator": {"port": 0, "api_key": KEY, "curve_keys_dir": str(folder), "max_body_bytes": 65536},
        "device": "cpu",
        "models": [{"name": "llama", "builtin": "tiny-llama", "weights": {"seed": 5}}],
        "instances": [{"name": "s", "model": "llama", "stages": [{"layers": [0, 6]}]}],
    })  # fmt: skip
    dep = Deployment(cluster, http_port=0)
    dep.start(timeout_s=120)
    try:
        yield dep, CurveKeys.load(folder)
    finally:
        dep.stop()


def _ok(dep: Deployment) -> None:
    s, b = http("POST", dep.url + "/v1/completions", {"model": "llama", "prompt": [4, 5], "max_tokens": 3, "temperature": 0}, AUTH)
    assert 200 == s and 3 == len(b["choices"][0]["token_ids"]), b
    assert [] == dep.provisioner.dead()


def _addresses(dep: Deployment) -> list[str]:
    assert dep.coordinator is not None and dep.transport is not None
    return [dep.transport.address] + [r.address for r in dep.coordinator.instances.values()]


def _push(addr: str, curve: tuple[bytes, bytes, bytes] | None) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = curve
    s.connect(addr)
    return s


def test_api_key_required(secure: tuple[Deployment, CurveKeys]) -> None:
    dep, _ = secure
    s, b = http("POST", dep.url + "/v1/completions", {"model": "llama", "prompt": "hi"})
    assert 401 == s and "invalid_api_key" == b["error"]["code"]
    assert 401 == http("POST", dep.url + "/v1/completions", {"model": "llama", "prompt": "hi"}, {"Authorization": "Bearer nope"})[0]
    assert 401 == http("POST", dep.url + "/admin/plan", {"instances": []})[0]
    assert 401 == http("GET", dep.url + "/admin/instances")[0]
    assert 401 == http("POST", dep.url + "/admin/preempt", {"node": "llama"})[0]  # the notice hook is behind the key too
    assert 200 == http("GET", dep.url + "/health")[0]
    _ok(dep)


def test_body_size_limit(secure: tuple[Deployment, CurveKeys]) -> None:
    dep, _ = secure
    s, b = http("POST", dep.url + "/v1/completions", {"model": "llama", "prompt": [1] * 40_000}, AUTH)
    assert 413 == s and "larger than 65536" in b["error"]["message"]


def test_peer_without_the_key_cannot_send_control_messages(secure: tuple[Deployment, CurveKeys]) -> None:
    dep, k = secure
    pub, sec = zmq.curve_keypair()
    assert dep.coordinator is not None
    socks = []
    for addr in _addresses(dep):
        for curve in (None, (pub, sec, k.public)):  # plain tcp; a valid keypair that is not the cluster's
            s = _push(addr, curve)
            for msg in (Drain(reason="evil"), Shutdown(reason="evil")):
                try:
                    s.send_multipart(encode(msg), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # no handshake: nothing can be sent at all
            socks.append(s)
    time.sleep(1.0)
    for s in socks:
        s.close(0)
    rec = dep.coordinator.instances["s"]
    assert ("active", "active") == (str(rec.state), rec.reported_state)
    _ok(dep)


frames = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda d: msgpack.packb(d, use_bin_type=True), st.dictionaries(
        st.sampled_from(["@", "request_id", "prompt", "reason", "tokens", "sender", "role", "hello", "sampling", "keys", "x"]),
        st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=20),
                               st.builds(msgpack.ExtType, st.integers(0, 3), st.binary(max_size=12)),
                               st.sampled_from(["Submit", "TokenOut", "Heartbeat", "Shutdown", "Drain", "Cancel", "InstanceHello"])),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=10),
        max_size=6)),
)  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batch=st.lists(frames, min_size=1, max_size=8))
def test_fuzzed_zmq_frames_never_crash(secure: tuple[Deployment, CurveKeys], batch: list[bytes]) -> None:
    dep, k = secure
    for addr in _addresses(dep):
        s = _push(addr, (k.public, k.secret, k.public))  # an authenticated peer sending garbage
        for f in batch:
            if b"Shutdown" in f or b"Drain" in f:
                continue  # well-formed control messages are legitimate from a key holder
            s.send(f)
        s.close(100)
    assert [] == dep.provisioner.dead()


def test_still_serving_after_zmq_fuzz(secure: tuple[Deployment, CurveKeys]) -> None:
    time.sleep(0.3)
    _ok(secure[0])


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=30)),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=10), c, max_size=5),
    max_leaves=20,
)
bodies = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda d: json.dumps(d).encode(), st.fixed_dictionaries(
        {"model": st.sampled_from(["llama", "x", ""])},
        optional={"prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 600), max_size=20), json_values),
                  "max_tokens": st.one_of(st.integers(-3, 300), json_values), "temperature": json_values,
                  "stream": st.booleans(), "messages": json_values, "n": json_values, "seed": json_values, "extra": json_values},
    )),
    st.builds(lambda d: json.dumps(d).encode(), json_values),
)  # fmt: skip


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/admin/plan"]), raw=bodies)
def test_fuzzed_http_bodies_never_crash(secure: tuple[Deployment, CurveKeys], path: str, raw: bytes) -> None:
    dep, _ = secure
    s, b = http("POST", dep.url + path, raw=raw, headers=AUTH, timeout_s=30)
    assert s in (200, 400, 404, 413), (s, b)
    if s != 200:
        assert "error" in b


def test_still_serving_after_http_fuzz(secure: tuple[Deployment, CurveKeys]) -> None:
    _ok(secure[0])


def test_no_pickle_on_the_wire() -> None:
    banned = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
    calls = {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized"}
    files = sorted((Path(__file__).parents[2] / "src" / "coral" / "runtime").rglob("*.py"))
    assert any(f.parent.name == "serving" for f in files)
    for py in files:
        tree = ast.parse(py.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & banned, py
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in banned, py
            elif isinstance(node, ast.Attribute):
                assert node.attr not in calls, f"{py}: {node.attr}"


def test_zz_the_cluster_key_does_get_through(secure: tuple[Deployment, CurveKeys]) -> None:
    """Positive control of the test above (last: it leaves the instance draining)."""
    dep, k = secure
    assert dep.coordinator is not None
    rec = dep.coordinator.instances["s"]
    good = _push(rec.address, (k.public, k.secret, k.public))
    good.send_multipart(encode(Drain(reason="control")))
    deadline = time.monotonic() + 5
    while rec.reported_state != "draining" and time.monotonic() < deadline:
        time.sleep(0.02)
    good.close(0)
    assert "draining" == rec.reported_state
