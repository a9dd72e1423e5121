"""The instance scheduler's decisions without a socket, a thread or a sleep: events and times go in,
the messages it decides come out (which requests to batch, which KV blocks, what to preempt, what to
hand off, when a node is lost)."""
from __future__ import annotations

from typing import Any

import pytest

from coral.policy import Lifecycle
from coral.runtime.engine.scheduling import InstanceScheduler, NodeSlot, Send
from coral.runtime.protocol import (
    Cancel,
    DecodeAdmit,
    Drain,
    EngineHello,
    ForwardBatch,
    ForwardResult,
    Heartbeat,
    InstanceHello,
    InstancePhase,
    KvLoaded,
    KvSend,
    KvSource,
    Release,
    Role,
    Shutdown,
    Submit,
    TokenItem,
    TokenOut,
    TokenOuts,
    encode,
)


def scheduler(stages: list[int], *, phase: str = "mixed", **kw: Any) -> InstanceScheduler:
    """A scheduler of stages with the given node counts, 2 layers each, named S, reporting to C."""
    nodes = [NodeSlot(stage=s, node_index=k, layer_start=2 * s, layer_end=2 * s + 2) for s, n in enumerate(stages) for k in range(n)]
    return InstanceScheduler(address="S", instance_id="S", model="m", phase=phase, region="r", throughput_tok_per_s=1.0,
                             nodes=nodes, coordinator="C", **kw)


def hello_all(sch: InstanceScheduler, now: float = 0.0, blocks: int = 0, block_size: int = 4) -> list[Send]:
    out: list[Send] = []
    for (s, k), slot in sorted(sch.slots.items()):
        out += sch.handle(EngineHello(instance_id="S", stage=s, node_index=k, address=f"n{s}{k}", layer_start=slot.layer_start,
                                      layer_end=slot.layer_end, kv_blocks=blocks, kv_block_size=block_size), now)
    return out


def submit(rid: str, prompt: tuple[int, ...] = (1, 2, 3), max_tokens: int = 2, decode_to: str = "") -> Submit:
    return Submit(request_id=rid, prompt=prompt, max_tokens=max_tokens, temperature=0.0, seed=0, eos_ids=(9,), reply_to="C",
                  decode_to=decode_to)


def of(out: list[Send], kind: type, to: str | None = None) -> list[Any]:
    return [m for a, m in out if isinstance(m, kind) and (to is None or a == to)]


def tokens(out: list[Send]) -> list[TokenOut]:
    """Every TokenOut sent, with the step's batched TokenOuts unpacked."""
    flat: list[TokenOut] = []
    for m in of(out, TokenOut) + of(out, TokenOuts):
        flat += list(m.outs) if isinstance(m, TokenOuts) else [m]
    return flat


def result(batch: ForwardBatch, token: int) -> ForwardResult:
    return ForwardResult(batch_id=batch.batch_id, items=tuple(TokenItem(request_id=i.request_id, token=token) for i in batch.items))


def test_nothing_is_batched_before_every_node_is_up_then_it_registers_once() -> None:
    sch = scheduler([1, 1])
    sch.handle(submit("a"), 0.0)
    assert [] == of(sch.step(0.0), ForwardBatch)
    assert Lifecycle.STARTING is sch.state
    out = hello_all(sch)
    assert [InstanceHello(instance_id="S", model="m", phase=InstancePhase.MIXED, region="r", throughput_tok_per_s=1.0, address="S")] == of(out, InstanceHello, "C")
    assert Lifecycle.ACTIVE is sch.state
    batches = of(sch.step(0.1), ForwardBatch, "n00")
    assert 1 == len(batches) and ("a",) == tuple(i.request_id for i in batches[0].items)
    assert "S" == batches[0].reply_to and ("n00", "n10") == batches[0].items[0].route


def test_requests_spread_over_the_micro_batch_groups_and_respect_the_batch_limits() -> None:
    sch = scheduler([1, 1], max_batch_requests=2)  # 2 stages: 2 groups in flight
    hello_all(sch)
    for i in range(5):
        sch.handle(submit(f"r{i}"), 0.0)
    batches = of(sch.step(0.0), ForwardBatch)
    # ceil(5 / 2 groups) = 3 per group, capped at 2 requests per micro-batch, first come first served
    assert [["r0", "r1"], ["r2", "r3"]] == [[i.request_id for i in b.items] for b in batches]
    assert ["r4"] == list(sch.waiting)
    assert [] == of(sch.step(0.5), ForwardBatch)  # both groups busy: nothing more goes out


