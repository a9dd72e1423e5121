"""The coordinator: instance registry, request router and the token streams back to HTTP clients.

The coordinator owns one transport inbox. Schedulers register their instance with
:class:`InstanceHello` once all their engine nodes are up; from then on the router sends
requests there. For a request of model ``m`` the router picks a prefill-capable instance
of ``m`` by weighted round-robin in proportion to its throughput and, if it is a
prefill-only instance, a decode instance (same region first, same WRR); the schedulers
then move the KV cache between their nodes themselves. Tokens come back as
:class:`TokenOut` messages and are put on the request's queue, read by the HTTP thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from coral.errors import CoralError
from coral.runtime.protocol import InstanceHello, Shutdown, Submit, TokenOut
from coral.runtime.routing import InstanceView, WeightedRoundRobin, pick_decode, pick_prefill
from coral.runtime.transport import Transport

__all__ = ["Coordinator", "Metrics", "ModelInfo", "RequestError", "RequestHandle"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    """A served model, as the front end needs to know it."""

    name: str
    max_context: int
    vocab_size: int
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_context < 2 or self.vocab_size < 1:
            raise ValueError(f"model {self.name!r}: max_context must be >= 2 and vocab_size >= 1")


class RequestError(CoralError):
    """A request the coordinator refuses; carries the HTTP status and the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass(slots=True)
class RequestHandle:
    """One accepted request: where its tokens arrive, and its timings."""

    request_id: str
    model: str
    prompt_len: int
    queue: queue.Queue[TokenOut]
    t_start: float
    instance_id: str
    t_first: float = 0.0
    t_last: float = 0.0
    n_tokens: int = 0


_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(slots=True)
class _Hist:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, v: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.total += v
        self.n += 1


