"""`coral serve --plan` of a hand-made plan whose stages are TP groups of one node: an in-node pipeline of
four `4xL40S/tp1` engines for prefill, two whole 1xL4 for decode, the first token emitted by the decode
instance (`first_token: decode`, vLLM's P/D); a tiny model with phi-4's 40 layers stands in for phi-4."""
from __future__ import annotations

from pathlib import Path

from deploy.layout_plans import (  # tests/deploy (pytest puts tests/ on sys.path)
    DECODE,
    PP4,
    write_layout_plan,
)

from coral.runtime.deploy.cluster_config import parse_cluster
from coral.runtime.deploy.deployment import Deployment
from coral.runtime.deploy.mapping import cluster_from_plan_file

from .conftest import http
from .test_pipeline_inproc import reference
from .test_serve_plan import phi_cluster
from .test_skypilot_local import CONFIG


def test_an_in_node_pipeline_and_decode_first_token_serve_generates_tokens(tmp_path: Path) -> None:
    _, plan = write_layout_plan(tmp_path, [PP4, DECODE], first_token="decode")
    cluster = cluster_from_plan_file(parse_cluster(phi_cluster(40)), str(plan))
    assert "decode" == cluster.model("phi-4").first_token
    pre, dec = cluster.instances
    assert [((0,), ("4xL40S/tp1",))] * 4 == [(st.hosts, st.configs) for st in pre.stages]
    dep = Deployment(cluster, http_port=0)
    dep.start(timeout_s=180)
    try:
        assert 4 + 2 == len(dep.provisioner.engines)  # one engine per stage entry
        prompts = [[1, 2, 3], [7] * 12, [40, 41]]
        got = []
        for p in prompts:
            s, b = http("POST", dep.url + "/v1/completions", {"model": "phi-4", "prompt": p, "max_tokens": 4, "temperature": 0})
            assert 200 == s, b
            got.append(b["choices"][0]["token_ids"])
        s, b = http("POST", dep.url + "/v1/completions", {"model": "phi-4", "prompt": [5], "max_tokens": 1, "temperature": 0})
        assert 200 == s and 1 == len(b["choices"][0]["token_ids"])  # ends on its first token: at the prefill instance
    finally:
        dep.stop()
    assert reference(CONFIG, 3, prompts, 4) == got
