"""The coordinator: instance registry, request router and the token streams back to HTTP clients.

The coordinator owns one transport inbox. Schedulers register their instance with
:class:`InstanceHello` once all their engine nodes are up; from then on the router sends
requests there. For a request of model ``m`` the router picks a prefill-capable instance
of ``m`` by weighted round-robin in proportion to its throughput and, if it is a
prefill-only instance, a decode instance (same region first, same WRR); the schedulers
then move the KV cache between their nodes themselves. Tokens come back as
:class:`TokenOut` messages (a forward step's in one :class:`TokenOuts`) and are put on the request's queue,
read by the HTTP thread.

Routing decisions are the shared pure policies of :mod:`coral.policy` (smooth WRR,
``choose_decode``, the instance :class:`~coral.policy.Lifecycle`), the same the simulator
runs. Faults: schedulers heartbeat the coordinator; an instance that reports ``failed`` or
goes silent leaves the routing table and its requests are resent to another instance
(prompt + tokens already streamed, so the client sees one uninterrupted answer), at most
``max_retries`` times, else they end with an explicit error. A restarted coordinator
rebuilds its registry from the heartbeats (they carry the instance's registration).

Its parts: :mod:`~coral.runtime.serving.requests` (a request's handle, a refusal),
:mod:`~coral.runtime.serving.routing` (the routing choices), :mod:`~coral.runtime.serving.window`
(the live planner's window) and :mod:`~coral.runtime.serving.registry` (the registry records and
what they report); this module keeps the loop, registration, faults, drains and the request path.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from coral.policy import (
    ROUTERS,
    Lifecycle,
    LifecycleEvent,
    next_state,
)
from coral.runtime.protocol import (
    Cancel,
    Drain,
    Heartbeat,
    InstanceHello,
    InstancePhase,
    Role,
    SamplingParams,
    Shutdown,
    Submit,
    TokenOut,
    TokenOuts,
)
from coral.runtime.serving.registry import InstanceRecord, ModelTotals, RegistryReports
from coral.runtime.serving.requests import ModelInfo, RequestError, RequestHandle
from coral.runtime.serving.routing import InstanceView, RouteStates, pick_decode, pick_prefill
from coral.runtime.serving.window import RequestWindow
from coral.runtime.transport import Transport

__all__ = [
    "Coordinator",
    "InstanceRecord",
    "ModelInfo",
    "RequestError",
    "RequestHandle",
]

log = logging.getLogger(__name__)


class Coordinator(RegistryReports):
    """Registry + router + token dispatch + fault handling; thread-safe for many HTTP threads."""

    def __init__(
        self,
        transport: Transport,
        models: list[ModelInfo],
        *,
        heartbeat_s: float = 0.25,
        heartbeat_timeout_s: float = 2.0,
        max_retries: int = 2,
        retry_wait_s: float = 30.0,
        router: str = "least-work",
    ) -> None:
        """Args:
        transport: the coordinator's inbox (schedulers register and send tokens here).
        models: every model the cluster serves.
        heartbeat_s: how often to heartbeat the schedulers.
        heartbeat_timeout_s: a scheduler silent this long is dead; its instance leaves routing.
        max_retries: how many times a request hit by an instance failure is resent.
        retry_wait_s: how long a request to retry waits for an instance of its model.
        router: "least-work" (default, as the simulator): prefill to the instance whose outstanding
            prompt tokens clear soonest at its throughput, decode to the least occupied; "wrr":
            the paper's smooth weighted round-robin ∝ throughput.
        """
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
        self.router = router
        self.t = transport
        self.models = {m.name: m for m in models}
        self.instances: dict[str, InstanceRecord] = {}
        self.retired: dict[str, str] = {}  # instance id -> "stopped" | "lost: reason"
        self.events: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=10_000)
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_retries = max_retries
        self.retry_wait_s = retry_wait_s
        self._routes: dict[str, RouteStates] = {}
        self._handles: dict[str, RequestHandle] = {}
        self._wire: dict[str, RequestHandle] = {}
        self._parked: list[RequestHandle] = []
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._index = itertools.count(1)
        self._last_beat = 0.0
        self._demand: dict[tuple[str, str], int] = {}
        self._demand_t0 = time.monotonic()
        self._window = RequestWindow(list(self.models), t0=self._demand_t0)  # the live planner's epoch window
        self.retried = 0
        self.failed_requests = 0
        self.load_at_drain: dict[str, int] = {}  # instance id -> requests it held when its drain began
        self._totals: dict[str, ModelTotals] = {m.name: ModelTotals() for m in models}
        self._model_of: dict[str, str] = {}  # instance id -> model, registered or retired
        self.cache_dtype = "float32"  # what vllm:cache_config_info reports (the cluster's dtype)
        #: model -> until when a replacement instance is expected (self-repair): a request that finds
        #: no instance waits for it (parked) instead of a 503
        self.expected: dict[str, float] = {}
        #: new requests that found no instance of their model taking requests and were held for a replacement
        self.held_requests = 0
        self.stop_event = threading.Event()
        self._thread: threading.Thread | None = None

    # --------------------------------------------------------------- loop

    def start(self) -> None:
        """Run the receive loop in a daemon thread."""
        self._thread = threading.Thread(target=self.run, name="coordinator", daemon=True)
        self._thread.start()

    def stop(self, shutdown_instances: bool = False) -> None:
        """Stop the loop (and optionally tell every scheduler to shut its instance down)."""
        if shutdown_instances:
            with self._lock:
                for rec in list(self.instances.values()):
                    self.t.send(rec.address, Shutdown(reason="coordinator stopping"))
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def run(self, poll_s: float = 0.05) -> None:
        """Serve messages until ``stop_event``."""
        while not self.stop_event.is_set():
            msg = self.t.recv(min(poll_s, self.heartbeat_s))
            try:
                if msg is not None:
                    self.handle(msg)
                self.tick()
            except Exception:
                log.exception("coordinator: failed on %s", type(msg).__name__)

    def handle(self, msg: Any) -> None:
        """Handle one message from a scheduler."""
        if isinstance(msg, TokenOut):
            self._on_token(msg)
        elif isinstance(msg, TokenOuts):
            for out in msg.outs:
                self._on_token(out)
        elif isinstance(msg, Heartbeat):
            self._on_heartbeat(msg)
        elif isinstance(msg, InstanceHello):
            self.register(msg)
        else:
            log.warning("coordinator: ignored unexpected %s", type(msg).__name__)

    def tick(self, now: float | None = None) -> None:
        """Periodic work: heartbeats out, dead instances out, parked retries, finished drains."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if now - self._last_beat >= self.heartbeat_s:
                self._last_beat = now
                beat = Heartbeat(sender=self.t.address, role=Role.COORDINATOR)
                for rec in self.instances.values():
                    self.t.send(rec.address, beat)
            for iid, rec in list(self.instances.items()):
                if now - rec.last_seen > self.heartbeat_timeout_s:
                    self._lost(iid, f"no heartbeat for {now - rec.last_seen:.1f} s")
            if self._parked:
                parked, self._parked = self._parked, []
                for h in parked:
                    if h.done:
                        continue
                    if not self._dispatch(h) and not h.done:
                        if now > h.retry_deadline:
                            self._give_up(h, f"no instance of model {h.model!r} to retry on within {self.retry_wait_s:.0f} s")
                        else:
                            self._parked.append(h)
            for iid, rec in list(self.instances.items()):
                if rec.state is Lifecycle.DRAINING and rec.reported_in_flight == 0 and self._load(iid) == 0:
                    rec.state = next_state(rec.state, LifecycleEvent.IDLE, in_flight=0)
                    self.t.send(rec.address, Shutdown(reason="drained"))
                    del self.instances[iid]
                    self.retired[iid] = "stopped"
                    self._event(iid, "stopped")

    def _event(self, iid: str, what: str) -> None:
        self.events.append((time.monotonic(), iid, what))
        log.info("coordinator: instance %s %s", iid, what)

    # --------------------------------------------------------------- registry

    def register(self, msg: InstanceHello, state: Lifecycle = Lifecycle.ACTIVE) -> None:
        """Add (or refresh) an instance in the routing table.

        Args:
            msg: the instance's registration.
            state: ACTIVE for a new instance; DRAINING when a restarted coordinator learns
                of one that was draining.

        Raises:
            ValueError: for an instance of a model the coordinator does not serve.
        """
        if msg.model not in self.models:
            raise ValueError(f"instance {msg.instance_id} serves unknown model {msg.model!r}")
        with self._lock:
            if msg.instance_id in self.retired:
                self.t.send(msg.address, Shutdown(reason="instance retired"))
                return
            now = time.monotonic()
            rec = self.instances.get(msg.instance_id)
            if rec is not None:
                rec.last_seen = now
                return
            view = InstanceView(
                instance_id=msg.instance_id, model=msg.model, phase=msg.phase, region=msg.region,
                throughput_tok_per_s=msg.throughput_tok_per_s, index=next(self._index),
            )  # fmt: skip
            if state is Lifecycle.ACTIVE:
                state = next_state(Lifecycle.STARTING, LifecycleEvent.READY, in_flight=0)
            self.instances[msg.instance_id] = InstanceRecord(view=view, address=msg.address, state=state, last_seen=now, t_registered=now)
            self._model_of[msg.instance_id] = msg.model
            self._event(msg.instance_id, "ready" if state is Lifecycle.ACTIVE else "re-registered draining")

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        if msg.role is not Role.SCHEDULER:
            return
        with self._lock:
            rec = self.instances.get(msg.instance_id)
            if msg.state is Lifecycle.FAILED:
                if rec is not None:
                    self._lost(msg.instance_id, msg.reason or "instance reported failed")
                return
            if rec is None:
                if msg.instance_id in self.retired:
                    self.t.send(msg.sender, Shutdown(reason="instance retired"))
                elif msg.hello is not None and msg.state in (Lifecycle.ACTIVE, Lifecycle.DRAINING) and msg.hello.model in self.models:
                    # a restarted coordinator: rebuild the registry from the instances' heartbeats
                    self.register(msg.hello, Lifecycle.DRAINING if msg.state is Lifecycle.DRAINING else Lifecycle.ACTIVE)
                    rec = self.instances.get(msg.instance_id)
                if rec is None:
                    return
            rec.last_seen = time.monotonic()
            rec.reported_in_flight = msg.in_flight
            rec.reported_state = msg.state
            rec.reported_waiting = msg.waiting
            rec.reported_kv_usage = msg.kv_cache_usage
            if msg.stats is not None:
                self._totals[rec.view.model].add(msg.stats, rec.stats)
                if msg.stats.lost_nodes != rec.lost_nodes:
                    self._event(msg.instance_id, f"degraded (lost node(s) {', '.join(msg.stats.lost_nodes)})")
                rec.stats = msg.stats

    def _lost(self, iid: str, reason: str) -> None:
        """An instance died: out of routing, its requests resent elsewhere (lock held)."""
        rec = self.instances.pop(iid, None)
        if rec is None:
            return
        rec.state = next_state(rec.state, LifecycleEvent.FAIL, in_flight=self._load(iid))
        self.retired[iid] = f"lost: {reason}"
        self._event(iid, f"lost ({reason})")
        for h in [h for h in self._wire.values() if iid in (h.instance_id, h.decode_instance)]:
            if h.instance_id == iid and self._decoding_elsewhere(h):
                h.instance_id = h.decode_instance  # it needs nothing of the lost prefill instance any more
                continue
            self._retry(h, f"instance {iid} failed: {reason}")
        forget = getattr(self.t, "forget", None)
        if forget is not None:
            forget(rec.address)  # the peer is gone: do not queue messages for it any more

    def _decoding_elsewhere(self, h: RequestHandle) -> bool:
        """Whether ``h``'s decode instance (alive) already holds its whole KV (lock held): it has sent a
        token of its own, the first one in ``first_token`` "decode" mode (it sends it once every layer
        is in), else the second (the first came from the prefill instance)."""
        if not h.decode_instance or h.decode_instance == h.instance_id or h.decode_instance not in self.instances:
            return False
        return h.attempt_tokens >= (1 if self.models[h.model].first_token == "decode" else 2)

    def drain(self, iid: str, reason: str = "removed from the plan") -> bool:
        """Stop routing new requests to an instance; it is shut down once it holds none.

        Returns:
            False if no such registered instance.
        """
        with self._lock:
            rec = self.instances.get(iid)
            if rec is None:
                return False
            if rec.state is Lifecycle.ACTIVE:
                # DRAIN, not REMOVE: even an instance idle by our count stops only on the scheduler's
                # own count (a request may be on its way) - see tick()
                rec.state = next_state(rec.state, LifecycleEvent.DRAIN, in_flight=self._load(iid))
                rec.t_drain = time.monotonic()
                self.load_at_drain[iid] = self._load(iid)
                self.t.send(rec.address, Drain(reason=reason))
                self._event(iid, "draining")
            return True

    # --------------------------------------------------------------- requests

    def check_model(self, model: str) -> ModelInfo:
        """The served model of that name.

        Raises:
            RequestError: 404 listing the served models.
        """
        info = self.models.get(model)
        if info is None:
            served = ", ".join(sorted(self.models)) or "(none)"
            raise RequestError(404, f"The model {model!r} does not exist; served models: {served}", "model", "model_not_found")
        return info

    def submit(
        self, model: str, prompt: list[int], max_tokens: int, temperature: float, seed: int | None, ignore_eos: bool = False,
        *, sampling: SamplingParams | None = None, stop_ids: Sequence[int] = (), sink: Callable[[TokenOut], None] | None = None,
    ) -> RequestHandle:  # fmt: skip
        """Validate, route and send one request.

        Args:
            model: the served model's name.
            prompt: token ids.
            max_tokens: tokens to generate at most.
            temperature: 0 = greedy (ignored when ``sampling`` is given).
            seed: sampling seed (None = derived from the request id).
            ignore_eos: generate ``max_tokens`` tokens even past an end-of-sequence token.
            sampling: every other sampling parameter (its seed and stop ids are filled in here).
            stop_ids: token ids that end the request like EOS (even with ``ignore_eos``).
            sink: receives each TokenOut on the coordinator's thread (default: the handle's queue).

        Returns:
            The handle whose queue receives the tokens; call :meth:`close` when done.

        Raises:
            RequestError: 404 unknown model, 400 bad prompt or length, 503 no instance.
        """
        info = self.check_model(model)
        if not prompt:
            raise RequestError(400, "prompt must not be empty", "prompt")
        if len(prompt) >= info.max_context:
            raise RequestError(400, f"prompt of {len(prompt)} tokens does not fit the model's context of {info.max_context} tokens", "prompt", "context_length_exceeded")
        if len(prompt) + max_tokens > info.max_context:
            raise RequestError(400, f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the model's context of {info.max_context} tokens", "max_tokens", "context_length_exceeded")
        bad = [t for t in prompt if not 0 <= t < info.vocab_size]
        if bad:
            raise RequestError(400, f"token id {bad[0]} outside the model's vocabulary [0, {info.vocab_size})", "prompt")
        with self._lock:
            rid = f"req-{next(self._ids)}"
            seed_ = seed if seed is not None else next(self._ids)
            eos = (() if ignore_eos else info.eos_ids) + tuple(t for t in stop_ids if ignore_eos or t not in info.eos_ids)
            if sampling is not None:
                temperature = sampling.temperature
                sampling = msgspec.structs.replace(sampling, seed=seed_, stop_ids=eos, prompt_len=len(prompt))
            h = RequestHandle(
                request_id=rid, model=model, prompt_len=len(prompt), queue=queue.Queue(), t_start=time.perf_counter(),
                instance_id="", prompt=tuple(prompt), max_tokens=max_tokens, temperature=temperature,
                seed=seed_, eos_ids=eos, sampling=sampling, sink=sink,
            )  # fmt: skip
            if not self._dispatch(h):
                until = self.expected.get(model, 0.0)
                if time.monotonic() >= until:
                    raise RequestError(503, f"no instance of model {model!r} is ready", "model", "model_unavailable")
                # an instance of it is being replaced: wait for it, as a retried request does
                h.retry_deadline = until
                self._parked.append(h)
                self.held_requests += 1
            self._handles[rid] = h
            self._demand[(model, "prefill")] = self._demand.get((model, "prefill"), 0) + len(prompt)
            h.window = self._window.record(model, time.monotonic(), len(prompt), h.generated)
        return h

    def _dispatch(self, h: RequestHandle) -> bool:
        """Route and send the request's next attempt (lock held); False if no instance takes it."""
        views = [r.view for r in self.instances.values() if r.view.model == h.model and r.state is Lifecycle.ACTIVE]
        states = self._routes.get(h.model, {})
        load: dict[str, float] | None = None
        held: dict[str, float] | None = None
        if self.router == "least-work":
            load, held = {}, {}
            for other in self._wire.values():  # outstanding work per instance, from the live attempts
                if other.done or other.model != h.model:
                    continue
                if not other.generated:  # no token yet: its prefill is queued or running
                    load[other.instance_id] = load.get(other.instance_id, 0.0) + other.prompt_len
                if other.decode_instance:
                    held[other.decode_instance] = held.get(other.decode_instance, 0.0) + 1.0
        pre, states = pick_prefill(views, states, load=load, new_work=float(h.prompt_len))
        if pre is None:
            return False
        dec = None
        if pre.phase is InstancePhase.PREFILL:
            dec, states = pick_decode(views, pre.region, states, held=held)
        self._routes[h.model] = states
        h.instance_id, h.decode_instance = pre.instance_id, dec.instance_id if dec is not None else ""
        h.wire_id = h.request_id if h.retries == 0 else f"{h.request_id}.{h.retries}"
        h.attempt_tokens = 0
        self._wire[h.wire_id] = h
        now = time.monotonic()
        for iid in (pre.instance_id, h.decode_instance):
            rec = self.instances.get(iid)
            if rec is not None:
                rec.routed += 1
                if not rec.t_first_request:
                    rec.t_first_request = now
                    self._event(iid, "first request")
        sub = Submit(
            request_id=h.wire_id, prompt=h.prompt + tuple(h.generated), max_tokens=h.max_tokens - len(h.generated),
            temperature=h.temperature, seed=h.seed, eos_ids=h.eos_ids, reply_to=self.t.address,
            decode_to=self.instances[dec.instance_id].address if dec is not None else "", sampling=h.sampling,
            first_token=self.models[h.model].first_token if dec is not None else "prefill",
        )  # fmt: skip
        self.t.send(self.instances[pre.instance_id].address, sub)
        return True

    def _cancel_attempt(self, h: RequestHandle) -> None:
        """Forget the current attempt and tell its (live) instances to drop it (lock held)."""
        self._wire.pop(h.wire_id, None)
        for iid in {h.instance_id, h.decode_instance} - {""}:
            rec = self.instances.get(iid)
            if rec is not None:
                self.t.send(rec.address, Cancel(request_ids=(h.wire_id,)))

    def _retry(self, h: RequestHandle, reason: str) -> None:
        """Resend a request whose instance failed, or end it with an explicit error (lock held)."""
        self._cancel_attempt(h)
        if h.retries >= self.max_retries:
            self._give_up(h, f"{reason}; gave up after {h.retries} retries")
            return
        h.retries += 1
        self.retried += 1
        log.warning("coordinator: retrying %s (attempt %d): %s", h.request_id, h.retries + 1, reason)
        if not self._dispatch(h):
            h.retry_deadline = time.monotonic() + self.retry_wait_s
            self._parked.append(h)

    def _give_up(self, h: RequestHandle, reason: str) -> None:
        h.done = True
        h.error_status = 503
        self.failed_requests += 1
        self._wire.pop(h.wire_id, None)
        h.deliver(TokenOut(request_id=h.request_id, tokens=(), finished=True, finish_reason="error", error=reason))

    def _on_token(self, msg: TokenOut) -> None:
        with self._lock:
            h = self._wire.get(msg.request_id)
            if h is None or h.done:
                return  # a cancelled or superseded attempt
            if msg.error and msg.retryable:
                self._retry(h, msg.error)
                return
            h.generated.extend(msg.tokens)
            h.attempt_tokens += len(msg.tokens)
            self._demand[(h.model, "decode")] = self._demand.get((h.model, "decode"), 0) + len(msg.tokens)
            if msg.finished:
                h.done = True
                del self._wire[msg.request_id]
                if msg.error:
                    self.failed_requests += 1
        h.deliver(msg)

    def tokens(self, h: RequestHandle, timeout_s: float) -> Any:
        """Yield each :class:`TokenOut` of a request until it finishes.

        Args:
            h: the request.
            timeout_s: longest wait for the next message.

        Raises:
            RequestError: 504 if a message does not come in time; 500 on an engine error;
                503 when the request's instances failed more than ``max_retries`` times.
        """
        while True:
            try:
                msg = h.queue.get(timeout=timeout_s)
            except queue.Empty:
                raise RequestError(504, f"no token for {timeout_s:.0f} s; request {h.request_id} abandoned", None, "timeout") from None
            if msg.error:
                code = "instance_failed" if h.error_status == 503 else "engine_error"
                raise RequestError(h.error_status, f"request {h.request_id} failed: {msg.error}", None, code)
            now = time.perf_counter()
            if msg.tokens:
                if h.n_tokens == 0:
                    h.t_first = now
                h.t_last = now
                h.n_tokens += len(msg.tokens)
            yield msg
            if msg.finished:
                return

    def close(self, h: RequestHandle, status: str = "ok") -> None:
        """Forget a request (an unfinished one is cancelled upstream).

        Args:
            h: the request.
            status: why it ends (``ok``, ``error``, ``abort``), for the log.
        """
        with self._lock:
            self._handles.pop(h.request_id, None)
            if h.window is not None:
                self._window.settle(h.window)  # its token count stays in the window, its tokens go
                h.window = None
            if not h.done:
                h.done = True
                self._cancel_attempt(h)
                if h in self._parked:
                    self._parked.remove(h)
                log.debug("coordinator: %s closed before it finished (%s)", h.request_id, status)

