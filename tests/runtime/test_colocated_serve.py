"""`coral serve --plan` of a colocated instance (issue 27): one engine group whose scheduler mixes prompt
chunks into decode steps, no KV transfer. Real processes on 127.0.0.1; a tiny model with phi-4's 40 layers
stands in for phi-4, and the plan's chunk is 8 tokens, so every prompt here spans several steps."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml
from click.testing import CliRunner
from deploy.layout_plans import (  # tests/deploy (pytest puts tests/ on sys.path)
    COLOCATED,
    write_layout_plan,
)

from coral.cli import main
from coral.runtime.deploy.cluster_config import MIXED, parse_cluster
from coral.runtime.deploy.deployment import Deployment
from coral.runtime.deploy.mapping import cluster_from_plan_file
from coral.runtime.engine.model import BUILTIN_CONFIGS

from .conftest import deployment, http
from .test_pipeline_inproc import reference
from .test_serve_plan import phi_cluster
from .test_skypilot_local import CONFIG

CHUNK = 8
# 30, 19 and 9 prompt tokens: 4, 3 and 2 chunks of at most 8
PROMPTS = [[(7 * k + 3) % 500 + 5 for k in range(30)], [(11 * k + 1) % 400 + 9 for k in range(19)], list(range(20, 29))]
N = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    _, plan = write_layout_plan(tmp_path_factory.mktemp("colo"), [{**COLOCATED, "chunk_tokens": CHUNK}])
    cluster = cluster_from_plan_file(parse_cluster(phi_cluster(40)), str(plan))
    yield from deployment(cluster, timeout_s=180)


def test_a_colocated_plan_instance_serves_as_one_mixed_instance_with_the_plans_chunk(served: Deployment) -> None:
    (inst,) = served.cluster.instances
    assert (MIXED, CHUNK) == (inst.phase, inst.chunk_tokens)
    assert 1 == len(served.provisioner.engines)  # one engine group: no decode instance, no KV hand-off


def test_concurrent_prompts_longer_than_a_chunk_give_generates_tokens(served: Deployment) -> None:
    """Sent at once, the three prompts' chunks share steps with each other's decodes."""
    got: dict[int, list[int]] = {}

    def ask(k: int) -> None:
        s, b = http("POST", served.url + "/v1/completions", {"model": "phi-4", "prompt": PROMPTS[k], "max_tokens": N,
                                                              "temperature": 0}, timeout_s=120)
        assert 200 == s, b
        got[k] = b["choices"][0]["token_ids"]

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert reference(CONFIG, 3, PROMPTS, N) == [got.get(k) for k in range(len(PROMPTS))]


def test_the_openai_client_streams_from_the_colocated_instance(served: Deployment) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)
    try:
        stream = client.completions.create(model="phi-4", prompt=PROMPTS[0], max_tokens=N, temperature=0, stream=True)
        ids: list[int] = []
        finish = None
        for chunk in stream:
            for choice in chunk.choices:
                ids += list(getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids") or [])
                finish = choice.finish_reason or finish
    finally:
        client.close()
    assert (reference(CONFIG, 3, PROMPTS[:1], N)[0], "length") == (ids, finish)


def test_a_cluster_file_chunk_tokens_below_one_is_one_line_naming_the_field_exit_2(tmp_path: Path) -> None:
    cluster = {"coordinator": {"port": 0}, "device": "cpu",
               "models": [{"name": "m", "builtin": "tiny-llama", "weights": {"seed": 1}}],
               "instances": [{"name": "c", "model": "m", "phase": "mixed", "chunk_tokens": 0,
                              "stages": [{"layers": [0, BUILTIN_CONFIGS["tiny-llama"]["num_hidden_layers"]]}]}]}
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml.safe_dump(cluster))
    r = CliRunner().invoke(main, ["serve", "--config", str(cfg)])
    assert 2 == r.exit_code
    (line,) = [ln for ln in r.output.splitlines() if ln.strip()]
    assert "instances.0.chunk_tokens: Input should be greater than or equal to 1" in line