def test_a_result_streams_tokens_re_forms_the_group_and_a_finished_request_releases_its_kv() -> None:
    sch = scheduler([1])
    hello_all(sch)
    sch.handle(submit("a", max_tokens=2), 0.0)
    (first,) = of(sch.step(0.0), ForwardBatch)
    assert (1, 2, 3) == first.items[0].token_ids and 0 == first.items[0].position
    out = sch.handle(result(first, 7), 0.2)
    assert [TokenOut(request_id="a", tokens=(7,), finished=False, queue_s=0.0)] == tokens(out)
    (second,) = of(sch.step(0.2), ForwardBatch)
    assert (7,) == second.items[0].token_ids and 3 == second.items[0].position  # the group re-formed: one new token
    out = sch.handle(result(second, 8), 0.3)
    assert [("a", (8,), True, "length")] == [(t.request_id, t.tokens, t.finished, t.finish_reason) for t in tokens(out)]
    assert [Release(request_ids=("a",))] == of(out, Release, "n00")
    assert {} == sch.reqs and 1 == sch.completed


def test_a_request_that_can_never_fit_a_node_is_refused_at_submission() -> None:
    sch = scheduler([1])
    hello_all(sch, blocks=2, block_size=4)  # 8 tokens per node
    out = sch.handle(submit("big", prompt=(1,) * 6, max_tokens=3), 0.0)
    (err,) = tokens(out)
    assert err.finished and "error" == err.finish_reason and not err.retryable
    assert "exceeds the KV cache of a node of instance S (8 tokens)" in err.error


def test_when_a_node_is_full_the_youngest_request_is_preempted_by_recompute() -> None:
    sch = scheduler([1])
    hello_all(sch, blocks=2, block_size=4)  # 8 tokens on the one node
    sch.handle(submit("old", prompt=(1, 2, 3, 4), max_tokens=3), 0.0)
    sch.handle(submit("young", prompt=(5, 6, 7, 8), max_tokens=3), 0.0)
    (batch,) = of(sch.step(0.0), ForwardBatch)
    assert ["old", "young"] == [i.request_id for i in batch.items]  # one block each: the pool is full
    assert 2 == len(tokens(sch.handle(result(batch, 11), 0.1)))
    out = sch.step(0.1)  # both need a second block for their next token; one block can be had
    assert [Release(request_ids=("young",))] == of(out, Release, "n00")
    assert 1 == sch.preempted
    (batch,) = of(out, ForwardBatch)
    assert ["old"] == [i.request_id for i in batch.items]
    young = sch.reqs["young"]
    # back at the front of the queue: its prompt plus the token it made, under a new KV id
    assert ((5, 6, 7, 8, 11), 0, "young~1") == (young.pending, young.position, young.kv_id)
    assert ["young"] == list(sch.waiting)