class Metrics:
    """Prometheus-style counters and histograms per model (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.prompt_tokens: dict[str, int] = {}
        self.generation_tokens: dict[str, int] = {}
        self.ttft: dict[str, _Hist] = {}
        self.tpot: dict[str, _Hist] = {}

    def finish(self, h: RequestHandle, status: str) -> None:
        """Account one ended request."""
        with self._lock:
            key = (h.model, status)
            self.requests[key] = self.requests.get(key, 0) + 1
            self.prompt_tokens[h.model] = self.prompt_tokens.get(h.model, 0) + h.prompt_len
            self.generation_tokens[h.model] = self.generation_tokens.get(h.model, 0) + h.n_tokens
            if h.n_tokens >= 1:
                self.ttft.setdefault(h.model, _Hist(_TTFT_BUCKETS)).observe(h.t_first - h.t_start)
            if h.n_tokens >= 2:
                self.tpot.setdefault(h.model, _Hist(_TPOT_BUCKETS)).observe((h.t_last - h.t_first) / (h.n_tokens - 1))

    def render(self, instances: dict[str, int]) -> str:
        """The Prometheus text exposition (format 0.0.4).

        Args:
            instances: model -> ready instances, exported as a gauge.
        """
        out: list[str] = []
        with self._lock:
            out += ["# HELP coral_requests_total Requests ended, by model and status.", "# TYPE coral_requests_total counter"]
            out += [f'coral_requests_total{{model="{m}",status="{s}"}} {v}' for (m, s), v in sorted(self.requests.items())]
            for name, d, help_ in (
                ("coral_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of ended requests."),
                ("coral_generation_tokens_total", self.generation_tokens, "Generated tokens of ended requests."),
            ):
                out += [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
                out += [f'{name}{{model="{m}"}} {v}' for m, v in sorted(d.items())]
            for name, hists, help_ in (
                ("coral_ttft_seconds", self.ttft, "Time to first token."),
                ("coral_tpot_seconds", self.tpot, "Mean time per output token after the first, per request."),
            ):
                out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
                for m, h in sorted(hists.items()):
                    for b, c in zip(h.buckets, h.counts, strict=True):
                        out.append(f'{name}_bucket{{model="{m}",le="{b}"}} {c}')
                    out.append(f'{name}_bucket{{model="{m}",le="+Inf"}} {h.n}')
                    out.append(f'{name}_sum{{model="{m}"}} {h.total:.6f}')
                    out.append(f'{name}_count{{model="{m}"}} {h.n}')
        out += ["# HELP coral_instances_ready Registered instances, by model.", "# TYPE coral_instances_ready gauge"]
        out += [f'coral_instances_ready{{model="{m}"}} {n}' for m, n in sorted(instances.items())]
        return "\n".join(out) + "\n"


class Coordinator:
    """Registry + router + token dispatch; thread-safe for many HTTP threads."""

    def __init__(self, transport: Transport, models: list[ModelInfo]) -> None:
        """Args:
        transport: the coordinator's inbox (schedulers register and send tokens here).
        models: every model the cluster serves.
        """
        self.t = transport
        self.models = {m.name: m for m in models}
        self.instances: dict[str, tuple[InstanceView, str]] = {}  # id -> (view, scheduler address)
        self._wrr: dict[str, WeightedRoundRobin] = {}
        self._handles: dict[str, RequestHandle] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.metrics = Metrics()
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
            for _view, addr in list(self.instances.values()):
                self.t.send(addr, Shutdown(reason="coordinator stopping"))
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def run(self, poll_s: float = 0.05) -> None:
        """Serve messages until ``stop_event``."""
        while not self.stop_event.is_set():
            msg = self.t.recv(poll_s)
            if msg is None:
                continue
            try:
                self.handle(msg)
            except Exception:
                log.exception("coordinator: failed on %s", type(msg).__name__)

    def handle(self, msg: Any) -> None:
        """Handle one message from a scheduler."""
        if isinstance(msg, TokenOut):
            with self._lock:
                h = self._handles.get(msg.request_id)
            if h is not None:
                h.queue.put(msg)
        elif isinstance(msg, InstanceHello):
            self.register(msg)
        else:
            log.warning("coordinator: ignored unexpected %s", type(msg).__name__)

    # --------------------------------------------------------------- registry

    def register(self, msg: InstanceHello) -> None:
        """Add (or refresh) an instance in the routing table.

        Raises:
            ValueError: for an instance of a model the coordinator does not serve.
        """
        if msg.model not in self.models:
            raise ValueError(f"instance {msg.instance_id} serves unknown model {msg.model!r}")
        view = InstanceView(
            instance_id=msg.instance_id, model=msg.model, phase=msg.phase, region=msg.region,
            throughput_tok_per_s=msg.throughput_tok_per_s,
        )  # fmt: skip
        with self._lock:
            self.instances[msg.instance_id] = (view, msg.address)
            mine = {v.instance_id: v.throughput_tok_per_s for v, _ in self.instances.values() if v.model == msg.model}
            self._wrr[msg.model] = WeightedRoundRobin(mine)
        log.info("coordinator: instance %s (%s, %s) ready", msg.instance_id, msg.model, msg.phase)

    def ready_counts(self) -> dict[str, int]:
        """model -> number of registered instances."""
        with self._lock:
            out = dict.fromkeys(self.models, 0)
            for v, _ in self.instances.values():
                out[v.model] += 1
            return out

    def can_serve(self, model: str) -> bool:
        """Whether ``model`` has a registered prefill-capable instance."""
        with self._lock:
            return any(v.model == model and v.phase != "decode" for v, _ in self.instances.values())

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

    def submit(self, model: str, prompt: list[int], max_tokens: int, temperature: float, seed: int | None) -> RequestHandle:
        """Validate, route and send one request.

        Args:
            model: the served model's name.
            prompt: token ids.
            max_tokens: tokens to generate at most.
            temperature: 0 = greedy.
            seed: sampling seed (None = derived from the request id).

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
            views = [v for v, _ in self.instances.values() if v.model == model]
            addr = {v.instance_id: a for v, a in self.instances.values()}
            wrr = self._wrr.get(model)
            pre = pick_prefill(views, wrr) if wrr else None
            if pre is None:
                raise RequestError(503, f"no instance of model {model!r} is ready", "model", "model_unavailable")
            dec = pick_decode(views, pre.region, wrr) if pre.phase == "prefill" and wrr else None
            rid = f"req-{next(self._ids)}"
            h = RequestHandle(request_id=rid, model=model, prompt_len=len(prompt), queue=queue.Queue(), t_start=time.perf_counter(), instance_id=pre.instance_id)
            self._handles[rid] = h
        sub = Submit(
            request_id=rid, prompt=tuple(prompt), max_tokens=max_tokens, temperature=temperature,
            seed=seed if seed is not None else next(self._ids), eos_ids=info.eos_ids, reply_to=self.t.address,
            decode_to=addr[dec.instance_id] if dec is not None else "",
        )  # fmt: skip
        self.t.send(addr[pre.instance_id], sub)
        return h

    def tokens(self, h: RequestHandle, timeout_s: float) -> Any:
        """Yield each :class:`TokenOut` of a request until it finishes.

        Args:
            h: the request.
            timeout_s: longest wait for the next message.

        Raises:
            RequestError: 504 if a message does not come in time; 500 on an engine error.
        """
        while True:
            try:
                msg = h.queue.get(timeout=timeout_s)
            except queue.Empty:
                raise RequestError(504, f"no token for {timeout_s:.0f} s; request {h.request_id} abandoned", None, "timeout") from None
            if msg.error:
                raise RequestError(500, f"request {h.request_id} failed: {msg.error}", None, "engine_error")
            now = time.perf_counter()
            if msg.tokens:
                if h.n_tokens == 0:
                    h.t_first = now
                h.t_last = now
                h.n_tokens += len(msg.tokens)
            yield msg
            if msg.finished:
                return

    def close(self, h: RequestHandle, status: str) -> None:
        """Forget a request and account it in the metrics."""
        with self._lock:
            self._handles.pop(h.request_id, None)
        self.metrics.finish(h, status)
