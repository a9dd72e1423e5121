"""Engines and schedulers in threads over the in-process transport: tokens equal transformers' generate()."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from coral.runtime.engine.inproc import start_inproc_instance
from coral.runtime.engine.model import (
    BUILTIN_CONFIGS,
    ShardSpec,
    load_shard,
    make_config,
    seeded_state_dict,
)
from coral.runtime.protocol import Submit, TokenOut, TokenOuts
from coral.runtime.transport import InprocHub, InprocTransport

from .conftest import wait_until

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 3], [7] * 20, [42, 43, 44], [300]]


def reference(config: dict, seed: int, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of plain transformers generate(), one prompt at a time."""
    model = AutoModelForCausalLM.from_config(make_config(config))
    model.load_state_dict(seeded_state_dict(config, seed))
    model.eval()
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ids[0].tolist()[len(p):])
    return out


def collect(client: InprocTransport, n: int, timeout_s: float = 30) -> dict[str, list[TokenOut]]:
    got: dict[str, list[TokenOut]] = {}
    done = 0
    import time

    deadline = time.monotonic() + timeout_s
    while done < n and time.monotonic() < deadline:
        m = client.recv(0.5)
        if m is None:
            continue
        for out in m.outs if isinstance(m, TokenOuts) else (m,):  # a step's tokens come in one message
            got.setdefault(out.request_id, []).append(out)
            done += out.finished
    assert n == done, f"only {done} of {n} requests finished"
    return got


def submit(client: InprocTransport, to: str, prompts: list[list[int]], n: int, decode_to: str = "") -> None:
    for i, p in enumerate(prompts):
        client.send(to, Submit(request_id=f"r{i}", prompt=tuple(p), max_tokens=n, temperature=0.0, seed=0, eos_ids=(), reply_to="client", decode_to=decode_to))


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"])
def test_shard_chain_equals_generate(arch: str) -> None:
    cfg = BUILTIN_CONFIGS[arch]
    n_layers = cfg["num_hidden_layers"]
    cuts = [0, 1, n_layers - 1, n_layers]
    shards = [load_shard(ShardSpec(config=cfg, layer_start=a, layer_end=b, seed=7)) for a, b in zip(cuts, cuts[1:], strict=False)]
    want = reference(cfg, 7, PROMPTS[:2], 8)
    for prompt, expected in zip(PROMPTS[:2], want, strict=True):
        caches = [s.new_cache() for s in shards]
        inp, pos, got = list(prompt), 0, []
        for _ in range(8):
            h = None
            for s, c in zip(shards, caches, strict=True):
                h = s.forward(c, pos, tuple(inp) if s.spec.is_first else None, None if s.spec.is_first else h)
            got.append(int(torch.argmax(h)))
            pos += len(inp)
            inp = [got[-1]]
        assert expected == got


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
def test_pd_instances_resharded_kv_equal_generate(arch: str, threads: list) -> None:
    """2-stage prefill (uneven) -> 3-stage decode with 2 nodes in the middle stage."""
    cfg = BUILTIN_CONFIGS[arch]
    hub = InprocHub()
    pre = start_inproc_instance(hub, "P", config=cfg, seed=3, stages=[(0, 2, 1), (2, 6, 1)], phase="prefill")
    dec = start_inproc_instance(hub, "D", config=cfg, seed=3, stages=[(0, 1, 1), (1, 4, [1.0, 2.0]), (4, 6, 1)], phase="decode")
    client = InprocTransport(hub, "client")
    try:
        submit(client, "P", PROMPTS, 10, decode_to="D")
        got = collect(client, len(PROMPTS))
        # every KV cache is freed (the Release messages may still be on their way)
        freed = wait_until(lambda: all(0 == e.held_sequences() for e in pre.engines + dec.engines), 10)
    finally:
        pre.stop()
        dec.stop()
    want = reference(cfg, 3, PROMPTS, 10)
    for i, expected in enumerate(want):
        msgs = got[f"r{i}"]
        assert [] == [m.error for m in msgs if m.error]
        assert expected == [t for m in msgs for t in m.tokens]
        assert "length" == msgs[-1].finish_reason
    # every KV cache was freed, and both middle-stage decode nodes got work (weighted round-robin)
    assert freed
    middle = [e.items_served for e in dec.engines if e.stage == 1]
    assert 2 == len(middle) and all(n > 0 for n in middle)


def test_mixed_instance_continuous_batching_and_eos(threads: list) -> None:
    """More requests than a micro-batch holds; one stops on an eos id."""
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    hub = InprocHub()
    inst = start_inproc_instance(hub, "M", config=cfg, seed=3, stages=[(0, 3, 1), (3, 6, 1)])
    inst.scheduler.max_batch_requests = 2
    client = InprocTransport(hub, "client")
    want = reference(cfg, 3, PROMPTS, 6)
    eos = want[0][2]  # request 0 must stop after its third token
    try:
        for i, p in enumerate(PROMPTS):
            client.send("M", Submit(request_id=f"r{i}", prompt=tuple(p), max_tokens=6, temperature=0.0, seed=0, eos_ids=(eos,) if i == 0 else (), reply_to="client"))
        got = collect(client, len(PROMPTS))
    finally:
        inst.stop()
    assert want[0][:3] == [t for m in got["r0"] for t in m.tokens]
    assert "stop" == got["r0"][-1].finish_reason
    for i in range(1, len(PROMPTS)):
        assert want[i] == [t for m in got[f"r{i}"] for t in m.tokens]


def test_engine_error_ends_request_with_error(threads: list) -> None:
    """A token id outside the vocabulary fails that request only; the others complete."""
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    hub = InprocHub()
    inst = start_inproc_instance(hub, "M", config=cfg, seed=3, stages=[(0, 6, 1)])
    client = InprocTransport(hub, "client")
    try:
        submit(client, "M", [[1, 2, 3], [99999], [4, 5]], 3)
        got = collect(client, 3)
    finally:
        inst.stop()
    assert got["r1"][-1].finish_reason == "error" and got["r1"][-1].error
    assert 3 == len([t for m in got["r0"] for t in m.tokens])
    assert 3 == len([t for m in got["r2"] for t in m.tokens])


def test_sampling_is_seeded_and_placement_independent(threads: list) -> None:
    cfg = BUILTIN_CONFIGS["tiny-qwen3"]
    hub = InprocHub()
    a = start_inproc_instance(hub, "A", config=cfg, seed=1, stages=[(0, 6, 1)])
    b = start_inproc_instance(hub, "B", config=cfg, seed=1, stages=[(0, 2, 1), (2, 6, 1)])
    client = InprocTransport(hub, "client")
    try:
        for to in ("A", "B"):
            client.send(to, Submit(request_id=to, prompt=(9, 8, 7), max_tokens=8, temperature=1.0, seed=42, eos_ids=(), reply_to="client"))
        got = collect(client, 2)
    finally:
        a.stop()
        b.stop()
    assert [t for m in got["A"] for t in m.tokens] == [t for m in got["B"] for t in m.tokens]
