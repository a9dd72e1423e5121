"""The batched engine: one pass per micro-batch equals generate(), the KV pool's accounting, preemption, node loss."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from coral.runtime.engine.inproc import start_inproc_instance
from coral.runtime.engine.kv_cache import BlockPool, KvCacheFull, blocks_for
from coral.runtime.engine.model import (
    BUILTIN_CONFIGS,
    ShardSpec,
    load_shard,
    make_config,
    seeded_state_dict,
)
from coral.runtime.engine.sampling import sample_batch
from coral.runtime.protocol import SamplingParams, Submit, TokenOut, TokenOuts
from coral.runtime.transport import InprocHub, InprocTransport

from .conftest import wait_until
from .test_pipeline_inproc import PROMPTS, collect, reference

SLIDING_QWEN3 = {
    **BUILTIN_CONFIGS["tiny-qwen3"], "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0,
    "layer_types": ["sliding_attention", "full_attention"] * 3,
}  # fmt: skip


def hf_model(config: dict, seed: int) -> AutoModelForCausalLM:
    """The Hugging Face model of `config` with the seeded weights the engine builds for `seed`."""
    model = AutoModelForCausalLM.from_config(make_config(config))
    model.load_state_dict(seeded_state_dict(config, seed))
    return model.eval()


def _hf_logits(model: AutoModelForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1]


def _batched_chain(config: dict, seed: int, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of 3 shards run batched; request i joins at step i (prefill rows beside decode rows)."""
    layers = config["num_hidden_layers"]
    cuts = [0, 1, layers - 1, layers]
    shards = [load_shard(ShardSpec(config=config, layer_start=a, layer_end=b, seed=seed)) for a, b in zip(cuts, cuts[1:], strict=False)]
    caches = [s.new_kv_cache(max_tokens_wanted=2048, block_size=4) for s in shards]
    pos = [0] * len(prompts)
    pending = [list(p) for p in prompts]
    got: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(g) < n for g in got):
        rows = [i for i in range(len(prompts)) if i <= step and len(got[i]) < n]
        ids = torch.tensor([t for i in rows for t in pending[i]])
        h = None
        for s, kv in zip(shards, caches, strict=True):
            meta = kv.prepare([(f"r{i}", pos[i], len(pending[i])) for i in rows])
            h = s.forward_batch(meta, ids if s.spec.is_first else None, None if s.spec.is_first else h)
        assert h is not None and (len(rows), config["vocab_size"]) == tuple(h.shape)
        for i, t in zip(rows, torch.argmax(h, -1).tolist(), strict=True):
            pos[i] += len(pending[i])
            pending[i] = [t]
            got[i].append(t)
        step += 1
    return got


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "sliding-qwen3"])
def test_batched_pass_equals_generate(arch: str) -> None:
    """Ragged prefill and decode in one pass per stage give generate()'s greedy tokens.

    A divergence is accepted only where generate()'s own top-2 logits tie within 1e-5.
    """
    cfg = SLIDING_QWEN3 if arch == "sliding-qwen3" else BUILTIN_CONFIGS[arch]
    prompts = PROMPTS + [[11, 12, 13, 14, 15, 16, 17, 18, 19]]
    want = reference(cfg, 7, prompts, 10)
    got = _batched_chain(cfg, 7, prompts, 10)
    model = hf_model(cfg, 7)
    ties = 0
    for p, w, g in zip(prompts, want, got, strict=True):
        k = next((j for j, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), None)
        if k is None:
            assert w == g
            continue
        top2 = torch.topk(_hf_logits(model, p + w[:k]), 2).values
        assert float(top2[0] - top2[1]) < 1e-5, f"diverged at token {k} without a tie: {w} vs {g}"
        ties += 1
    assert ties <= 1  # a tie is rare: most rows must match outright


