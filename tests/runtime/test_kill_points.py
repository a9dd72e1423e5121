"""An engine killed at the exact points where a request could be lost: every request still ends whole.

The coordinator and two instances' schedulers (a 2-stage prefill, a 3-stage decode whose middle stage
has two nodes) run their real decisions on one virtual clock; the engines are scripted (the next token
is a function of the sequence length, ``3 + length % 250``, so a retry that resends prompt + tokens
continues the same answer), and every message goes through the wire encoding in FIFO order. One
engine is killed when a chosen message is delivered: it answers and heartbeats no more. A spare
prefill and decode instance register at that moment (what self-repair brings up), so each request
must then come back *completed*, with exactly the tokens it would have had without the kill: none
lost, none twice. Kill points: between a token and the stream's end, and during the prefill -> decode
hand-off, with the first token sent by the prefill instance and, in vLLM's mode, by the decode one.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import pytest

from coral.runtime.engine.scheduling import InstanceScheduler, NodeSlot
from coral.runtime.protocol import (
    DecodeAdmit,
    EngineHello,
    ForwardBatch,
    ForwardResult,
    Heartbeat,
    KvLoaded,
    KvSend,
    Role,
    TokenItem,
    TokenOut,
    TokenOuts,
    decode,
    encode,
)
from coral.runtime.serving import coordinator as coordinator_module
from coral.runtime.serving.coordinator import Coordinator, ModelInfo, RequestHandle

PROMPT_LEN, MAX_TOKENS, REQUESTS = 5, 6, 4
TICK_S = 0.05  # virtual seconds per delivery round
HEARTBEAT_TIMEOUT_S = 0.5


def token_after(length: int) -> int:
    return 3 + length % 250


class Clock:
    """The coordinator's `time` module, virtual (monotonic and perf_counter read the same clock)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now


class Wire:
    """The coordinator's transport: what it sends joins the cluster's FIFO."""

    def __init__(self, cluster: Cluster) -> None:
        self.address = "C"
        self.cluster = cluster

    def send(self, address: str, msg: Any) -> None:
        self.cluster.post(address, msg)


def instance(name: str, phase: str, stages: list[tuple[int, int, int]]) -> tuple[InstanceScheduler, dict[str, tuple[int, int]]]:
    """A scheduler for `stages` ((layer start, layer end, nodes) each) and its engines' address -> layers."""
    slots = [NodeSlot(stage=s, node_index=k, layer_start=lo, layer_end=hi) for s, (lo, hi, n) in enumerate(stages) for k in range(n)]
    sch = InstanceScheduler(address=name, instance_id=name, model="m", phase=phase, region="r", throughput_tok_per_s=100.0,
                            nodes=slots, coordinator="C", heartbeat_s=0.1, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)  # fmt: skip
    return sch, {f"{name}.{n.stage}{n.node_index}": (n.layer_start, n.layer_end) for n in slots}