def test_prefill_hands_off_after_the_first_token_and_decode_pulls_the_kv_before_decoding() -> None:
    pre = scheduler([1, 1], phase="prefill")
    hello_all(pre)
    pre.handle(submit("a", max_tokens=3, decode_to="D"), 0.0)
    (batch,) = of(pre.step(0.0), ForwardBatch)
    out = pre.handle(result(batch, 7), 0.1)
    (admit,) = of(out, DecodeAdmit, "D")
    assert (7,) == admit.generated and ["n00", "n10"] == [s.address for s in admit.sources]
    assert 1 == len(tokens(out)) and {} == pre.reqs  # the first token went to the client, the request left
    # the decode instance: 2 stages of 4 and 2 layers, unlike the prefill's 2 + 2
    nodes = [NodeSlot(stage=0, node_index=0, layer_start=0, layer_end=3), NodeSlot(stage=1, node_index=0, layer_start=3, layer_end=4)]
    dec = InstanceScheduler(address="D", instance_id="D", model="m", phase="decode", region="r", throughput_tok_per_s=1.0,
                            nodes=nodes, coordinator="C")
    for n in nodes:
        dec.handle(EngineHello(instance_id="D", stage=n.stage, node_index=0, address=f"d{n.stage}", layer_start=n.layer_start,
                               layer_end=n.layer_end), 0.2)
    dec.handle(admit, 0.2)
    out = dec.step(0.2)
    sends = {a: m for a, m in out if isinstance(m, KvSend)}
    assert {"n00": [("d0", 0, 3)], "n10": [("d0", 0, 3), ("d1", 3, 4)]} == {
        a: [(t.address, t.layer_start, t.layer_end) for t in m.targets] for a, m in sends.items()}
    assert [] == of(out, ForwardBatch)  # no decoding before every layer is in place
    dec.handle(KvLoaded(request_id="a", layer_start=0, layer_end=3), 0.3)
    assert [] == of(dec.step(0.3), ForwardBatch)
    dec.handle(KvLoaded(request_id="a", layer_start=3, layer_end=4), 0.4)
    (first,) = of(dec.step(0.4), ForwardBatch)
    assert (7,) == first.items[0].token_ids and 3 == first.items[0].position and (1, 2, 3) == first.items[0].history


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_the_first_token_leaves_from_the_instance_the_models_first_token_names(mode: str) -> None:
    """"prefill": the prefill instance sends it with the hand-off (the KV transfer then counts in TPOT);
    "decode": it is held back and the decode instance sends it once the KV is in (in TTFT, vLLM's P/D)."""
    pre = scheduler([1], phase="prefill")
    hello_all(pre)
    sub = Submit(request_id="a", prompt=(1, 2, 3), max_tokens=3, temperature=0.0, seed=0, eos_ids=(9,), reply_to="C",
                 decode_to="D", first_token=mode)
    pre.handle(sub, 0.0)
    (batch,) = of(pre.step(0.0), ForwardBatch)
    out = pre.handle(result(batch, 7), 0.1)
    (admit,) = of(out, DecodeAdmit, "D")
    from_prefill = [t.tokens for t in tokens(out)]
    dec = scheduler([1], phase="decode")
    for (s, k), slot in sorted(dec.slots.items()):
        dec.handle(EngineHello(instance_id="S", stage=s, node_index=k, address="d", layer_start=slot.layer_start,
                               layer_end=slot.layer_end), 0.1)
    dec.handle(admit, 0.1)
    before_kv = [t.tokens for t in tokens(dec.step(0.1))]
    out = dec.handle(KvLoaded(request_id="a", layer_start=0, layer_end=2), 0.5) + dec.step(0.5)
    on_kv = [t.tokens for t in tokens(out)]
    if mode == "prefill":
        assert ([(7,)], [], []) == (from_prefill, before_kv, on_kv)
    else:
        assert ([], [], [(7,)]) == (from_prefill, before_kv, on_kv)
    (step,) = of(out, ForwardBatch)
    assert (7,) == step.items[0].token_ids  # decoding continues from the first token either way


def test_a_kv_hand_off_that_never_arrives_fails_after_the_timeout() -> None:
    dec = scheduler([1], phase="decode", kv_timeout_s=5.0, heartbeat_timeout_s=0.0)
    hello_all(dec)
    src = (KvSource(address="p", layer_start=0, layer_end=2),)
    dec.handle(DecodeAdmit(submit=submit("a"), generated=(7,), sources=src), 1.0)
    dec.step(1.0)
    assert [] == tokens(dec.step(5.9))
    (err,) = tokens(dec.step(6.1))
    assert "KV transfer timed out" == err.error and err.finished


def test_a_silent_node_with_a_sibling_is_routed_around_and_a_silent_stage_fails_the_instance() -> None:
    sch = scheduler([1, 2], heartbeat_timeout_s=2.0)
    hello_all(sch, now=0.0)
    sch.handle(submit("a"), 0.0)
    sch.step(0.0)
    for t in (1.0, 2.0, 3.0):  # n00 and n10 keep beating, n11 is silent from 0 s on
        for node in ("n00", "n10"):
            sch.handle(Heartbeat(sender=node, role=Role.ENGINE), t)
    sch.step(3.0)
    assert {(1, 1)} == sch.dead and Lifecycle.ACTIVE is sch.state and "" == sch.failed
    sch.handle(Heartbeat(sender="n10", role=Role.ENGINE), 4.0)
    out = sch.step(5.5)  # n00, stage 0's only node, last beat at 3 s
    assert Lifecycle.FAILED is sch.state and "stage 0 has no node left" in sch.failed and sch.stopped
    assert [True] == [t.retryable for t in tokens(out)]  # the coordinator retries it elsewhere
    assert [Shutdown(reason=f"instance failed: {sch.failed}")] == of(out, Shutdown, "n10")
    beat = of(out, Heartbeat, "C")[-1]
    assert Lifecycle.FAILED is beat.state and sch.failed == beat.reason