def test_block_pool_accounting() -> None:
    # 5 blocks of 4 tokens: a 9-token sequence takes ceil(9/4) = 3 blocks, growing to 12 takes none more
    pool = BlockPool(5, 4)
    assert 3 == len(pool.grow("a", 9))
    assert 2 == pool.num_free
    assert 0 == pool.extra_blocks("a", 12) and 1 == pool.extra_blocks("a", 13)
    assert not pool.can_grow("b", 9)
    with pytest.raises(KvCacheFull, match="needs 3 more block"):
        pool.grow("b", 9)
    assert 2 == pool.num_free and "b" not in pool  # a refused grow allocates nothing
    assert 3 == pool.free("a") and 5 == pool.num_free and 0 == pool.free("a")
    assert 3 == blocks_for(9, 4) and 20 == pool.capacity_tokens
    with pytest.raises(ValueError, match="at least|>= 1 block"):
        BlockPool(0, 4)


def test_kv_budget_follows_kv_cache_gib() -> None:
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    shard = load_shard(ShardSpec(config=cfg, layer_start=0, layer_end=3, seed=0))
    # 3 layers x (K and V) x 2 kv heads x 16 dims x 4 bytes = 768 bytes a token; 1 MiB -> 1365 tokens -> 85 blocks of 16
    assert 768 == shard.kv_bytes_per_token
    kv = shard.new_kv_cache(max_tokens_wanted=10**9, kv_cache_gib=1 / 1024)
    assert 2**20 // (768 * 16) == kv.pool.num_blocks
    assert kv.budget_bytes <= 2**20


def _submit_all(client: InprocTransport, to: str, prompts: list[list[int]], n: int) -> None:
    for i, p in enumerate(prompts):
        client.send(to, Submit(request_id=f"r{i}", prompt=tuple(p), max_tokens=n, temperature=0.0, seed=0, eos_ids=(), reply_to="client"))


def test_full_pool_queues_and_preempts_by_recompute(threads: list) -> None:
    """A pool of 6 blocks of 4 tokens (24 tokens) serves 5 requests of up to 20 + 12 tokens: queueing and recompute, same tokens."""
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    hub = InprocHub()
    per_token = 2 * 3 * 2 * 16 * 4  # each stage holds 3 layers
    inst = start_inproc_instance(hub, "M", config=cfg, seed=3, stages=[(0, 3, 1), (3, 6, 1)], kv_cache_gib=24 * per_token / 2**30, kv_block_size=4)
    client = InprocTransport(hub, "client")
    prompts = [p for p in PROMPTS if len(p) <= 12]
    try:
        _submit_all(client, "M", prompts, 12)
        got = collect(client, len(prompts), timeout_s=60)
        assert all(6 == e.kv.pool.num_blocks for e in inst.engines)
        assert wait_until(lambda: all(0 == e.held_sequences() for e in inst.engines), 5)
    finally:
        inst.stop()
    want = reference(cfg, 3, prompts, 12)
    for i, expected in enumerate(want):
        assert [] == [m.error for m in got[f"r{i}"] if m.error]
        assert expected == [t for m in got[f"r{i}"] for t in m.tokens]
    assert inst.scheduler.core.preempted > 0


def test_a_steps_tokens_reach_the_coordinator_in_one_message(threads: list) -> None:
    """A batched decode step advances every request in it; their tokens travel as one TokenOuts, one each."""
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    hub = InprocHub()
    inst = start_inproc_instance(hub, "M", config=cfg, seed=3, stages=[(0, 6, 1)])
    client = InprocTransport(hub, "client")
    raw: list[TokenOut | TokenOuts] = []
    try:
        assert wait_until(lambda: inst.scheduler.core.ready, 10)
        _submit_all(client, "M", PROMPTS, 6)
        finished = 0
        while finished < len(PROMPTS) and (m := client.recv(30)) is not None:
            raw.append(m)
            finished += sum(o.finished for o in (m.outs if isinstance(m, TokenOuts) else (m,)))
    finally:
        inst.stop()
    batches = [m for m in raw if isinstance(m, TokenOuts)]
    assert batches, "no step sent its tokens together"
    assert max(len(b.outs) for b in batches) == len(PROMPTS)  # the full batch's step: one message of 5
    for b in batches:
        assert len({o.request_id for o in b.outs}) == len(b.outs)  # one token per request per step
    got: dict[str, list[int]] = {}
    for m in raw:
        for o in m.outs if isinstance(m, TokenOuts) else (m,):
            got.setdefault(o.request_id, []).extend(o.tokens)
    assert {f"r{i}": t for i, t in enumerate(reference(cfg, 3, PROMPTS, 6))} == got