class Cluster:
    """The messages of a coordinator, its schedulers and scripted engines, delivered in order on one clock."""

    def __init__(self, clock: Clock, first_token: str) -> None:
        self.clock = clock
        self.fifo: collections.deque[tuple[str, bytes | list[Any]]] = collections.deque()
        self.coord = Coordinator(Wire(self), [ModelInfo(name="m", max_context=64, vocab_size=512, first_token=first_token)],
                                 heartbeat_s=0.1, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, max_retries=3, retry_wait_s=30.0)  # fmt: skip
        self.schedulers: dict[str, InstanceScheduler] = {}
        self.engines: dict[str, tuple[str, int, int]] = {}  # address -> (scheduler, layer start, layer end)
        self.dead: set[str] = set()
        self.kill_at: tuple[Callable[[str, Any], bool], str] | None = None  # (when delivering this, kill that engine)
        self.on_kill: list[Callable[[], None]] = []
        self.killed = False

    def add(self, name: str, phase: str, stages: list[tuple[int, int, int]]) -> None:
        sch, engines = instance(name, phase, stages)
        self.schedulers[name] = sch
        for addr, (lo, hi) in engines.items():
            self.engines[addr] = (name, lo, hi)
            s, k = int(addr[-2]), int(addr[-1])
            self.post(name, EngineHello(instance_id=name, stage=s, node_index=k, address=addr, layer_start=lo, layer_end=hi))

    def post(self, address: str, msg: Any) -> None:
        self.fifo.append((address, encode(msg)))  # the wire format, as the real transports carry it

    def run_until(self, done: Callable[[], bool], limit_s: float = 60.0) -> None:
        """Deliver, step every scheduler and tick the coordinator until `done()` (or `limit_s` virtual seconds)."""
        end = self.clock.now + limit_s
        while not done():
            assert self.clock.now < end, "the cluster did not settle"
            for _ in range(len(self.fifo)):
                address, frames = self.fifo.popleft()
                self.deliver(address, decode(frames))
            for name, sch in self.schedulers.items():
                if not sch.stopped:
                    self.send_all(sch.step(self.clock.now))
                for addr, (owner, _, _) in self.engines.items():
                    if owner == name and addr not in self.dead:
                        self.post(name, Heartbeat(sender=addr, role=Role.ENGINE))
            self.coord.tick(self.clock.now)
            self.clock.now += TICK_S

    def send_all(self, out: list[tuple[str, Any]]) -> None:
        for address, msg in out:
            self.post(address, msg)

    def deliver(self, address: str, msg: Any) -> None:
        if self.kill_at is not None and not self.killed and self.kill_at[0](address, msg):
            self.killed = True
            self.dead.add(self.kill_at[1])
            for f in self.on_kill:
                f()
        if address == "C":
            self.coord.handle(msg)
        elif address in self.schedulers:
            sch = self.schedulers[address]
            if not sch.stopped:  # the shell stops once its instance failed
                self.send_all(sch.handle(msg, self.clock.now))
        elif address in self.engines and address not in self.dead:
            self.engine(address, msg)

    def engine(self, address: str, msg: Any) -> None:
        """A scripted engine: a micro-batch runs if every node of an item's route is alive; KV moves likewise."""
        if isinstance(msg, ForwardBatch):
            items = tuple(TokenItem(request_id=it.request_id, token=token_after(it.position + len(it.token_ids)))
                          for it in msg.items if not set(it.route) & self.dead)  # fmt: skip
            if items:
                self.post(msg.reply_to, ForwardResult(batch_id=msg.batch_id, items=items))
        elif isinstance(msg, KvSend):
            _, lo, hi = self.engines[address]
            for t in msg.targets:
                if t.address not in self.dead:
                    self.post(msg.notify, KvLoaded(request_id=msg.request_id, layer_start=max(lo, t.layer_start),
                                                   layer_end=min(hi, t.layer_end)))  # fmt: skip


def outcome(h: RequestHandle) -> tuple[list[int], str]:
    """The tokens the client was handed, and the error it got ("" = none)."""
    tokens: list[int] = []
    while not h.queue.empty():
        m = h.queue.get_nowait()
        if m.error:
            return tokens, m.error
        tokens += m.tokens
    return tokens, ""


def first_token_of(rid: str) -> Callable[[str, Any], bool]:
    """The coordinator receives request `rid`'s first token."""
    return lambda a, m: a == "C" and any(o.request_id == rid and o.tokens for o in (m.outs if isinstance(m, TokenOuts) else [m]) if isinstance(o, TokenOut))


def token_number(rid: str, n: int) -> Callable[[str, Any], bool]:
    """The coordinator receives request `rid`'s n-th token (counted over its attempts)."""
    seen = [0]

    def when(a: str, m: Any) -> bool:
        if a != "C" or not isinstance(m, (TokenOut, TokenOuts)):
            return False
        seen[0] += sum(len(o.tokens) for o in (m.outs if isinstance(m, TokenOuts) else [m]) if o.request_id.split(".")[0] == rid)
        return seen[0] >= n

    return when


def hand_off_of(rid: str) -> Callable[[str, Any], bool]:
    """The decode instance receives request `rid`'s hand-off (its KV still on the prefill nodes)."""
    return lambda a, m: a == "D" and isinstance(m, DecodeAdmit) and m.submit.request_id == rid


def kv_send_of(rid: str) -> Callable[[str, Any], bool]:
    """A prefill node is asked to push request `rid`'s KV to the decode nodes."""
    return lambda a, m: a.startswith("P.") and isinstance(m, KvSend) and m.request_id == rid


