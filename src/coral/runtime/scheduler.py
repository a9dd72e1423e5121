"""The instance scheduler: continuous batching over a pipeline of engine nodes, one process per instance.

Each request gets one engine node per stage when admitted (weighted round-robin in
proportion to the node's throughput) and keeps it, since its KV cache lives there.
Running requests are split into ``micro_batches`` groups (default: one per stage) so the
stages work on different groups at once; every time a group's micro-batch comes back
from the last stage, the group is re-formed: finished requests leave, waiting ones join
(continuous batching), and the next micro-batch goes out.

Prefill/decode disaggregation: a prefill instance hands a request over after its first
token (:class:`DecodeAdmit` to the decode scheduler); the decode scheduler picks its
own route and asks every prefill node to push the overlapping layers of the KV cache
straight to the decode nodes holding them (:class:`KvSend`), then starts decoding once
every layer is in place.

Lifecycle and faults: the scheduler heartbeats its engines and the coordinator (the
heartbeat to the coordinator carries the instance's registration, state and load). On
:class:`Drain` it takes no new request and finishes the ones it holds; the coordinator
sends :class:`Shutdown` once it is empty. If an engine node goes silent for
``heartbeat_timeout_s`` the instance has lost a stage: the scheduler reports itself
``failed``, ends every request it holds with a *retryable* error (the coordinator resends
them elsewhere), stops its other nodes and exits.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from coral.policy import SmoothWRR
from coral.runtime.protocol import (
    BatchItem,
    Cancel,
    DecodeAdmit,
    Drain,
    EngineHello,
    ForwardBatch,
    ForwardResult,
    Heartbeat,
    InstanceHello,
    KvLoaded,
    KvSend,
    KvSource,
    KvTarget,
    Release,
    Shutdown,
    Submit,
    TokenItem,
    TokenLogprob,
    TokenOut,
)
from coral.runtime.transport import Transport

__all__ = ["NodeSlot", "Scheduler"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSlot:
    """An engine node the scheduler expects: stage, index in the stage, layers and weight."""

    stage: int
    node_index: int
    layer_start: int
    layer_end: int
    throughput_tok_per_s: float = 1.0


@dataclass(slots=True)
class _Req:
    submit: Submit
    route: tuple[str, ...] = ()
    position: int = 0  # tokens already in the KV cache
    pending: tuple[int, ...] = ()  # tokens to feed next
    generated: list[int] = field(default_factory=list)
    group: int = -1
    kv_layers: int = 0
    kv_deadline: float = 0.0
    handed_off: bool = False
    history: tuple[int, ...] = ()  # tokens this route has not been fed (a decode hand-off), sent once
    t_arrived: float = 0.0
    queue_s: float = -1.0  # time from arrival to the first batch (-1 = not yet reported)


class Scheduler:
    """The message loop of one instance's scheduler."""

    def __init__(
        self,
        transport: Transport,
        *,
        instance_id: str,
        model: str,
        phase: str,
        region: str,
        throughput_tok_per_s: float,
        nodes: list[NodeSlot],
        coordinator: str = "",
        micro_batches: int = 0,
        max_batch_requests: int = 64,
        max_batch_tokens: int = 4096,
        kv_timeout_s: float = 30.0,
        heartbeat_s: float = 0.25,
        heartbeat_timeout_s: float = 2.0,
    ) -> None:
        """Args:
        transport: the scheduler's inbox.
        instance_id, model, phase, region, throughput_tok_per_s: announced to the coordinator.
        nodes: every engine node of the placement.
        coordinator: where to register once all nodes are up ("" = nobody).
        micro_batches: groups in flight at once; 0 = number of stages.
        max_batch_requests: most requests per micro-batch.
        max_batch_tokens: most tokens per micro-batch (a prompt counts whole).
        kv_timeout_s: a decode hand-off whose KV has not arrived by then fails.
        heartbeat_s: how often to heartbeat the engines and the coordinator.
        heartbeat_timeout_s: an engine node silent this long is dead (the instance fails).
        """
        self.t = transport
        self.instance_id, self.model, self.phase, self.region = instance_id, model, phase, region
        self.throughput = throughput_tok_per_s
        self.coordinator = coordinator
        self.slots = {(n.stage, n.node_index): n for n in nodes}
        self.num_stages = 1 + max(n.stage for n in nodes)
        self.num_layers = max(n.layer_end for n in nodes)
        self.addresses: dict[tuple[int, int], str] = {}
        # per stage: node indices in order, and the shared policy's smooth WRR over their throughputs
        self.stage_nodes = [sorted(n.node_index for n in nodes if n.stage == s) for s in range(self.num_stages)]
        self.wrr = [SmoothWRR([self.slots[(s, k)].throughput_tok_per_s for k in self.stage_nodes[s]]) for s in range(self.num_stages)]
        self.groups = micro_batches or self.num_stages
        self.max_batch_requests = max_batch_requests
        self.max_batch_tokens = max_batch_tokens
        self.kv_timeout_s = kv_timeout_s
        self.reqs: dict[str, _Req] = {}
        self.waiting: deque[str] = deque()
        self.members: list[list[str]] = [[] for _ in range(self.groups)]
        self.in_flight: dict[int, tuple[int, set[str]]] = {}  # batch id -> (group, outstanding ids)
        self.busy = [False] * self.groups
        self._batch_ids = itertools.count(1)
        self.ready = False
        self.draining = False
        self.failed = ""
        self.stop_event = threading.Event()
        self.completed = 0
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._last_beat = 0.0
        self._engine_seen: dict[tuple[int, int], float] = {}

    # --------------------------------------------------------------- loop

    def run(self, poll_s: float = 0.05) -> None:
        """Serve messages until :class:`Shutdown` or ``stop_event``."""
        while not self.stop_event.is_set():
            msg = self.t.recv(poll_s)
            if msg is not None:
                try:
                    if not self.handle(msg):
                        break
                except Exception:
                    log.exception("scheduler %s: failed on %s", self.instance_id, type(msg).__name__)
            self._check_kv_deadlines()
            self._heartbeat()
            if self.failed:
                break
            self._pump()

    def handle(self, msg: Any) -> bool:
        """Handle one message (then call :meth:`_pump`).

        Returns:
            False when the scheduler should stop.
        """
        if isinstance(msg, ForwardResult):
            self._on_result(msg)
        elif isinstance(msg, Submit):
            self._on_submit(msg)
        elif isinstance(msg, DecodeAdmit):
            self._on_decode_admit(msg)
        elif isinstance(msg, KvLoaded):
            self._on_kv_loaded(msg)
        elif isinstance(msg, EngineHello):
            self._on_hello(msg)
        elif isinstance(msg, Heartbeat):
            self._on_heartbeat(msg)
        elif isinstance(msg, Drain):
            if not self.draining:
                log.info("scheduler %s: draining (%d requests held): %s", self.instance_id, len(self.reqs), msg.reason)
            self.draining = True
            self._beat_coordinator()
        elif isinstance(msg, Cancel):
            for rid in msg.request_ids:
                r = self.reqs.get(rid)
                if r is not None:
                    self._release(r)
        elif isinstance(msg, Shutdown):
            for addr in self.addresses.values():
                self.t.send(addr, msg)
            return False
        else:
            log.warning("scheduler: ignored unexpected %s", type(msg).__name__)
        return True

    # --------------------------------------------------------------- liveness

    @property
    def state(self) -> str:
        """Lifecycle state as reported to the coordinator."""
        if self.failed:
            return "failed"
        if not self.ready:
            return "starting"
        return "draining" if self.draining else "active"

    def _hello_msg(self) -> InstanceHello:
        return InstanceHello(
            instance_id=self.instance_id, model=self.model, phase=self.phase, region=self.region,
            throughput_tok_per_s=self.throughput, address=self.t.address,
        )  # fmt: skip

    def _beat_coordinator(self) -> None:
        if self.coordinator:
            self.t.send(self.coordinator, Heartbeat(
                sender=self.t.address, role="scheduler", instance_id=self.instance_id, state=self.state,
                in_flight=len(self.reqs), hello=self._hello_msg() if self.ready else None, reason=self.failed,
                waiting=len(self.waiting),
            ))  # fmt: skip

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        if msg.role != "engine":
            return  # the coordinator's heartbeat: nothing to do, it is alive
        for key, addr in self.addresses.items():
            if addr == msg.sender:
                self._engine_seen[key] = time.monotonic()

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= self.heartbeat_s:
            self._last_beat = now
            beat = Heartbeat(sender=self.t.address, role="scheduler", instance_id=self.instance_id, state=self.state)
            for addr in self.addresses.values():
                self.t.send(addr, beat)
            self._beat_coordinator()
        if self.heartbeat_timeout_s > 0:
            dead = [k for k, t in self._engine_seen.items() if now - t > self.heartbeat_timeout_s]
            if dead:
                self._instance_failed(f"engine node(s) {', '.join(f'{s}/{i}' for s, i in sorted(dead))} silent for over {self.heartbeat_timeout_s:.1f} s")

    def _instance_failed(self, reason: str) -> None:
        """A node is gone: report, hand every request back for retry, stop the other nodes."""
        log.warning("scheduler %s: instance failed: %s", self.instance_id, reason)
        self.failed = reason
        self._beat_coordinator()
        for r in list(self.reqs.values()):
            self._remove(r)
            self._finish_error(r.submit, f"instance {self.instance_id} failed: {reason}", retryable=True)
        for key, addr in self.addresses.items():
            if key not in self._engine_seen or time.monotonic() - self._engine_seen[key] <= self.heartbeat_timeout_s:
                self.t.send(addr, Shutdown(reason=f"instance failed: {reason}"))

    # --------------------------------------------------------------- registration

    def _on_hello(self, msg: EngineHello) -> None:
        slot = self.slots.get((msg.stage, msg.node_index))
        if slot is None or (slot.layer_start, slot.layer_end) != (msg.layer_start, msg.layer_end):
            log.warning("scheduler %s: unexpected engine %s", self.instance_id, msg)
            return
        self.addresses[(msg.stage, msg.node_index)] = msg.address
        self._engine_seen[(msg.stage, msg.node_index)] = time.monotonic()
        if not self.ready and len(self.addresses) == len(self.slots):
            self.ready = True
            log.info("scheduler %s: all %d nodes up", self.instance_id, len(self.slots))
            if self.coordinator:
                self.t.send(self.coordinator, self._hello_msg())

    def _pick_route(self) -> tuple[str, ...]:
        return tuple(self.addresses[(s, self.stage_nodes[s][self.wrr[s].pick()])] for s in range(self.num_stages))

    def _stage_layers(self, route: tuple[str, ...]) -> list[tuple[str, int, int]]:
        by_addr = {a: self.slots[k] for k, a in self.addresses.items()}
        return [(a, by_addr[a].layer_start, by_addr[a].layer_end) for a in route]

    # --------------------------------------------------------------- requests

    def _on_submit(self, sub: Submit) -> None:
        if sub.request_id in self.reqs:
            self._finish_error(sub, "duplicate request id")
            return
        if not sub.prompt:
            self._finish_error(sub, "empty prompt")
            return
        if self.draining:
            # routed here just before the drain (cannot happen with one coordinator): retry elsewhere
            self._finish_error(sub, f"instance {self.instance_id} is {self.state}", retryable=True)
            return
        r = _Req(submit=sub, pending=sub.prompt, t_arrived=time.monotonic())
        self.reqs[sub.request_id] = r
        self.waiting.append(sub.request_id)

    def _on_decode_admit(self, msg: DecodeAdmit) -> None:
        sub = msg.submit
        if sub.request_id in self.reqs or not self.ready or not msg.generated:
            self._finish_error(sub, "decode instance cannot take the request", retryable=True)
            for src in msg.sources:
                self.t.send(src.address, Release(request_ids=(sub.request_id,)))
            return
        r = _Req(submit=sub, route=self._pick_route(), position=len(sub.prompt), pending=(msg.generated[-1],))
        r.generated = list(msg.generated)
        r.history = sub.prompt + msg.generated[:-1]
        r.kv_deadline = time.monotonic() + self.kv_timeout_s
        self.reqs[sub.request_id] = r
        targets = tuple(KvTarget(address=a, layer_start=lo, layer_end=hi) for a, lo, hi in self._stage_layers(r.route))
        for src in msg.sources:
            mine = tuple(t for t in targets if max(t.layer_start, src.layer_start) < min(t.layer_end, src.layer_end))
            self.t.send(src.address, KvSend(request_id=sub.request_id, targets=mine, notify=self.t.address))

    def _on_kv_loaded(self, msg: KvLoaded) -> None:
        r = self.reqs.get(msg.request_id)
        if r is None or r.kv_deadline == 0.0:
            return
        if msg.error:
            self._fail(r, f"KV transfer failed: {msg.error}")
            return
        r.kv_layers += msg.layer_end - msg.layer_start
        if r.kv_layers >= self.num_layers:
            r.kv_deadline = 0.0
            self.waiting.append(msg.request_id)

    def _check_kv_deadlines(self) -> None:
        now = time.monotonic()
        for r in [r for r in self.reqs.values() if r.kv_deadline and now > r.kv_deadline]:
            self._fail(r, "KV transfer timed out")

    # --------------------------------------------------------------- batching

    def _pump(self) -> None:
        """Send the next micro-batch of every idle group."""
        if not self.ready:
            return
        active = sum(len(m) for m in self.members)
        target = -(-(active + len(self.waiting)) // self.groups)  # ceil: spread requests over groups
        for g in range(self.groups):
            if self.busy[g]:
                continue
            members = self.members[g]
            tokens = sum(len(self.reqs[rid].pending) for rid in members)
            while self.waiting and len(members) < min(target, self.max_batch_requests):
                r = self.reqs.get(self.waiting[0])
                if r is None:
                    self.waiting.popleft()
                    continue
                if members and tokens + len(r.pending) > self.max_batch_tokens:
                    break
                self.waiting.popleft()
                if not r.route:
                    r.route = self._pick_route()
                r.group = g
                if r.queue_s < 0 and r.t_arrived:
                    r.queue_s = time.monotonic() - r.t_arrived
                members.append(r.submit.request_id)
                tokens += len(r.pending)
            if members:
                self._dispatch(g)

    def _dispatch(self, g: int) -> None:
        bid = next(self._batch_ids)
        by_node: dict[str, list[BatchItem]] = {}
        for rid in self.members[g]:
            r = self.reqs[rid]
            item = BatchItem(
                request_id=rid, position=r.position, token_ids=r.pending, hidden=None, route=r.route,
                temperature=r.submit.temperature, seed=r.submit.seed, step=len(r.generated),
                sampling=r.submit.sampling, history=r.history,
            )  # fmt: skip
            r.history = ()  # the last stage keeps it from now on
            by_node.setdefault(r.route[0], []).append(item)
        for addr, items in by_node.items():
            self.t.send(addr, ForwardBatch(batch_id=bid, reply_to=self.t.address, items=tuple(items)))
        self.in_flight[bid] = (g, set(self.members[g]))
        self.busy[g] = True

    def _on_result(self, msg: ForwardResult) -> None:
        entry = self.in_flight.get(msg.batch_id)
        if entry is None:
            log.warning("scheduler %s: result for unknown batch %d", self.instance_id, msg.batch_id)
            return
        g, outstanding = entry
        for it in msg.items:
            if it.request_id not in outstanding:
                continue
            outstanding.discard(it.request_id)
            r = self.reqs.get(it.request_id)
            if r is None:
                continue
            if it.token < 0:
                self._fail(r, msg.error or "engine error")
                continue
            self._advance(r, it)
        if not outstanding:
            del self.in_flight[msg.batch_id]
            self.busy[g] = False

    def _advance(self, r: _Req, it: TokenItem) -> None:
        sub = r.submit
        token = it.token
        r.position += len(r.pending)
        r.pending = (token,)
        r.generated.append(token)
        reason = ""
        if token in sub.eos_ids:
            reason = "stop"
        elif len(r.generated) >= sub.max_tokens:
            reason = "length"
        want_lp = sub.sampling is not None and sub.sampling.logprobs >= 0
        queue_s = 0.0
        if len(r.generated) == 1 and r.queue_s >= 0:
            queue_s = r.queue_s
        self.t.send(sub.reply_to, TokenOut(
            request_id=sub.request_id, tokens=(token,), finished=bool(reason), finish_reason=reason,
            logprobs=(TokenLogprob(logprob=it.logprob, top=it.top_logprobs),) if want_lp else (), queue_s=queue_s,
        ))  # fmt: skip
        if reason:
            self._release(r)
            self.completed += 1
        elif sub.decode_to and len(r.generated) == 1 and self.phase == "prefill":
            self._hand_off(r)

    def _hand_off(self, r: _Req) -> None:
        sources = tuple(KvSource(address=a, layer_start=lo, layer_end=hi) for a, lo, hi in self._stage_layers(r.route))
        self._remove(r)
        self.t.send(r.submit.decode_to, DecodeAdmit(submit=r.submit, generated=tuple(r.generated), sources=sources))

    # --------------------------------------------------------------- endings

    def _remove(self, r: _Req) -> None:
        rid = r.submit.request_id
        self.reqs.pop(rid, None)
        if r.group >= 0 and rid in self.members[r.group]:
            self.members[r.group].remove(rid)
        if rid in self.waiting:
            self.waiting.remove(rid)

    def _release(self, r: _Req) -> None:
        self._remove(r)
        for addr in set(r.route):
            self.t.send(addr, Release(request_ids=(r.submit.request_id,)))

    def _fail(self, r: _Req, error: str) -> None:
        log.warning("scheduler %s: request %s failed: %s", self.instance_id, r.submit.request_id, error)
        self._release(r)
        self._finish_error(r.submit, error)

    def _finish_error(self, sub: Submit, error: str, retryable: bool = False) -> None:
        self.t.send(sub.reply_to, TokenOut(request_id=sub.request_id, tokens=(), finished=True, finish_reason="error", error=error, retryable=retryable))