def test_request_larger_than_a_node_pool_is_refused(threads: list) -> None:
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    hub = InprocHub()
    inst = start_inproc_instance(hub, "M", config=cfg, seed=3, stages=[(0, 6, 1)], kv_cache_gib=16 * 1536 / 2**30, kv_block_size=4)
    client = InprocTransport(hub, "client")
    try:
        assert wait_until(lambda: inst.scheduler.core.ready, 10)
        client.send("M", Submit(request_id="big", prompt=tuple(range(3, 13)), max_tokens=7, temperature=0.0, seed=0, eos_ids=(), reply_to="client"))
        got = collect(client, 1)
    finally:
        inst.stop()
    last = got["big"][-1]
    assert "error" == last.finish_reason
    assert "exceeds the KV cache of a node" in last.error and "16 tokens" in last.error


def test_lost_node_in_a_data_parallel_stage_is_routed_around(threads: list) -> None:
    """Stage 1 has two nodes; one dies mid-generation: every request still ends with generate()'s tokens."""
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    hub = InprocHub()
    inst = start_inproc_instance(hub, "M", config=cfg, seed=3, stages=[(0, 2, 1), (2, 6, 2)], heartbeat_timeout_s=0.5)
    client = InprocTransport(hub, "client")
    victim = next(e for e in inst.engines if e.stage == 1 and e.node_index == 1)
    n = 40
    try:
        _submit_all(client, "M", PROMPTS, n)
        assert wait_until(lambda: victim.items_served > 0, 10)
        victim.stop_event.set()  # the node goes silent
        got = collect(client, len(PROMPTS), timeout_s=60)
    finally:
        inst.stop()
    assert "" == inst.scheduler.core.failed
    assert {(1, 1)} == inst.scheduler.core.dead
    want = reference(cfg, 3, PROMPTS, n)
    for i, expected in enumerate(want):
        assert [] == [m.error for m in got[f"r{i}"] if m.error]
        assert expected == [t for m in got[f"r{i}"] for t in m.tokens]


def test_losing_the_only_node_of_a_stage_fails_the_instance(threads: list) -> None:
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    hub = InprocHub()
    inst = start_inproc_instance(hub, "M", config=cfg, seed=3, stages=[(0, 2, 1), (2, 6, 2)], heartbeat_timeout_s=0.5)
    client = InprocTransport(hub, "client")
    try:
        assert wait_until(lambda: inst.scheduler.core.ready, 10)
        inst.engines[0].stop_event.set()
        _submit_all(client, "M", PROMPTS[:2], 200)
        got = collect(client, 2, timeout_s=30)
    finally:
        inst.stop()
    assert "stage 0 has no node left" in inst.scheduler.core.failed
    assert all(m[-1].retryable and "error" == m[-1].finish_reason for m in got.values())


def test_a_long_forward_pass_does_not_look_like_a_dead_node(threads: list) -> None:
    """Heartbeats go out from their own thread: a 1.5 s pass with a 0.5 s timeout fails nothing."""
    import time

    cfg = BUILTIN_CONFIGS["tiny-llama"]
    hub = InprocHub()
    inst = start_inproc_instance(hub, "M", config=cfg, seed=3, stages=[(0, 6, 1)], heartbeat_timeout_s=0.5)
    shard = inst.engines[0].shard
    real = shard.forward_batch

    def slow(*args: object) -> object:
        time.sleep(1.5)
        return real(*args)

    shard.forward_batch = slow
    client = InprocTransport(hub, "client")
    try:
        _submit_all(client, "M", PROMPTS[:2], 2)
        got = collect(client, 2, timeout_s=30)
    finally:
        inst.stop()
    assert "" == inst.scheduler.core.failed and set() == inst.scheduler.core.dead
    assert reference(cfg, 3, PROMPTS[:2], 2) == [[t for m in got[f"r{i}"] for t in m.tokens] for i in range(2)]


