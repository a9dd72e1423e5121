"""Devices and tensor parallelism: a TP=2 node over gloo serves generate()'s tokens; one CUDA check."""

from __future__ import annotations

import pytest
import torch

from coral.errors import CoralError
from coral.runtime.deploy.cluster_config import parse_cluster
from coral.runtime.deploy.deployment import Deployment
from coral.runtime.engine.model import BUILTIN_CONFIGS

from .conftest import http
from .test_pipeline_inproc import PROMPTS, reference


def _cluster(instances: list[dict]) -> dict:
    return {
        "coordinator": {"port": 0}, "device": "cpu",
        "models": [{"name": "t", "builtin": "tiny-llama", "weights": {"seed": 3}}],
        "instances": instances,
    }  # fmt: skip


def test_tensor_parallel_nodes_with_pd_hand_off_equal_generate() -> None:
    """Prefill: [0,2) then [2,6) on a 2-device node; decode: [0,4) on a 2-device node then [4,6)."""
    spec = parse_cluster(_cluster([
        {"name": "p", "model": "t", "phase": "prefill", "stages": [{"layers": [0, 2]}, {"layers": [2, 6], "tp": 2}]},
        {"name": "d", "model": "t", "phase": "decode", "stages": [{"layers": [0, 4], "tp": 2}, {"layers": [4, 6]}]},
    ]))  # fmt: skip
    dep = Deployment(spec, http_port=0)
    dep.start(timeout_s=180)
    try:
        assert 4 + 2 == sum(1 for n in dep.provisioner.engines)  # 4 nodes, 2 of them with a follower rank
        got = []
        for p in PROMPTS[:3]:
            status, body = http("POST", dep.url + "/v1/completions", {"model": "t", "prompt": p, "max_tokens": 8, "temperature": 0})
            assert 200 == status, body
            got.append(body["choices"][0]["token_ids"])
    finally:
        dep.stop()
    assert reference(BUILTIN_CONFIGS["tiny-llama"], 3, PROMPTS[:3], 8) == got


def test_tp_that_does_not_divide_the_model_is_refused() -> None:
    with pytest.raises(CoralError, match=r"stage 0: tp 4 must divide the model's num_key_value_heads \(2\)"):
        parse_cluster(_cluster([{"name": "i", "model": "t", "stages": [{"layers": [0, 6], "tp": 4}]}]))
    moe = _cluster([{"name": "i", "model": "t", "stages": [{"layers": [0, 4], "tp": 2}]}])
    moe["models"][0]["builtin"] = "tiny-qwen3-moe"
    with pytest.raises(CoralError, match="not supported for mixture-of-experts"):
        parse_cluster(moe)
    with pytest.raises(CoralError, match="devices lists 1 device"):
        parse_cluster(_cluster([{"name": "i", "model": "t", "stages": [{"layers": [0, 6], "nodes": 2, "devices": ["cuda:0"]}]}]))
    with pytest.raises(CoralError, match="'gpu0' is not cpu or cuda:N"):
        parse_cluster(_cluster([{"name": "i", "model": "t", "stages": [{"layers": [0, 6], "devices": ["gpu0"]}]}]))


def test_engines_get_one_device_each_in_order() -> None:
    from coral.runtime.deploy.provisioner import LocalProvisioner

    spec = parse_cluster(_cluster([
        {"name": "a", "model": "t", "stages": [{"layers": [0, 3], "nodes": 2}, {"layers": [3, 6], "tp": 2}]},
        {"name": "b", "model": "t", "stages": [{"layers": [0, 6], "devices": ["cuda:5"]}]},
    ]))  # fmt: skip
    prov = LocalProvisioner()
    sent: list[tuple[str, dict]] = []
    prov._spawn = lambda name, role, spec: None  # type: ignore[method-assign]
    prov._spawn_engine = lambda name, spec, types: sent.append((name, spec))  # type: ignore[method-assign]
    for inst in spec.instances:
        prov.start_instance(inst, spec.models[0], spec, "tcp://127.0.0.1:1")
    got = {name: (s["shard"]["device"], s["device_index"], s.get("tp", {}).get("rank")) for name, s in sent}
    assert {
        "a/0/0": ("cpu", 0, None), "a/0/1": ("cpu", 1, None), "a/1/0": ("cpu", 2, 0), "a/1/0/tp1": ("cpu", 2, 1),
        "b/0/0": ("cuda", 5, None),
    } == got  # fmt: skip