def test_drain_refuses_new_requests_and_reports_draining_through_next_state() -> None:
    sch = scheduler([1])
    hello_all(sch)
    sch.handle(submit("a"), 0.0)
    out = sch.handle(Drain(reason="scale down"), 0.1)
    assert Lifecycle.DRAINING is sch.state
    (beat,) = of(out, Heartbeat, "C")
    assert Lifecycle.DRAINING is beat.state and 1 == beat.in_flight
    (err,) = tokens(sch.handle(submit("b"), 0.2))
    assert err.retryable and "instance S is draining" == err.error
    assert ["a"] == [i.request_id for b in of(sch.step(0.3), ForwardBatch) for i in b.items]  # what it holds, it finishes


def test_cancel_drops_the_request_and_its_kv_and_shutdown_stops_every_node() -> None:
    sch = scheduler([1, 1])
    hello_all(sch)
    sch.handle(submit("a"), 0.0)
    (batch,) = of(sch.step(0.0), ForwardBatch)
    out = sch.handle(Cancel(request_ids=("a",)), 0.1)
    # its micro-batch is still in flight: the KV is released when it is back, so no stage meets it gone
    assert [] == of(out, Release) and {} == sch.reqs
    out = sch.handle(result(batch, 7), 0.2)
    assert {"n00", "n10"} == {a for a, m in out if isinstance(m, Release)} and [] == tokens(out)
    out = sch.handle(Shutdown(reason="drained"), 0.2)
    assert {"n00", "n10"} == {a for a, _ in out} and sch.stopped
    assert [] == sch.step(0.3)


def test_cancel_drops_a_hand_off_still_waiting_for_blocks_and_frees_its_kv_on_the_prefill_nodes() -> None:
    dec = scheduler([1], phase="decode", heartbeat_timeout_s=0.0)
    hello_all(dec, blocks=1, block_size=4)  # 4 tokens: one 2-token prompt and its 2 tokens fit, not two
    src = (KvSource(address="p", layer_start=0, layer_end=2),)
    dec.handle(DecodeAdmit(submit=submit("a", (1, 2), max_tokens=2), generated=(7,), sources=src), 0.0)
    dec.handle(DecodeAdmit(submit=submit("b", (1, 2), max_tokens=2), generated=(7,), sources=src, kv_id="b~1"), 0.0)
    assert ["a"] == [m.request_id for m in of(dec.step(0.0), KvSend)]  # b waits for blocks
    out = dec.handle(Cancel(request_ids=("b",)), 0.1)
    assert [Release(request_ids=("b~1",))] == of(out, Release, "p")
    dec.handle(Cancel(request_ids=("a",)), 0.2)  # a's blocks free up: b must not start now
    assert [] == of(dec.step(0.3), KvSend)


@pytest.mark.parametrize("seed", [0, 1])
def test_same_events_and_times_give_the_same_messages_byte_for_byte(seed: int) -> None:
    def run() -> list[bytes]:
        sch = scheduler([1, 2], max_batch_requests=3)
        wire = [b"".join(bytes(f) for f in encode(m)) for _, m in hello_all(sch, blocks=16)]
        for i in range(6):
            wire += [b"".join(bytes(f) for f in encode(m)) for _, m in sch.handle(submit(f"r{seed}-{i}", max_tokens=2 + i % 2), 0.01 * i)]
        for t in range(8):
            out = sch.step(0.1 * t)
            wire += [b"".join(bytes(f) for f in encode(m)) for _, m in out]
            for b in of(out, ForwardBatch):
                wire += [b"".join(bytes(f) for f in encode(m)) for _, m in sch.handle(result(b, 5 + t), 0.1 * t + 0.05)]
        return wire

    first, second = run(), run()
    assert first == second and len(first) > 20


# ------------------------------------------------------------------ chunked prefill (colocated instances)


def rows(batch: ForwardBatch) -> list[tuple[str, int, tuple[int, ...]]]:
    return [(i.request_id, i.position, i.token_ids) for i in batch.items]