def test_cancelled_in_flight_requests_leave_no_kv_behind(threads: list) -> None:
    """A Cancel can pass a later stage before the micro-batch does; the batch's result releases again."""
    from coral.runtime.protocol import Cancel

    cfg = BUILTIN_CONFIGS["tiny-llama"]
    hub = InprocHub()
    inst = start_inproc_instance(hub, "M", config=cfg, seed=3, stages=[(0, 3, 1), (3, 6, 1)])
    first = inst.engines[0].shard
    real = first.forward_batch

    def slow(*args: object) -> object:  # stage 0 is still computing when the Release reaches stage 1
        import time

        time.sleep(0.2)
        return real(*args)

    first.forward_batch = slow
    client = InprocTransport(hub, "client")
    try:
        assert wait_until(lambda: inst.scheduler.core.ready, 10)
        for k in range(3):  # each cancelled while its prefill runs on stage 0
            client.send("M", Submit(request_id=f"c{k}", prompt=(5 + k,) * 40, max_tokens=50, temperature=0.0, seed=0, eos_ids=(), reply_to="client"))
            assert wait_until(lambda k=k: inst.engines[0].items_served > k, 10)  # dispatched: stage 0 is on it
            client.send("M", Cancel(request_ids=(f"c{k}",)))
            assert wait_until(lambda: not inst.scheduler.core.reqs, 10)
        assert wait_until(lambda: all(0 == e.held_sequences() for e in inst.engines), 10)
        assert all(e.kv.pool.num_free == e.kv.pool.num_blocks for e in inst.engines)
    finally:
        inst.stop()


def _reference_sampled(config: dict, seed: int, prompt: list[int], params: SamplingParams, n: int) -> list[tuple[int, float]]:
    """Step-by-step HF logits through the same sampler, with the sequence as the history."""
    model = hf_model(config, seed)
    out: list[tuple[int, float]] = []
    for step in range(n):
        seq = prompt + [t for t, _ in out]
        pick = sample_batch(_hf_logits(model, seq).unsqueeze(0), [params], [step], [seq]).pop()
        out.append((pick.token, pick.logprob))
    return out


def test_batched_engine_samples_each_row_with_its_own_params_through_preemption(threads: list) -> None:
    """Penalties, logit_bias and logprobs ride through a 2-stage batched engine whose full pool preempts.

    Each request's tokens (and logprobs) equal the frontend's sampler applied to generate()'s
    logits with the request's sequence as history, although rows share batches and are recomputed.
    """
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    hub = InprocHub()
    per_token = 2 * 3 * 2 * 16 * 4
    inst = start_inproc_instance(hub, "M", config=cfg, seed=3, stages=[(0, 3, 1), (3, 6, 1)], kv_cache_gib=24 * per_token / 2**30, kv_block_size=4)
    client = InprocTransport(hub, "client")
    prompts = [p for p in PROMPTS if len(p) <= 12]
    kinds = [
        # penalties below 1 / below 0 *favour* seen tokens, so the history surely decides the answer
        {"repetition_penalty": 0.05, "logprobs": 2},
        {"frequency_penalty": -100.0, "presence_penalty": 1.0},
        {"logit_bias": ((9, 1e4),)},  # token 9 every time
        {},
    ]
    params = [SamplingParams(temperature=0.0, prompt_len=len(p), **kinds[i % len(kinds)]) for i, p in enumerate(prompts)]  # type: ignore[arg-type]
    try:
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            client.send("M", Submit(request_id=f"r{i}", prompt=tuple(p), max_tokens=10, temperature=0.0, seed=0, eos_ids=(), reply_to="client", sampling=sp))
        got = collect(client, len(prompts), timeout_s=60)
        assert wait_until(lambda: all(0 == e.held_sequences() for e in inst.engines), 5)
        assert {} == inst.engines[-1].histories  # dropped with the requests' KV
    finally:
        inst.stop()
    assert inst.scheduler.core.preempted > 0
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        msgs = got[f"r{i}"]
        assert [] == [m.error for m in msgs if m.error]
        tokens = [t for m in msgs for t in m.tokens]
        want = _reference_sampled(cfg, 3, p, sp, 10)
        assert [t for t, _ in want] == tokens
        if sp.logit_bias:
            assert [9] * 10 == tokens
        if sp.frequency_penalty:
            assert [tokens[0]] * 10 == tokens  # -100 per earlier use: the first output token wins from then on
        if sp.logprobs >= 0:
            lps = [lp for m in msgs for lp in m.logprobs]
            assert 10 == len(lps) and all(2 == len(lp.top) for lp in lps)
            assert [lp for _, lp in want] == pytest.approx([lp.logprob for lp in lps], abs=1e-4)
    greedy = reference(cfg, 3, prompts, 10)
    changed = [i for i, sp in enumerate(params) if sp.needs_history and greedy[i] != [t for m in got[f"r{i}"] for t in m.tokens]]
    assert changed  # the penalties acted: some penalized answer is not the plain greedy one