def test_engines_of_one_machine_take_their_own_gpus_of_its_block() -> None:
    """A plan's 4xL40S as 2 x TP2 and a 4xL40S as four TP1 groups over two stages, then two whole 1xL4:
    each machine takes a block of its node's GPUs, each engine its own GPUs of the block."""
    from coral.runtime.deploy.provisioner import LocalProvisioner

    spec = parse_cluster(_cluster([
        {"name": "a", "model": "t", "stages": [{"layers": [0, 6], "nodes": 2, "tp": 2, "configs": ["4xL40S/tp2"] * 2, "hosts": [0, 0]}]},
        {"name": "b", "model": "t", "stages": [{"layers": [0, 3], "nodes": 2, "configs": ["4xL40S/tp1"] * 2, "hosts": [0, 0]},
                                               {"layers": [3, 6], "nodes": 2, "configs": ["4xL40S/tp1"] * 2, "hosts": [0, 0]}]},
        {"name": "c", "model": "t", "stages": [{"layers": [0, 6], "nodes": 2, "tp": [1, 1], "configs": ["1xL4"] * 2, "hosts": [0, 1]}]},
    ]))  # fmt: skip
    prov = LocalProvisioner()
    sent: list[tuple[str, dict]] = []
    prov._spawn = lambda name, role, spec: None  # type: ignore[method-assign]
    prov._spawn_engine = lambda name, spec, types: sent.append((name, spec))  # type: ignore[method-assign]
    for inst in spec.instances:
        prov.start_instance(inst, spec.models[0], spec, "tcp://127.0.0.1:1")
    got = {name: (s["device_index"], s.get("tp", {}).get("rank")) for name, s in sent}
    assert {
        "a/0/0": (0, 0), "a/0/0/tp1": (0, 1), "a/0/1": (2, 0), "a/0/1/tp1": (2, 1),
        "b/0/0": (4, None), "b/0/1": (5, None), "b/1/0": (6, None), "b/1/1": (7, None),
        "c/0/0": (8, None), "c/0/1": (9, None),
    } == got  # fmt: skip


def test_a_tp_vllm_refuses_names_heads_kv_heads_and_the_valid_degrees() -> None:
    with pytest.raises(CoralError, match=r"stage 0: tp 3: .* \(4 heads, 2 KV heads\); valid TP degrees: 1, 2, 4"):
        parse_cluster(_cluster([{"name": "i", "model": "t", "stages": [{"layers": [0, 6], "tp": 3}]}]))
    with pytest.raises(CoralError, match=r"stage 0: tp 3: "):
        parse_cluster(_cluster([{"name": "i", "model": "t", "stages": [{"layers": [0, 6], "nodes": 2, "tp": [1, 3]}]}]))
    with pytest.raises(CoralError, match=r"tp lists 1 degree\(s\) for 2 node\(s\)"):
        parse_cluster(_cluster([{"name": "i", "model": "t", "stages": [{"layers": [0, 6], "nodes": 2, "tp": [1]}]}]))


def test_a_cluster_file_with_a_refused_tp_exits_2_in_one_line(tmp_path) -> None:
    import yaml
    from click.testing import CliRunner

    from coral.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(_cluster([{"name": "i", "model": "t", "stages": [{"layers": [0, 6], "tp": 3}]}])))
    r = CliRunner().invoke(main, ["serve", "--config", str(cfg)])
    assert 2 == r.exit_code
    assert "valid TP degrees: 1, 2, 4" in " ".join(r.output.split()) and "Traceback" not in r.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_batched_pass_matches_generate_on_the_device() -> None:
    from coral.runtime.engine.model import ShardSpec, load_shard

    from .test_engine_batched import hf_model

    cfg = BUILTIN_CONFIGS["tiny-llama"]
    shard = load_shard(ShardSpec(config=cfg, layer_start=0, layer_end=6, seed=7, device="cuda:0", dtype="bfloat16"))
    kv = shard.new_kv_cache(max_tokens_wanted=4096)
    assert kv.keys[0].is_cuda and torch.bfloat16 == kv.keys[0].dtype
    prompts = PROMPTS[:3]
    model = hf_model(cfg, 7).to("cuda:0", torch.bfloat16)
    want = [model.generate(torch.tensor([p], device="cuda:0"), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()[len(p):] for p in prompts]
    pos, pending, got = [0] * 3, [list(p) for p in prompts], [[] for _ in prompts]
    for _ in range(6):
        meta = kv.prepare([(f"r{i}", pos[i], len(pending[i])) for i in range(3)])
        out = shard.forward_batch(meta, torch.tensor([t for q in pending for t in q]), None)
        for i, t in enumerate(torch.argmax(out, -1).tolist()):
            pos[i] += len(pending[i])
            pending[i] = [t]
            got[i].append(t)
    agree = sum(a == b for w, g in zip(want, got, strict=True) for a, b in zip(w, g, strict=True))
    assert agree >= 16  # bf16: padded and unpadded attention may round differently; most tokens agree