KILLS = {
    # between a token and the stream's end: the decode instance's last stage (it fails) or its
    # middle stage's node on the request's route (routed around: the request is recomputed)
    "decode last stage, before the last token": (lambda: token_number("req-1", MAX_TOKENS - 1), "D.20"),
    "decode data-parallel node, before the last token": (lambda: token_number("req-1", MAX_TOKENS - 1), "D.10"),
    # the prefill -> decode hand-off: the first token is out (or held, "decode"), the KV not yet moved
    "prefill last stage, at the hand-off": (lambda: hand_off_of("req-1"), "P.10"),
    "prefill first stage, as its first token arrives": (lambda: first_token_of("req-1"), "P.00"),
    "decode data-parallel node, as the KV is pushed": (lambda: kv_send_of("req-1"), "D.10"),
    "prefill last stage, as the KV is pushed": (lambda: kv_send_of("req-1"), "P.10"),
}


@pytest.mark.parametrize("first_token", ["prefill", "decode"])
@pytest.mark.parametrize("kill", list(KILLS))
def test_an_engine_killed_at_the_worst_moment_loses_no_request_and_repeats_no_token(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kill: str, first_token: str,
) -> None:  # fmt: skip
    clock = Clock()
    monkeypatch.setattr(coordinator_module, "time", clock)
    c = Cluster(clock, first_token)
    c.add("P", "prefill", [(0, 2, 1), (2, 6, 1)])
    c.add("D", "decode", [(0, 1, 1), (1, 4, 2), (4, 6, 1)])
    c.run_until(lambda: 2 == len(c.coord.instances))
    when, victim = KILLS[kill]
    c.kill_at = (when(), victim)
    # what self-repair brings up after the loss: a spare of each phase
    c.on_kill.append(lambda: (c.add("P2", "prefill", [(0, 6, 1)]), c.add("D2", "decode", [(0, 6, 1)])))
    prompts = [[10 + k] * PROMPT_LEN for k in range(REQUESTS)]
    handles = [c.coord.submit("m", p, MAX_TOKENS, 0.0, 0, ignore_eos=True) for p in prompts]
    assert ["req-1"] == [h.request_id for h in handles[:1]]
    with caplog.at_level(logging.ERROR):
        c.run_until(lambda: all(h.done for h in handles))
    assert c.killed, f"the kill point {kill!r} was never reached"
    want = [token_after(PROMPT_LEN + k) for k in range(MAX_TOKENS)]
    assert [(want, "")] * REQUESTS == [outcome(h) for h in handles]
    assert [] == [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]  # no decision failed
    assert {} == c.coord._wire and [] == c.coord._parked  # nothing left behind


@pytest.mark.parametrize("first_token", ["prefill", "decode"])
def test_a_request_decoding_elsewhere_is_not_resent_when_its_prefill_instance_dies(
    monkeypatch: pytest.MonkeyPatch, first_token: str,
) -> None:  # fmt: skip
    """Once the decode instance holds a request's whole KV (it has sent a token of its own), the lost
    prefill instance owes it nothing: the request keeps decoding where it is. Resent, it waited for a
    prefill instance (none here: no spare comes) and failed after `retry_wait_s`."""
    clock = Clock()
    monkeypatch.setattr(coordinator_module, "time", clock)
    c = Cluster(clock, first_token)
    c.add("P", "prefill", [(0, 2, 1), (2, 6, 1)])
    c.add("D", "decode", [(0, 1, 1), (1, 4, 2), (4, 6, 1)])
    c.run_until(lambda: 2 == len(c.coord.instances))
    n = 40  # long enough to be decoding still when the loss is noticed
    handles = [c.coord.submit("m", [10 + k] * PROMPT_LEN, n, 0.0, 0, ignore_eos=True) for k in range(REQUESTS)]
    own = 1 if first_token == "decode" else 2  # tokens by which the decode instance has sent one of its own
    c.kill_at = (lambda a, m: all(len(h.generated) >= own for h in handles), "P.00")
    c.run_until(lambda: "P" in c.coord.retired)
    assert c.killed and not any(h.done for h in handles)
    c.run_until(lambda: all(h.done for h in handles))
    want = [token_after(PROMPT_LEN + k) for k in range(n)]
    assert [(want, "")] * REQUESTS == [outcome(h) for h in handles]
    assert 0 == c.coord.retried