def test_heartbeat_reports_the_fullest_node_kv_usage() -> None:
    """The coordinator's heartbeat carries the scheduler's mirror of its nodes' pools (vllm:kv_cache_usage_perc reads it)."""
    from coral.runtime.engine.scheduling import InstanceScheduler, NodeSlot
    from coral.runtime.protocol import Heartbeat

    nodes = [NodeSlot(stage=s, node_index=0, layer_start=s, layer_end=s + 1) for s in range(2)]
    core = InstanceScheduler(address="S", instance_id="S", model="m", phase="mixed", region="r", throughput_tok_per_s=1.0,
                             nodes=nodes, coordinator="C")
    beats = [m for a, m in core.step(0.0) if a == "C"]
    assert 1 == len(beats) and 0.0 == beats[0].kv_cache_usage  # no pools announced (no-op engines): nothing to report
    core.kv.announce("a", 4, 4)
    core.kv.announce("b", 8, 4)
    core.kv.grow(("a", "b"), "x", 7)  # 2 blocks on each node: a is half full, b a quarter
    beats = [m for a, m in core.step(1.0) if a == "C"]
    assert 1 == len(beats) and isinstance(beats[0], Heartbeat) and 0.5 == beats[0].kv_cache_usage


def test_penalties_survive_the_prefill_decode_hand_off(threads: list) -> None:
    """The decode instance's last stage gets the prompt and first token once (BatchItem.history), so penalties see the whole sequence."""
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    hub = InprocHub()
    pre = start_inproc_instance(hub, "P", config=cfg, seed=3, stages=[(0, 2, 1), (2, 6, 1)], phase="prefill")
    dec = start_inproc_instance(hub, "D", config=cfg, seed=3, stages=[(0, 4, 1), (4, 6, 1)], phase="decode")
    client = InprocTransport(hub, "client")
    prompts = PROMPTS[:3]
    params = [SamplingParams(temperature=0.0, prompt_len=len(p), repetition_penalty=0.05, frequency_penalty=-0.5) for p in prompts]
    try:
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            client.send("P", Submit(request_id=f"r{i}", prompt=tuple(p), max_tokens=8, temperature=0.0, seed=0, eos_ids=(), reply_to="client", decode_to="D", sampling=sp))
        got = collect(client, len(prompts), timeout_s=60)
        assert wait_until(lambda: all(0 == e.held_sequences() for e in pre.engines + dec.engines), 10)
        assert {} == pre.engines[-1].histories and {} == dec.engines[-1].histories
    finally:
        pre.stop()
        dec.stop()
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        msgs = got[f"r{i}"]
        assert [] == [m.error for m in msgs if m.error]
        assert [t for t, _ in _reference_sampled(cfg, 3, p, sp, 8)] == [t for m in msgs for t in m.tokens]
