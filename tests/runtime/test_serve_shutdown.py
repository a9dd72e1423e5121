"""`coral serve` as a user runs it: SIGTERM or SIGINT (Ctrl-C) under load drains (new requests 503 + Retry-After, the streams in
flight finish, none is cut), then it stops with exit code 0; a non-loopback bind without an API key is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from coral.cli import main
from coral.runtime.serving.loadgen import one_request

from .conftest import http, wait_until

CLUSTER = ("coordinator: {port: 0}\ndevice: cpu\nmodels:\n  - {name: t, builtin: tiny-llama}\n"
           "instances:\n  - {name: t1, model: t, stages: [{layers: [0, 3]}, {layers: [3, 6]}]}\n")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_under_load_cuts_no_stream(tmp_path: Path, sig: signal.Signals) -> None:
    cfg, ready = tmp_path / "c.yaml", tmp_path / "ready"
    cfg.write_text(CLUSTER)
    coral = str(Path(sys.executable).parent / "coral")
    proc = subprocess.Popen([coral, "serve", "--config", str(cfg), "--ready-file", str(ready), "--drain-timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        assert wait_until(ready.exists, 120, 0.1), "coral serve did not become ready"
        url = ready.read_text().strip()
        results: list = []
        streams = [threading.Thread(target=lambda k=k: results.append(one_request(url, "t", [3 + k, 7, 9], 120, timeout_s=60)))
                   for k in range(6)]  # fmt: skip
        for t in streams:
            t.start()
        assert wait_until(lambda: "vllm:num_requests_running" in http("GET", url + "/metrics")[1]
                          and sum(float(line.split()[-1]) for line in http("GET", url + "/metrics")[1].splitlines()
                                  if line.startswith("vllm:num_requests_running")) >= 1, 30)
        proc.send_signal(sig)
        assert wait_until(lambda: http("GET", url + "/health")[1].get("status") == "draining", 10)
        s, body = http("POST", url + "/v1/completions", {"model": "t", "prompt": [5], "max_tokens": 2})
        assert 503 == s and "shutting_down" == body["error"]["code"]
        for t in streams:
            t.join(timeout=90)
        out = proc.communicate(timeout=60)[0].decode()
        assert 0 == proc.returncode, out
        assert f"{sig.name}: draining" in out and "stopped" in out and "still in flight" not in out
        assert 6 == len(results)
        assert [] == [r.error for r in results if not r.ok]  # 0 cut streams
        assert all(120 == r.output_tokens and r.outcome == "completed" for r in results)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_a_public_bind_without_an_api_key_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CLUSTER.replace("coordinator: {port: 0}", "coordinator: {host: 0.0.0.0, port: 0}"))
    r = CliRunner().invoke(main, ["serve", "--config", str(cfg)])
    assert 2 == r.exit_code
    assert "coordinator.host 0.0.0.0 is reachable from other machines and coordinator.api_key is not set" in " ".join(r.output.split())
    assert "--insecure" in r.output and "Traceback" not in r.output