def test_a_long_prompt_is_fed_in_chunks_and_only_its_last_chunk_makes_a_token() -> None:
    sch = scheduler([1], chunk_tokens=4)
    hello_all(sch, blocks=8, block_size=4)
    sch.handle(submit("a", prompt=tuple(range(10, 20)), max_tokens=2), 0.0)
    seen, outs = [], []
    for k in range(4):
        (batch,) = of(sch.step(0.1 * k), ForwardBatch)
        seen.append(rows(batch))
        # the KV is reserved chunk by chunk: blocks for what the step carries, not the whole prompt
        outs.append((sch.kv.pools["n00"].lengths["a"], tokens(sch.handle(result(batch, 50 + k), 0.1 * k + 0.05))))
    assert [[("a", 0, (10, 11, 12, 13))], [("a", 4, (14, 15, 16, 17))], [("a", 8, (18, 19))], [("a", 10, (52,))]] == seen
    # the tokens sampled after the first two chunks are dropped; the third chunk's (52) is the first token
    assert [4, 8, 10, 11] == [n for n, _ in outs]
    assert [[], [], [(52,)], [(53,)]] == [[t.tokens for t in ts] for _, ts in outs]
    assert outs[3][1][0].finished and {} == sch.reqs


def test_every_step_carries_the_running_decodes_plus_at_most_chunk_tokens_prompt_tokens() -> None:
    sch = scheduler([1], chunk_tokens=3)
    hello_all(sch)
    sch.handle(submit("d", prompt=(1, 2), max_tokens=9), 0.0)
    (batch,) = of(sch.step(0.0), ForwardBatch)
    sch.handle(result(batch, 5), 0.01)  # d decodes from now on
    sch.handle(submit("p", prompt=(30, 31, 32, 33, 34), max_tokens=9), 0.02)
    sch.handle(submit("q", prompt=(40, 41), max_tokens=9), 0.02)
    steps = []
    for k in range(3):
        (batch,) = of(sch.step(0.1 * (k + 1)), ForwardBatch)
        steps.append(rows(batch))
        sch.handle(result(batch, 6), 0.1 * (k + 1) + 0.05)
    assert [
        [("d", 2, (5,)), ("p", 0, (30, 31, 32))],  # the decode rides along; p's first 3 prompt tokens fill the chunk
        [("d", 3, (6,)), ("p", 3, (33, 34)), ("q", 0, (40,))],  # p's rest, then q starts with what is left
        [("d", 4, (6,)), ("p", 5, (6,)), ("q", 1, (41,))],  # p decodes; q's last prompt token
    ] == steps


def test_without_chunk_tokens_a_prompt_goes_whole_and_a_negative_one_is_refused() -> None:
    sch = scheduler([1])
    hello_all(sch)
    sch.handle(submit("a", prompt=tuple(range(10, 30)), max_tokens=2), 0.0)
    (batch,) = of(sch.step(0.0), ForwardBatch)
    assert [("a", 0, tuple(range(10, 30)))] == rows(batch)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        scheduler([1], chunk_tokens=-1)


def test_a_chunked_prompt_preempted_mid_way_is_recomputed_from_its_start() -> None:
    sch = scheduler([1], chunk_tokens=4)
    hello_all(sch, blocks=3, block_size=4)  # 12 tokens on the node
    sch.handle(submit("old", prompt=(1, 2, 3, 4), max_tokens=5), 0.0)
    sch.handle(submit("young", prompt=(5, 6, 7, 8, 9, 10), max_tokens=2), 0.0)
    (b1,) = of(sch.step(0.0), ForwardBatch)
    assert [("old", 0, (1, 2, 3, 4))] == rows(b1)  # the chunk is spent on old's prompt
    sch.handle(result(b1, 11), 0.1)
    (b2,) = of(sch.step(0.1), ForwardBatch)
    assert [("old", 4, (11,)), ("young", 0, (5, 6, 7, 8))] == rows(b2)
    sch.handle(result(b2, 12), 0.2)
    out = sch.step(0.2)  # old needs a second block, young its last two prompt tokens' block: 3 blocks, 3 held
    assert [Release(request_ids=("young",))] == of(out, Release, "n00") and 1 == sch.preempted
    young = sch.reqs["young"]
    assert ((5, 6, 7, 8, 9, 10), 0, "young~1") == (young.pending, young.position, young.kv_id)
