"""Real processes on 127.0.0.1: coordinator + HTTP here, schedulers and engines as child processes.

Two models at once, each with a 2-stage prefill instance (uneven split) and a 3-stage
decode instance (different split, 2 nodes in one stage), KV re-sharded between them.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
import zmq

from coral.errors import CoralError
from coral.runtime.deploy.cluster_config import load_cluster, parse_cluster, parse_instances
from coral.runtime.deploy.deployment import Deployment
from coral.runtime.engine.model import BUILTIN_CONFIGS

from .conftest import deployment, http, sse, wait_until
from .test_pipeline_inproc import reference

CLUSTER = {
    "coordinator": {"port": 0},
    "device": "cpu",
    "models": [
        {"name": "llama", "builtin": "tiny-llama", "weights": {"seed": 11}},
        {"name": "qwen3", "hf_config": BUILTIN_CONFIGS["tiny-qwen3"], "weights": {"seed": 12}},
    ],
    "instances": [
        {"name": "llama-p", "model": "llama", "phase": "prefill", "region": "r1", "stages": [{"layers": [0, 2]}, {"layers": [2, 6]}]},
        {"name": "llama-d", "model": "llama", "phase": "decode", "region": "r1",
         "stages": [{"layers": [0, 1]}, {"layers": [1, 4], "nodes": [1.0, 2.0]}, {"layers": [4, 6]}]},
        {"name": "qwen3-p", "model": "qwen3", "phase": "prefill", "region": "r1", "stages": [{"layers": [0, 4]}, {"layers": [4, 6]}]},
        {"name": "qwen3-d", "model": "qwen3", "phase": "decode", "region": "r1",
         "stages": [{"layers": [0, 2], "nodes": 2}, {"layers": [2, 3]}, {"layers": [3, 6]}]},
    ],
}  # fmt: skip

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 3], [7] * 30, [42, 43, 44], [300], list(range(20, 60))]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Deployment]:
    yield from deployment(CLUSTER)


@pytest.mark.parametrize(("model", "seed", "arch"), [("llama", 11, "tiny-llama"), ("qwen3", 12, "tiny-qwen3")])
def test_pd_greedy_tokens_equal_generate(cluster: Deployment, model: str, seed: int, arch: str) -> None:
    n = 12
    body = lambda p: {"model": model, "prompt": p, "max_tokens": n, "temperature": 0}  # noqa: E731
    with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
        results = list(ex.map(lambda p: http("POST", cluster.url + "/v1/completions", body(p)), PROMPTS))
    want = reference(BUILTIN_CONFIGS[arch], seed, PROMPTS, n)
    eos = BUILTIN_CONFIGS[arch]["eos_token_id"]
    for (status, b), expected in zip(results, want, strict=True):
        assert 200 == status, b
        if eos in expected:  # generate() was told not to stop; the server stops at eos
            expected = expected[: expected.index(eos) + 1]
        assert expected == b["choices"][0]["token_ids"]


def test_two_models_listed_and_routed(cluster: Deployment) -> None:
    status, body = http("GET", cluster.url + "/v1/models")
    assert 200 == status and ["llama", "qwen3"] == [m["id"] for m in body["data"]]
    s, b = http("POST", cluster.url + "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert 404 == s and "llama, qwen3" in b["error"]["message"]


def test_streaming_first_chunk_before_last_token(cluster: Deployment) -> None:
    t0 = time.perf_counter()
    events = sse(cluster.url + "/v1/chat/completions", {"model": "llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 40, "temperature": 0, "stream": True})
    assert "[DONE]" == events[-1][1]
    token_events = [(t, e) for t, e in events[:-1] if e["choices"] and e["choices"][0].get("token_ids")]
    assert 1 <= len(token_events) <= 40
    first, last = token_events[0][0], token_events[-1][0]
    # produced one at a time: the first arrives well before the last
    assert first - t0 < last - t0
    assert len(token_events) == 40 or token_events[-1][1]["choices"][0]["finish_reason"] == "stop"


def test_bad_zmq_messages_do_not_kill_processes(cluster: Deployment) -> None:
    assert cluster.coordinator is not None
    ctx = zmq.Context.instance()
    for rec in cluster.coordinator.instances.values():
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(rec.address)
        s.send(b"\x93junk")
        s.send(b"\x81\xa1@\xa6Pickle")
        s.close()
    time.sleep(0.3)
    assert [] == cluster.provisioner.dead()
    s, b = http("POST", cluster.url + "/v1/completions", {"model": "qwen3", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})
    assert 200 == s and 3 == len(b["choices"][0]["token_ids"])


def test_prompt_longer_than_context(cluster: Deployment) -> None:
    s, b = http("POST", cluster.url + "/v1/completions", {"model": "llama", "prompt": [1] * 300})
    assert 400 == s and "prompt" == b["error"]["param"]


def test_every_request_accounted(cluster: Deployment) -> None:
    assert cluster.coordinator is not None
    text = http("GET", cluster.url + "/metrics")[1]
    done = sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith("vllm:request_success_total{"))
    # every request that reached an instance ended and was counted: 2 x PROMPTS, 1 stream, 1 after junk
    assert 2 * len(PROMPTS) + 2 == done
    assert 0 == len(cluster.coordinator._handles)


def test_cluster_file_errors(tmp_path: Path) -> None:
    bad = {**CLUSTER, "instances": [{**CLUSTER["instances"][0], "stages": [{"layers": [0, 2]}, {"layers": [3, 6]}]}]}
    with pytest.raises(CoralError, match="contiguous"):
        parse_cluster(bad)
    with pytest.raises(CoralError, match="models.0.weightz"):
        parse_cluster({**CLUSTER, "models": [{"name": "x", "builtin": "tiny-llama", "weightz": 1}]})
    with pytest.raises(CoralError, match="unknown model 'nope'"):
        parse_cluster({**CLUSTER, "instances": [{**CLUSTER["instances"][0], "model": "nope"}]})
    with pytest.raises(CoralError, match="not found"):
        load_cluster(tmp_path / "missing.yaml")
    # one check for both the cluster file and a plan pushed at run time
    twice = [CLUSTER["instances"][0], CLUSTER["instances"][0]]
    with pytest.raises(CoralError, match="cluster file: duplicate instance names"):
        parse_cluster({**CLUSTER, "instances": twice})
    with pytest.raises(CoralError, match="plan: duplicate instance names"):
        parse_instances({"instances": twice}, parse_cluster(CLUSTER))


def test_example_cluster_file_is_valid() -> None:
    spec = load_cluster(Path(__file__).parents[2] / "examples" / "cluster-tiny.yaml")
    assert {"tiny-llama", "tiny-qwen3"} == {m.name for m in spec.models}


def test_serve_cli_starts_serves_and_stops(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "coordinator: {port: 0}\ndevice: cpu\nmodels:\n  - {name: t, builtin: tiny-llama}\n"
        "instances:\n  - {name: t1, model: t, stages: [{layers: [0, 6]}]}\n"
    )
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "coral.runtime.deploy.serve_cli", "--config", str(cfg), "--ready-file", str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        assert wait_until(ready.exists, 90, 0.1), "coral serve did not become ready"
        url = ready.read_text().strip()
        s, b = http("POST", url + "/v1/completions", {"model": "t", "prompt": "hi", "max_tokens": 2})
        assert 200 == s and 2 == b["usage"]["completion_tokens"]
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0].decode()
        assert 0 == proc.returncode, out
        assert "stopped" in out
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_specs_reuse_the_domain_phase_and_model_spec() -> None:
    from coral.catalog.models import ModelSpec
    from coral.perf.model import Phase
    from coral.runtime.deploy.cluster_config import MIXED

    spec = load_cluster(Path(__file__).resolve().parents[2] / "examples" / "cluster-tiny.yaml")
    phases = {i.name: i.phase for i in spec.instances}
    assert Phase.PREFILL == phases["llama-prefill"] and isinstance(phases["llama-prefill"], Phase)
    assert Phase.DECODE == phases["llama-decode"] and MIXED == phases["qwen3-mixed"]
    llama = spec.model("tiny-llama")
    assert isinstance(llama.spec, ModelSpec)
    assert (6, 64, 4, 2, "LlamaForCausalLM") == (llama.spec.num_layers, llama.spec.hidden_size, llama.spec.num_heads,
                                                 llama.spec.num_kv_heads, llama.spec.architecture)
    assert llama.num_layers == llama.spec.num_layers
    # the YAML and its errors are unchanged: a bad phase still names the field and the choices
    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "cluster-tiny.yaml").read_text())
    data["instances"][0]["phase"] = "both"
    with pytest.raises(CoralError, match=r"instances\.0\.phase: Input should be 'prefill', 'decode' or 'mixed'"):
        parse_cluster(data)
