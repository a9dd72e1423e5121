"""The instance scheduler's decisions, as a pure state machine: events and the time in, messages out.

:class:`InstanceScheduler` reads no clock and touches no socket: every call takes ``now`` and
returns the ``(address, message)`` pairs to send; the shell (:class:`coral.runtime.engine.scheduler.Scheduler`)
owns the transport and the clock, as vLLM v1's ``EngineCoreProc`` does around ``Scheduler.schedule()``
/ ``update_from_output()``. So every decision is tested without a socket or a sleep
(``tests/runtime/test_scheduling.py``):

- **which requests to batch** (:meth:`InstanceScheduler.step`): running requests are split into
  ``micro_batches`` groups (default one per stage) so the stages work on different groups at once;
  each time a group's micro-batch comes back it is re-formed (finished requests leave, waiting ones
  join, first come first served, within ``max_batch_requests`` / ``max_batch_tokens``); with
  ``chunk_tokens`` (chunked prefill, as vLLM and Sarathi-Serve schedule it) a step carries every
  running decode plus at most that many prompt tokens: a long prompt is fed over several steps, its
  KV built chunk by chunk, and only its last chunk's token is kept (:mod:`~coral.runtime.engine.request_state`);
- **which KV blocks**: an exact mirror of every engine node's pool (:class:`KvMirror`); a request
  joins a batch only when its route has the blocks for its next step, and one whose prompt plus
  ``max_tokens`` could never fit a node is refused at submission, so an engine never runs out;
- **what to preempt**: when a node is full, the youngest request holding blocks there (not in a
  micro-batch in flight) is preempted by recompute: its KV released, it goes back to the front of
  the queue with its prompt plus the tokens it made;
- **what to hand off**: a prefill instance hands a request over after its first token
  (:class:`DecodeAdmit`); the decode scheduler picks a route (smooth WRR per stage ∝ node
  throughput) and asks the prefill nodes to push the overlapping layers (:class:`KvSend`), then
  decodes once every layer is in place (or fails the request after ``kv_timeout_s``);
- **liveness**: heartbeats every ``heartbeat_s`` (the coordinator's carries the registration, the
  :class:`~coral.policy.Lifecycle` state, the load and the counters); an engine silent for
  ``heartbeat_timeout_s`` is routed around when its stage has another node, else the instance
  FAILS and ends every request with a retryable error. Every state change goes through
  :func:`coral.policy.next_state` (READY when all nodes are up, DRAIN on :class:`Drain`, FAIL).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from coral.policy import Lifecycle, LifecycleEvent, next_state
from coral.runtime.engine.blocks import KvMirror
from coral.runtime.engine.request_state import RequestState
from coral.runtime.engine.roster import NodeKey, NodeRoster, NodeSlot
from coral.runtime.engine.stats import SchedulerCounters
from coral.runtime.protocol import (
    TOKEN_NO_KV,
    BatchItem,
    Cancel,
    DecodeAdmit,
    Drain,
    EngineHello,
    ForwardBatch,
    ForwardResult,
    Heartbeat,
    InstanceHello,
    InstancePhase,
    InstanceStats,
    KvLoaded,
    KvSend,
    KvSource,
    KvTarget,
    Message,
    Release,
    Role,
    Shutdown,
    Submit,
    TokenItem,
    TokenLogprob,
    TokenOut,
    TokenOuts,
)

__all__ = ["InstanceScheduler", "NodeSlot", "Send"]

log = logging.getLogger(__name__)

#: One decision to carry out: send ``message`` to ``address``.
Send = tuple[str, Message]
#: A micro-batch that came back whole: (instance, phase, group, batch id, requests, new tokens,
#: context tokens, dispatched at, returned at); the times are the ``now`` the scheduler was given.
StepRow = tuple[Any, ...]


class InstanceScheduler:
    """One instance's scheduling decisions: :meth:`handle` an event, :meth:`step` the time.

    Args:
        address: the scheduler's own inbox (engines and the coordinator reply there).
        instance_id, model, phase, region, throughput_tok_per_s: announced to the coordinator.
        nodes: every engine node of the placement.
        coordinator: where to register once all nodes are up ("" = nobody).
        micro_batches: groups in flight at once; 0 = number of stages.
        max_batch_requests: most requests per micro-batch.
        max_batch_tokens: most tokens per micro-batch (a prompt, or its chunk, counts whole).
        chunk_tokens: most prompt tokens one micro-batch carries, decodes not counted (0 = whole prompts).
        kv_timeout_s: a decode hand-off whose KV has not arrived by then fails.
        heartbeat_s: how often to heartbeat the engines and the coordinator.
        heartbeat_timeout_s: an engine node silent this long is dead (0 = never).
        step_trace: off (None) by default. Called once per micro-batch that came back whole with a
            :data:`StepRow` (context = the members' positions plus their new tokens): what the
            fidelity study compares simulated steps against.

    Raises:
        ValueError: an unknown phase, or no nodes.
    """

    def __init__(
        self,
        *,
        address: str,
        instance_id: str,
        model: str,
        phase: InstancePhase | str,
        region: str,
        throughput_tok_per_s: float,
        nodes: list[NodeSlot],
        coordinator: str = "",
        micro_batches: int = 0,
        max_batch_requests: int = 64,
        max_batch_tokens: int = 4096,
        chunk_tokens: int = 0,
        kv_timeout_s: float = 30.0,
        heartbeat_s: float = 0.25,
        heartbeat_timeout_s: float = 2.0,
        step_trace: Callable[[StepRow], None] | None = None,
    ) -> None:
        if not nodes:
            raise ValueError(f"instance {instance_id}: a scheduler needs at least one engine node")
        if chunk_tokens < 0:
            raise ValueError(f"instance {instance_id}: chunk_tokens must be >= 1 (or 0: whole prompts), got {chunk_tokens}")
        self.address = address
        self.instance_id, self.model, self.phase, self.region = instance_id, model, InstancePhase(phase), region
        self.throughput = throughput_tok_per_s
        self.coordinator = coordinator
        self.nodes = NodeRoster(nodes)
        self.slots = self.nodes.slots
        self.num_stages, self.num_layers = self.nodes.num_stages, self.nodes.num_layers
        self.groups = micro_batches or self.num_stages
        self.max_batch_requests = max_batch_requests
        self.max_batch_tokens = max_batch_tokens
        self.chunk_tokens = chunk_tokens
        self._budget: int | None = None  # prompt tokens the group being formed may still take (None: no chunking)
        self.kv_timeout_s = kv_timeout_s
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.step_trace = step_trace
        self.state = Lifecycle.STARTING
        self.ready = False  # every node said hello (READY happened)
        self.failed = ""  # why the instance failed ("" = it has not)
        self.shut_down = False  # a Shutdown came: the shell stops
        self.reqs: dict[str, RequestState] = {}
        self.waiting: deque[str] = deque()
        self.members: list[list[str]] = [[] for _ in range(self.groups)]
        self.in_flight: dict[int, tuple[int, set[str]]] = {}  # batch id -> (group, outstanding ids)
        self.busy = [False] * self.groups
        self.kv = KvMirror()
        self.admit_queue: deque[DecodeAdmit] = deque()  # decode hand-offs waiting for KV space
        # KV ids dropped while a micro-batch still carried them -> their route: a later stage may
        # have allocated blocks after our Release passed it, so the batch's result releases again
        self.stale: dict[str, tuple[str, ...]] = {}
        self.completed = 0
        self.preempted = 0  # requests preempted by recompute (for tests and metrics)
        self._batch_ids = itertools.count(1)
        self._admissions = itertools.count(1)
        self._last_beat = float("-inf")
        self._step_meta: dict[int, tuple[int, int, int, float]] = {}  # batch id -> (requests, tokens, context, sent)
        self.counters = SchedulerCounters()  # for the coordinator's metrics (InstanceStats in the heartbeat)
        self._outbox: dict[str, list[TokenOut]] = {}  # reply address -> this step's tokens, not sent yet
        self._out: list[Send] = []
        self._now = 0.0

    # --------------------------------------------------------------- the two entry points

    def handle(self, msg: Any, now: float) -> list[Send]:
        """One event (a message that arrived at ``now``).

        Returns:
            The messages to send, in order.
        """
        self._now = now
        handler = self._HANDLERS.get(type(msg))
        if handler is None:
            log.warning("scheduler: ignored unexpected %s", type(msg).__name__)
            return self._take()
        try:
            handler(self, msg)
        except Exception:  # one bad event must not stop the instance; what was decided still goes out
            log.exception("scheduler %s: failed on %s", self.instance_id, type(msg).__name__)
        return self._take()

    def step(self, now: float) -> list[Send]:
        """The time passed to ``now``: KV deadlines, heartbeats and node loss, then the next
        micro-batch of every idle group (nothing once the instance failed or shut down).

        Returns:
            The messages to send, in order.
        """
        self._now = now
        if not self.stopped:
            self._check_kv_deadlines()
            self._heartbeat()
        if not self.stopped:
            self._schedule()
        return self._take()

    @property
    def stopped(self) -> bool:
        """Whether the shell should stop: a :class:`Shutdown` came, or the instance failed."""
        return self.shut_down or bool(self.failed)

    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use on the fullest node (0 with no-op, unbounded engines)."""
        return self.kv.usage()

    def _send(self, address: str, msg: Message) -> None:
        self._out.append((address, msg))

    def _take(self) -> list[Send]:
        out, self._out = self._out, []
        return out

    # --------------------------------------------------------------- events

    def _on_drain(self, msg: Drain) -> None:
        if self.state is Lifecycle.ACTIVE:
            log.info("scheduler %s: draining (%d requests held): %s", self.instance_id, len(self.reqs), msg.reason)
        self.state = next_state(self.state, LifecycleEvent.DRAIN, in_flight=len(self.reqs))
        self._beat_coordinator()

    def _on_cancel(self, msg: Cancel) -> None:
        ids = set(msg.request_ids)
        for rid in msg.request_ids:
            r = self.reqs.get(rid)
            if r is not None:
                self._release(r)
        # a hand-off still waiting for blocks here: never started, its KV freed where it still is (on
        # the prefill nodes); started later, it would be decoded whole for nobody (a retried request)
        for admit in [a for a in self.admit_queue if a.submit.request_id in ids]:
            self.admit_queue.remove(admit)
            for src in admit.sources:
                self._send(src.address, Release(request_ids=(admit.kv_id or admit.submit.request_id,)))

    def _on_shutdown(self, msg: Shutdown) -> None:
        for addr in self.nodes.addresses.values():
            self._send(addr, msg)
        self.shut_down = True

    # --------------------------------------------------------------- liveness

    def _hello_msg(self) -> InstanceHello:
        return InstanceHello(
            instance_id=self.instance_id, model=self.model, phase=self.phase, region=self.region,
            throughput_tok_per_s=self.throughput, address=self.address,
        )  # fmt: skip

    def _beat_coordinator(self) -> None:
        if self.coordinator:
            self._send(self.coordinator, Heartbeat(
                sender=self.address, role=Role.SCHEDULER, instance_id=self.instance_id, state=self.state,
                in_flight=len(self.reqs), hello=self._hello_msg() if self.ready else None, reason=self.failed,
                waiting=len(self.waiting), kv_cache_usage=self.kv.usage(), stats=self.stats(),
            ))  # fmt: skip

    def stats(self) -> InstanceStats:
        """The counters since this scheduler started, its smallest KV pool, and the nodes it lost."""
        return self.counters.snapshot(preemptions=self.preempted, pools=self.kv.pools.values(), lost=self.dead)

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        if msg.role is not Role.ENGINE:
            return  # the coordinator's heartbeat: nothing to do, it is alive
        self.nodes.heard(msg.sender, self._now)

    def _heartbeat(self) -> None:
        now = self._now
        if now - self._last_beat >= self.heartbeat_s:
            self._last_beat = now
            beat = Heartbeat(sender=self.address, role=Role.SCHEDULER, instance_id=self.instance_id, state=self.state)
            for addr in self.nodes.addresses.values():
                self._send(addr, beat)
            self._beat_coordinator()
        if self.heartbeat_timeout_s > 0:
            dead = self.nodes.silent(now, self.heartbeat_timeout_s)
            if dead:
                self._nodes_lost(dead)

    @property
    def dead(self) -> set[NodeKey]:
        """The nodes lost (their stages still have others)."""
        return self.nodes.dead

    def _nodes_lost(self, dead: list[NodeKey]) -> None:
        """Route around dead nodes; fail the instance only when a stage has none left."""
        empty = self.nodes.stages_left_empty(dead)
        names = ", ".join(f"{s}/{i}" for s, i in sorted(dead))
        if empty:
            self._instance_failed(f"engine node(s) {names} silent for over {self.heartbeat_timeout_s:.1f} s; stage {empty[0]} has no node left")
            return
        log.warning("scheduler %s: engine node(s) %s lost; routing around them", self.instance_id, names)
        gone = self.nodes.remove(dead)
        for addr in gone:
            self.kv.pools.pop(addr, None)
        for r in list(self.reqs.values()):
            if gone & set(r.route):
                if r.kv_deadline:  # its KV was on its way to a dead node: the prefill side cannot resend it
                    self._fail(r, "decode node lost during the KV hand-off", retryable=True)
                else:
                    self._preempt(r)
        for bid, (g, outstanding) in list(self.in_flight.items()):
            dropped = outstanding - set(self.kv.by_kv)
            outstanding &= set(self.kv.by_kv)
            if not outstanding:  # nothing of this batch will be waited for: release what it still carried
                del self.in_flight[bid]
                self.busy[g] = False
                for kv_id in dropped:
                    for a in set(self.stale.pop(kv_id, ())) - self.nodes.dead_addrs:
                        self._send(a, Release(request_ids=(kv_id,)))

    def _instance_failed(self, reason: str) -> None:
        """A node is gone: report, hand every request back for retry, stop the other nodes."""
        log.warning("scheduler %s: instance failed: %s", self.instance_id, reason)
        self.failed = reason
        self.state = next_state(self.state, LifecycleEvent.FAIL, in_flight=len(self.reqs))
        self._beat_coordinator()
        for r in list(self.reqs.values()):
            self._remove(r)
            self._finish_error(r.submit, f"instance {self.instance_id} failed: {reason}", retryable=True)
        for key, addr in self.nodes.addresses.items():
            if self.nodes.alive(key, self._now, self.heartbeat_timeout_s):
                self._send(addr, Shutdown(reason=f"instance failed: {reason}"))

    # --------------------------------------------------------------- registration

    def _on_hello(self, msg: EngineHello) -> None:
        if not self.nodes.hello((msg.stage, msg.node_index), (msg.layer_start, msg.layer_end), msg.address, self._now):
            log.warning("scheduler %s: unexpected engine %s", self.instance_id, msg)
            return
        self.kv.announce(msg.address, msg.kv_blocks, msg.kv_block_size)
        if not self.ready and self.nodes.complete:
            self.ready = True
            self.state = next_state(self.state, LifecycleEvent.READY, in_flight=0)
            log.info("scheduler %s: all %d nodes up", self.instance_id, len(self.slots))
            if self.coordinator:
                self._send(self.coordinator, self._hello_msg())

    # --------------------------------------------------------------- preemption

    def _unledger(self, r: RequestState) -> None:
        self.kv.free(r.route, r.kv_id)

    def _mark_stale(self, r: RequestState) -> bool:
        """Whether ``r``'s KV rides in a micro-batch in flight: then it is released when that batch comes
        back (every stage has run it by then), not now. Released now, a later stage could see the batch
        after the release and look for KV that is gone (a stop string or a client that left cancels
        requests mid-step)."""
        if r.route and any(r.kv_id in out for _g, out in self.in_flight.values()):
            self.stale[r.kv_id] = r.route
            return True
        return False

    def _release_kv(self, r: RequestState) -> None:
        """Tell ``r``'s route to drop its KV: now, or when its micro-batch in flight is back."""
        if not self._mark_stale(r):
            for a in set(r.route) - self.nodes.dead_addrs:
                self._send(a, Release(request_ids=(r.kv_id,)))

    def _preempt(self, r: RequestState) -> None:
        """Release ``r``'s KV and queue it at the front, to be prefilled again (recompute)."""
        rid = r.submit.request_id
        self._release_kv(r)
        self._unledger(r)
        if r.group >= 0 and rid in self.members[r.group]:
            self.members[r.group].remove(rid)
        r.group = -1
        r.preemptions += 1
        self.preempted += 1
        r.kv_id = f"{rid}~{r.preemptions}"
        self.kv.by_kv[r.kv_id] = rid
        r.pending = tuple(r.submit.prompt) + tuple(r.generated) if r.generated else tuple(r.submit.prompt)
        r.history = ()  # the recompute feeds the whole sequence to the new KV id
        r.position = 0
        r.route = ()
        if rid in self.waiting:
            self.waiting.remove(rid)
        self.waiting.appendleft(rid)

    def _victim(self, addr: str, busy: set[str]) -> RequestState | None:
        """The youngest request holding blocks on ``addr`` that is not in a micro-batch in flight."""
        best = None
        for kv_id in self.kv.holders(addr):
            rid = self.kv.by_kv.get(kv_id)
            r = self.reqs.get(rid) if rid is not None else None
            if r is None or rid in busy or r.kv_deadline:
                continue
            if best is None or r.admitted > best.admitted:
                best = r
        return best

    # --------------------------------------------------------------- requests

    def _on_submit(self, sub: Submit) -> None:
        if sub.request_id in self.reqs:
            self._finish_error(sub, "duplicate request id")
            return
        if not sub.prompt:
            self._finish_error(sub, "empty prompt")
            return
        if self.state in (Lifecycle.DRAINING, Lifecycle.STOPPED):
            # routed here just before the drain (cannot happen with one coordinator): retry elsewhere
            self._finish_error(sub, f"instance {self.instance_id} is {self.state}", retryable=True)
            return
        cap = self.kv.capacity_tokens()
        if cap and len(sub.prompt) + sub.max_tokens > cap:
            self._finish_error(sub, f"prompt ({len(sub.prompt)} tokens) + max_tokens ({sub.max_tokens}) exceeds the KV cache of a node of instance {self.instance_id} ({cap} tokens)")
            return
        r = RequestState(submit=sub, pending=sub.prompt, kv_id=sub.request_id, t_arrived=self._now)
        self.reqs[sub.request_id] = r
        self.kv.by_kv[r.kv_id] = sub.request_id
        self.waiting.append(sub.request_id)

    def _on_decode_admit(self, msg: DecodeAdmit) -> None:
        sub = msg.submit
        cap = self.kv.capacity_tokens()
        if sub.request_id in self.reqs or not self.ready or not msg.generated or (cap and len(sub.prompt) + sub.max_tokens > cap):
            self._finish_error(sub, "decode instance cannot take the request", retryable=True)
            for src in msg.sources:
                self._send(src.address, Release(request_ids=(msg.kv_id or sub.request_id,)))
            return
        self.admit_queue.append(msg)

    def _admit_decodes(self) -> None:
        """Start the KV hand-off of queued decode admissions, oldest first, while blocks last."""
        while self.admit_queue:
            msg = self.admit_queue[0]
            sub = msg.submit
            route = self.nodes.pick_route()
            need = len(sub.prompt) + 1
            if not self.kv.fits(route, sub.request_id, need):
                return  # the prefill nodes keep the KV until blocks free up here
            self.admit_queue.popleft()
            self._start_decode(msg, route, need)

    def _start_decode(self, msg: DecodeAdmit, route: tuple[str, ...], need: int) -> None:
        sub = msg.submit
        r = RequestState(submit=sub, route=route, position=len(sub.prompt), pending=(msg.generated[-1],), kv_id=sub.request_id)
        r.generated = list(msg.generated)
        r.first_out = msg.first_out
        r.history = sub.prompt + msg.generated[:-1]
        r.kv_t0 = self._now
        r.kv_deadline = r.kv_t0 + self.kv_timeout_s
        r.admitted = next(self._admissions)
        self.reqs[sub.request_id] = r
        self.kv.by_kv[r.kv_id] = sub.request_id
        self.kv.grow(route, r.kv_id, need)
        targets = tuple(KvTarget(address=a, layer_start=lo, layer_end=hi) for a, lo, hi in self.nodes.stage_layers(r.route))
        for src in msg.sources:
            mine = tuple(t for t in targets if max(t.layer_start, src.layer_start) < min(t.layer_end, src.layer_end))
            self._send(src.address, KvSend(request_id=sub.request_id, targets=mine, notify=self.address, kv_id=msg.kv_id))

    def _on_kv_loaded(self, msg: KvLoaded) -> None:
        r = self.reqs.get(msg.request_id)
        if r is None or r.kv_deadline == 0.0:
            return
        if msg.error:
            self._fail(r, f"KV transfer failed: {msg.error}")
            return
        r.kv_layers += msg.layer_end - msg.layer_start
        r.kv_bytes += msg.nbytes
        if r.kv_layers >= self.num_layers:
            r.kv_deadline = 0.0
            self.counters.kv_loaded(self._now - r.kv_t0, r.kv_bytes)
            if r.first_out is not None:  # the first token, held back by the prefill side, goes out now
                self._send(r.submit.reply_to, r.first_out)
                r.first_out = None
            self.waiting.append(msg.request_id)

    def _check_kv_deadlines(self) -> None:
        for r in [r for r in self.reqs.values() if r.kv_deadline and self._now > r.kv_deadline]:
            self._fail(r, "KV transfer timed out")

    # --------------------------------------------------------------- batching

    def _schedule(self) -> None:
        """Send the next micro-batch of every idle group."""
        if not self.ready:
            return
        self._admit_decodes()
        active = sum(len(m) for m in self.members)
        target = -(-(active + len(self.waiting)) // self.groups)  # ceil: spread requests over groups
        for g in range(self.groups):
            if self.busy[g]:
                continue
            self._budget = self.chunk_tokens or None
            self._reserve_members(g)
            self._fill_group(g, min(target, self.max_batch_requests))
            if any(self.reqs[rid].chunk for rid in self.members[g]):
                self._dispatch(g)

    def _plan_chunk(self, r: RequestState) -> int:
        """The tokens ``r``'s next step carries, charged to the group's prompt-token budget."""
        n = r.plan_chunk(self._budget)
        if self._budget is not None and r.prefilling:
            self._budget -= n
        return n

    def _fill_group(self, g: int, size: int) -> None:
        """Waiting requests join group ``g``, first come first served, while they and their blocks fit."""
        members = self.members[g]
        tokens = sum(self.reqs[rid].chunk for rid in members)
        while self.waiting and len(members) < size:
            r = self.reqs.get(self.waiting[0])
            if r is None:
                self.waiting.popleft()
                continue
            n = r.plan_chunk(self._budget)  # what it would carry; charged once it joins
            if n == 0 or (members and tokens + n > self.max_batch_tokens):
                break  # the step's prompt tokens are spent: it waits for the next
            route = r.route or self.nodes.pick_route()
            end = r.position + n
            if not self.kv.fits(route, r.kv_id, end):
                break  # first come, first served: wait for blocks (running requests finish or are preempted)
            self._plan_chunk(r)
            self.waiting.popleft()
            r.route = route
            if not r.admitted:
                r.admitted = next(self._admissions)
            self.kv.grow(route, r.kv_id, end)
            r.group = g
            if r.queue_s < 0 and r.t_arrived:
                r.queue_s = self._now - r.t_arrived
            members.append(r.submit.request_id)
            tokens += n

    def _reserve_members(self, g: int) -> None:
        """Reserve the next step's blocks of group ``g``'s members, preempting where a node is full."""
        busy = {rid for k in range(self.groups) if self.busy[k] for rid in self.members[k]}
        for rid in list(self.members[g]):
            r = self.reqs.get(rid)
            if r is None or r.group != g:
                continue
            end = r.position + self._plan_chunk(r)
            while not self.kv.fits(r.route, r.kv_id, end):
                victim = self._victim(self.kv.full_node(r.route, r.kv_id, end), busy)
                if victim is None or victim.admitted <= r.admitted:
                    victim = r  # r itself is the youngest here: it waits
                self._preempt(victim)
                if victim is r:
                    break
            else:
                self.kv.grow(r.route, r.kv_id, end)

    def _dispatch(self, g: int) -> None:
        bid = next(self._batch_ids)
        by_node: dict[str, list[BatchItem]] = {}
        rs = [self.reqs[rid] for rid in self.members[g] if self.reqs[rid].chunk]  # chunk 0: sits this step out
        for r in rs:
            item = BatchItem(
                request_id=r.kv_id, position=r.position, token_ids=r.pending[: r.chunk], hidden=None, route=r.route,
                temperature=r.submit.temperature, seed=r.submit.seed, step=len(r.generated),
                sampling=r.submit.sampling, history=r.history,
            )  # fmt: skip
            r.history = ()  # the last stage keeps it from now on
            by_node.setdefault(r.route[0], []).append(item)
        for addr, items in by_node.items():
            self._send(addr, ForwardBatch(batch_id=bid, reply_to=self.address, items=tuple(items)))
        self.in_flight[bid] = (g, {r.kv_id for r in rs})
        self.busy[g] = True
        self.counters.step(sum(len(it.token_ids) for items in by_node.values() for it in items))
        if self.step_trace is not None:
            self._step_meta[bid] = (len(rs), sum(r.chunk for r in rs), sum(r.position + r.chunk for r in rs), self._now)

    def _on_result(self, msg: ForwardResult) -> None:
        for it in msg.items:
            route = self.stale.pop(it.request_id, None)
            if route:
                for a in set(route) - self.nodes.dead_addrs:
                    self._send(a, Release(request_ids=(it.request_id,)))
        entry = self.in_flight.get(msg.batch_id)
        if entry is None:
            log.warning("scheduler %s: result for unknown batch %d", self.instance_id, msg.batch_id)
            return
        g, outstanding = entry
        try:
            self._advance_all(msg, outstanding)
        finally:
            self._flush_tokens()
        if not outstanding:
            del self.in_flight[msg.batch_id]
            self.busy[g] = False
            meta = self._step_meta.pop(msg.batch_id, None)
            if meta is not None and self.step_trace is not None:
                self.step_trace((self.instance_id, self.phase.value, g, msg.batch_id, *meta, self._now))

    def _advance_all(self, msg: ForwardResult, outstanding: set[str]) -> None:
        """Advance each request of a result; their tokens collect in the outbox."""
        for it in msg.items:
            if it.request_id not in outstanding:
                continue
            outstanding.discard(it.request_id)
            rid = self.kv.by_kv.get(it.request_id)
            r = self.reqs.get(rid) if rid is not None else None
            if r is None or r.kv_id != it.request_id:
                continue
            if it.token == TOKEN_NO_KV:  # the node's pool and our mirror disagree (a hand-off still there): recompute later
                self._preempt(r)
                continue
            if it.token < 0:
                self._fail(r, msg.error or "engine error")
                continue
            self._advance(r, it)

    def _advance(self, r: RequestState, it: TokenItem) -> None:
        if r.chunk_is_partial:  # a prompt chunk: its KV is in, the token sampled after it is not one
            r.position += r.chunk
            r.pending = r.pending[r.chunk :]
            return
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
        queue_s = r.queue_s if len(r.generated) == 1 and r.queue_s >= 0 else 0.0
        self._outbox.setdefault(sub.reply_to, []).append(TokenOut(
            request_id=sub.request_id, tokens=(token,), finished=bool(reason), finish_reason=reason,
            logprobs=(TokenLogprob(logprob=it.logprob, top=it.top_logprobs),) if want_lp else (), queue_s=queue_s,
        ))  # fmt: skip
        if reason:
            self._release(r)
            self.completed += 1
        elif sub.decode_to and len(r.generated) == 1 and self.phase is InstancePhase.PREFILL:
            # "decode": the decode instance sends the first token once the KV is there (vLLM's P/D)
            held = None
            if sub.first_token == "decode":
                held = self._outbox[sub.reply_to].pop()
                if not self._outbox[sub.reply_to]:
                    del self._outbox[sub.reply_to]
            self._hand_off(r, held)

    def _flush_tokens(self) -> None:
        """Send the tokens :meth:`_advance` collected: one message per coordinator per step."""
        if not self._outbox:
            return
        box, self._outbox = self._outbox, {}
        for addr, outs in box.items():
            self._send(addr, outs[0] if len(outs) == 1 else TokenOuts(outs=tuple(outs)))

    def _hand_off(self, r: RequestState, held: TokenOut | None = None) -> None:
        self._flush_tokens()  # the first token reaches the coordinator before the decode instance's
        sources = tuple(KvSource(address=a, layer_start=lo, layer_end=hi) for a, lo, hi in self.nodes.stage_layers(r.route))
        self._remove(r)
        self._unledger(r)
        self._send(r.submit.decode_to, DecodeAdmit(submit=r.submit, generated=tuple(r.generated), sources=sources, kv_id=r.kv_id,
                                                   first_out=held))

    # --------------------------------------------------------------- endings

    def _remove(self, r: RequestState) -> None:
        rid = r.submit.request_id
        self.reqs.pop(rid, None)
        self.kv.by_kv.pop(r.kv_id, None)
        if r.group >= 0 and rid in self.members[r.group]:
            self.members[r.group].remove(rid)
        if rid in self.waiting:
            self.waiting.remove(rid)

    def _release(self, r: RequestState) -> None:
        self._release_kv(r)
        self._unledger(r)
        self._remove(r)

    def _fail(self, r: RequestState, error: str, retryable: bool = False) -> None:
        log.warning("scheduler %s: request %s failed: %s", self.instance_id, r.submit.request_id, error)
        self._release(r)
        self._finish_error(r.submit, error, retryable)

    def _finish_error(self, sub: Submit, error: str, retryable: bool = False) -> None:
        self._send(sub.reply_to, TokenOut(request_id=sub.request_id, tokens=(), finished=True, finish_reason="error", error=error, retryable=retryable))

    _HANDLERS: dict[type, Callable[[InstanceScheduler, Any], None]] = {
        ForwardResult: _on_result,
        Submit: _on_submit,
        DecodeAdmit: _on_decode_admit,
        KvLoaded: _on_kv_loaded,
        EngineHello: _on_hello,
        Heartbeat: _on_heartbeat,
        Drain: _on_drain,
        Cancel: _on_cancel,
        Shutdown: _on_shutdown,
    }
