"""The OpenAI-compatible HTTP front end: a FastAPI app served by uvicorn in a background thread.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``"stream": true``
for server-sent events), ``GET /v1/models`` and ``GET /v1/models/{id}`` (with
``max_model_len``), ``GET /health``, ``GET /metrics`` (Prometheus, vLLM's names; open
unless ``metrics_require_key``), ``GET /openapi.json`` and ``/docs`` (generated from the
pydantic request models), and for operators ``GET /admin/instances`` and
``POST /admin/plan`` (bearer ``admin_key``, else ``api_key``). Every error is OpenAI's
``{"error": {...}}`` shape, so the official client raises its matching exception type.

Connections (see :class:`ServerOptions`): the listen backlog is sized for thousands of
clients; a connection idle for ``idle_timeout_s`` (before its first request or between
requests) is closed; a request head must arrive within ``header_timeout_s`` and each part
of its body within ``body_timeout_s`` (else 408, connection closed). HTTP/1.1 framing is
h11's, which reads a body by its declared length whatever the app does with it, so a body
can never be parsed as a request (no smuggling); requests refused before their body is
read (401) drain it first so the connection stays usable, and a body over
``max_body_bytes`` gets 413 and the connection is closed. Streams are chunked responses on
kept-alive connections; a client that goes away mid-stream is noticed at once and its
request is cancelled upstream.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import h11
import msgspec
import uvicorn
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from coral.errors import CoralError
from coral.runtime.protocol import SamplingParams, TokenOut
from coral.runtime.serving.coordinator import Coordinator, ModelInfo, RequestError, RequestHandle
from coral.runtime.serving.metrics import CONTENT_TYPE, FleetStats, ServingMetrics
from coral.runtime.serving.models import ChatRequest, CompletionRequest, collect_ignored
from coral.runtime.serving.tokenizer import ByteTokenizer, StreamDecoder, Tokenizer

__all__ = ["AdminAction", "ApiServer", "LoopInbox", "PlanAdmin", "ServerOptions", "build_app"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_json = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerOptions:
    """How the front end treats clients."""

    api_key: str | None = None  # if set, /v1/* needs "Authorization: Bearer <api_key>"
    admin_key: str | None = None  # bearer key of /admin/* (default api_key)
    metrics_require_key: bool = False  # /metrics is open by default (Prometheus scrapes it)
    max_body_bytes: int = MAX_BODY_BYTES  # larger bodies get 413 and the connection is closed
    token_timeout_s: float = 60.0  # longest wait for a request's next token (then 504)
    idle_timeout_s: float = 5.0  # a connection without a request this long is closed
    header_timeout_s: float = 10.0  # a request head must arrive within this
    body_timeout_s: float = 30.0  # each read of a request body must complete within this
    body_deadline_s: float = 30.0  # the whole body must arrive within this of its head (else 408)
    backlog: int = 4096  # listen queue (the kernel caps it at net.core.somaxconn)
    retry_after_s: int = 5  # the Retry-After of a 503 while the server drains to stop

    def __post_init__(self) -> None:
        for name in ("token_timeout_s", "idle_timeout_s", "header_timeout_s", "body_timeout_s", "body_deadline_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_body_bytes < 1024 or self.backlog < 1:
            raise ValueError("max_body_bytes must be >= 1024 and backlog >= 1")


def _error(status: int, message: str, param: str | None = None, code: str | None = None, *, close: bool = False,
           retry_after_s: int | None = None) -> Response:  # fmt: skip
    type_ = {401: "authentication_error", 404: "invalid_request_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = _json.encode({"error": {"message": message, "type": type_, "param": param, "code": code}})
    headers = {"connection": "close"} if close else {}
    if retry_after_s is not None:
        headers["retry-after"] = str(retry_after_s)
    return Response(content=body, status_code=status, media_type="application/json", headers=headers or None)


def _json_response(obj: Any, status: int = 200) -> Response:
    return Response(content=_json.encode(obj), status_code=status, media_type="application/json")


#: U+0085, U+2028 and U+2029 in their UTF-8 bytes, and their JSON escapes. JSON leaves them raw, but
#: ``str.splitlines`` breaks a line at each, and clients read event streams with it (httpx's
#: ``aiter_lines``, so ``coral bench`` and the chaos soak): a generated byte pair C2 85 cut that event in
#: two, and the client saw a truncated JSON object. Escaped, the event is the same JSON on one line. In
#: valid UTF-8 these byte sequences start with a lead byte, so they are only ever these characters.
_LINE_BREAKS_JSON_KEEPS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def _sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON, on one line for every line splitter."""
    data = _json.encode(obj)
    for raw, escaped in _LINE_BREAKS_JSON_KEEPS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


# ----------------------------------------------------------------------------- the guard


class _Guard:
    """ASGI middleware: API keys, body limits and deadlines, draining, and the error counter.

    It runs before routing, so a refused request never reaches a handler, and it drains
    a refused request's body (bounded by ``max_body_bytes`` and the body deadline) so the
    kept-alive connection's next request starts where the client put it; a refused request
    that asked ``Expect: 100-continue`` is answered without reading its body (the client has
    not sent it: uvicorn sends ``100 Continue`` on the first read, so reading it would invite
    the body of a request already refused).
    """

    def __init__(self, app: ASGIApp, options: ServerOptions, metrics: ServingMetrics) -> None:
        self.app, self.o, self.metrics = app, options, metrics
        self.state: Any = None  # the app's _State (to swap in a restarted coordinator)
        self.draining = False  # set by ApiServer.drain: new API requests get 503 + Retry-After
        self.in_flight = 0  # API requests (/v1/*) being answered now, streams included

    def _key_for(self, path: str) -> str | None:
        if path.startswith("/admin"):
            return self.o.admin_key or self.o.api_key
        if path.startswith("/v1") or (path == "/metrics" and self.o.metrics_require_key):
            return self.o.api_key
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        state: dict[str, Any] = scope.setdefault("state", {})
        deadline = time.monotonic() + self.o.body_deadline_s
        expects_continue = headers.get(b"expect", b"").lower() == b"100-continue"

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.error(state.get("model_name", ""), message["status"])
            await send(message)

        async def refuse(resp: Response) -> None:
            await resp(scope, receive, counted_send)

        if b"transfer-encoding" in headers and b"content-length" in headers:
            # RFC 9112 6.1: a possible smuggling attempt; refuse it and close the connection
            await refuse(_error(400, "both Content-Length and Transfer-Encoding given", close=True))
            return
        length = headers.get(b"content-length")
        declared = int(length) if length is not None and length.isdigit() else None
        if declared is not None and declared > self.o.max_body_bytes:
            await refuse(_error(413, f"body larger than {self.o.max_body_bytes} bytes", close=True))
            return
        key = self._key_for(scope["path"])
        if key:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {key}".encode()):
                drained = not expects_continue and await self._drain(receive, deadline)
                await refuse(_error(401, "Incorrect or missing API key (Authorization: Bearer ...).", None, "invalid_api_key", close=not drained))
                return
        api = scope["path"].startswith("/v1")
        if self.draining and api:
            if not expects_continue:  # read what the client sent, so closing does not reset the answer away
                await self._drain(receive, deadline)
            await refuse(_error(503, "the server is shutting down; retry on another replica or after it restarts", None,
                                "shutting_down", close=True, retry_after_s=self.o.retry_after_s))  # fmt: skip
            return

        received = 0
        body_done = False

        async def guarded_receive() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, min(self.o.body_timeout_s, left)))
            except TimeoutError:
                if left <= self.o.body_timeout_s:
                    raise _BodyError(408, f"request body not received whole within {self.o.body_deadline_s:g} s") from None
                raise _BodyError(408, f"request body not received within {self.o.body_timeout_s:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.o.max_body_bytes:
                    raise _BodyError(413, f"body larger than {self.o.max_body_bytes} bytes")
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        if api:
            self.in_flight += 1
        try:
            await self.app(scope, guarded_receive, counted_send)
        except _BodyError as e:
            await refuse(_error(e.status, e.message, close=True))
        finally:
            if api:
                self.in_flight -= 1

    async def _drain(self, receive: Receive, deadline: float) -> bool:
        """Read and drop a request's body; False if it did not come whole in time (then close)."""
        total = 0
        while True:
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, min(self.o.body_timeout_s, left)))
            except TimeoutError:
                return False
            if message["type"] != "http.request":
                return False
            total += len(message.get("body", b""))
            if total > self.o.max_body_bytes:
                return False
            if not message.get("more_body", False):
                return True


class _BodyError(StarletteHTTPException):
    """A body too slow or too large (an HTTPException, so FastAPI's body reader lets it through)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status, self.message = status, message


# ----------------------------------------------------------------------------- one request


@dataclass(slots=True)
class _Choice:
    """One generated sequence of a request (n choices per prompt, one set per prompt)."""

    index: int
    handle: RequestHandle
    prompt_text: str
    decoder: StreamDecoder
    stops: list[str]
    include_stop: bool
    text: str = ""
    sent: int = 0  # characters of ``text`` already streamed
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)  # TokenLogprob per token
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    t_first: float = 0.0
    t_last: float = 0.0
    queue_s: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, msg: TokenOut, eos_ids: tuple[int, ...], now: float) -> tuple[list[int], list[Any]]:
        """Take one TokenOut; returns the new (tokens, logprobs) it brought."""
        new = list(msg.tokens)
        if new:
            if not self.tokens:
                self.t_first = now
            self.t_last = now
        self.tokens += new
        self.logprobs += list(msg.logprobs)
        if msg.queue_s:
            self.queue_s = msg.queue_s
        self.text += self.decoder.push(new)
        if msg.finished:
            self.text += self.decoder.flush()
        longest = max((len(s) for s in self.stops), default=0)
        if self.stops:
            start = max(0, self.sent - longest + 1)
            hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
            if hits:
                i, s = min(hits)
                self.text = self.text[: i + (len(s) if self.include_stop else 0)]
                self.finish_reason, self.stop_reason = "stop", s
                return new, list(msg.logprobs)
        if msg.finished:
            self.finish_reason = msg.finish_reason or "stop"
            if self.finish_reason == "stop" and self.tokens and self.tokens[-1] in eos_ids:
                self.stop_reason = self.tokens[-1]
        return new, list(msg.logprobs)

    def pending_text(self) -> str:
        """Text ready to stream (a possible stop string's prefix is held back until it resolves)."""
        longest = max((len(s) for s in self.stops), default=0)
        end = len(self.text) if self.done or not longest else max(self.sent, len(self.text) - longest + 1)
        piece = self.text[self.sent : end]
        self.sent = end
        return piece


class LoopInbox:
    """Calls from the coordinator's thread onto the server's event loop, coalesced: whatever
    arrives while a drain is pending rides on it, so a batched step's tokens wake the loop once
    (one ``call_soon_threadsafe``, one self-pipe write) instead of once per token."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[[Any], None], Any]] = []

    def put(self, fn: Callable[[Any], None], arg: Any) -> None:
        with self._lock:
            self._items.append((fn, arg))
            if len(self._items) > 1:
                return  # a drain is already scheduled and will take this one too
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the server's loop has stopped: nobody reads these requests any more
            with self._lock:
                self._items.clear()

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for fn, arg in items:
            fn(arg)


_INBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopInbox] = weakref.WeakKeyDictionary()


def _inbox(loop: asyncio.AbstractEventLoop) -> LoopInbox:
    """The loop's inbox (made on the loop's own thread, the first time a request runs on it)."""
    box = _INBOXES.get(loop)
    if box is None:
        box = _INBOXES[loop] = LoopInbox(loop)
    return box


class _Run:
    """The sub-requests of one HTTP request and the queue their tokens arrive on."""

    def __init__(self, server: _State, req: CompletionRequest | ChatRequest, chat: bool) -> None:
        self.s, self.req, self.chat = server, req, chat
        self.info: ModelInfo = server.coord.check_model(req.model)
        self.tok = server.tokenizer(req.model)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, TokenOut | None]] = asyncio.Queue()  # (choice, msg); None = the client left
        self.choices: list[_Choice] = []
        self.prompt_lens: list[int] = []
        self.max_tokens = 0  # per choice, as submitted (the last prompt's, for vllm:request_params_max_tokens)
        self.t0 = time.perf_counter()
        self.created = int(time.time())

    def _sink(self, k: int) -> Callable[[TokenOut], None]:
        put = self.queue.put_nowait
        box = _inbox(self.loop)

        def sink(msg: TokenOut) -> None:
            box.put(put, (k, msg))

        return sink

    def start(self) -> None:
        """Tokenize, check and submit every choice of every prompt.

        Raises:
            RequestError: 400 on a value that cannot be honoured, or the coordinator's refusal.
        """
        req, tok, info = self.req, self.tok, self.info
        bad = req.unsupported()
        if bad is not None:
            name, value, why = bad
            raise RequestError(400, f"unsupported value {value!r} for field {name!r}: {why}", name)
        if isinstance(req, ChatRequest):
            prompts: list[str | list[int]] = [tok.chat_prompt(req.messages, req.add_generation_prompt)]  # type: ignore[arg-type]
            logprobs = (req.top_logprobs or 0) if req.logprobs else -1
            asked = req.max_completion_tokens or req.max_tokens
        else:
            prompts = req.prompts()
            logprobs = -1 if req.logprobs is None else req.logprobs
            asked = req.max_tokens
        bias: list[tuple[int, float]] = []
        for key, v in (req.logit_bias or {}).items():
            t = int(key)
            if not 0 <= t < info.vocab_size:
                raise RequestError(400, f"logit_bias token id {t} outside the model's vocabulary [0, {info.vocab_size})", "logit_bias")
            bias.append((t, v))
        for t in req.stop_token_ids or []:
            if not 0 <= t < info.vocab_size:
                raise RequestError(400, f"stop_token_ids: token id {t} outside the model's vocabulary [0, {info.vocab_size})", "stop_token_ids")
        try:
            params = SamplingParams(**req.sampling_fields(), logit_bias=tuple(bias), logprobs=logprobs, min_tokens=req.min_tokens)
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        stops = req.stops()
        try:
            chat = isinstance(req, ChatRequest)  # a rendered template: it wrote its own special tokens
            for p in prompts:
                ids = tok.encode(p, add_special_tokens=not chat) if isinstance(p, str) else list(p)
                text = p if isinstance(p, str) else tok.decode(ids)
                self.prompt_lens.append(len(ids))
                max_tokens = asked if asked is not None else max(1, info.max_context - len(ids))
                self.max_tokens = max_tokens
                for j in range(req.n):
                    seed = None if req.seed is None else req.seed + j
                    k = len(self.choices)
                    h = self.s.coord.submit(
                        req.model, ids, max_tokens, params.temperature, seed, req.ignore_eos,
                        sampling=params, stop_ids=tuple(req.stop_token_ids or ()), sink=self._sink(k),
                    )  # fmt: skip
                    self.choices.append(_Choice(index=k, handle=h, prompt_text=text, decoder=tok.stream(), stops=stops, include_stop=req.include_stop_str_in_output))
        except RequestError:
            self.close("error")
            raise

    async def next(self) -> tuple[_Choice, list[int], list[Any]]:
        """The next TokenOut of any choice, applied to it.

        Raises:
            RequestError: 504 if no token comes within the token timeout; the engine's error.
        """
        try:
            async with asyncio.timeout(self.s.options.token_timeout_s):
                k, msg = await self.queue.get()
        except TimeoutError:
            raise RequestError(504, f"no token for {self.s.options.token_timeout_s:.0f} s; request abandoned", None, "timeout") from None
        if msg is None:
            raise _ClientGone
        c = self.choices[k]
        if msg.error:
            code = "instance_failed" if c.handle.error_status == 503 else "engine_error"
            raise RequestError(c.handle.error_status, f"request {c.handle.request_id} failed: {msg.error}", None, code)
        if c.done:
            return c, [], []
        now = time.perf_counter()
        if msg.tokens and c.tokens:
            self.s.metrics.observe_gap(self.req.model, now - c.t_last)
        new, lps = c.feed(msg, c.handle.eos_ids, now)
        if c.done:
            self.s.coord.close(c.handle, "ok")  # a stop string ends it early: cancel upstream
        return c, new, lps

    @property
    def finished(self) -> bool:
        return all(c.done for c in self.choices)

    def close(self, status: str) -> None:
        """Close every choice (cancelling unfinished ones) and account them."""
        now = time.perf_counter()
        for c in self.choices:
            self.s.coord.close(c.handle, status)
            if status == "error":
                continue
            reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
            self.s.metrics.observe_request(
                self.req.model, prompt_tokens=c.handle.prompt_len, output_tokens=len(c.tokens), finished_reason=reason,
                e2e_s=(c.t_last or now) - self.t0, ttft_s=(c.t_first - self.t0) if c.tokens else None, queue_s=c.queue_s,
            )  # fmt: skip

    def usage(self) -> dict[str, int]:
        p = sum(self.prompt_lens)
        n = sum(len(c.tokens) for c in self.choices)
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    # ---------------------------------------------------------------- rendering

    def logprobs_obj(self, c: _Choice, tokens: list[int], lps: list[Any], offset: int) -> Any:
        if not lps:
            return None
        tt = self.tok.token_text
        if self.chat:
            return {"content": [
                {"token": tt(t), "logprob": lp.logprob, "bytes": list(tt(t).encode()),
                 "top_logprobs": [{"token": tt(a.token), "logprob": a.logprob, "bytes": list(tt(a.token).encode())} for a in lp.top]}
                for t, lp in zip(tokens, lps, strict=False)
            ]}  # fmt: skip
        texts = [tt(t) for t in tokens]
        offsets = []
        for s in texts:
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": texts, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{tt(a.token): a.logprob for a in lp.top} for lp in lps], "text_offset": offsets,
        }  # fmt: skip

    def id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.choices[0].handle.request_id if self.choices else 'x'}"

    def response(self) -> dict[str, Any]:
        out = []
        for c in self.choices:
            lp = self.logprobs_obj(c, c.tokens, c.logprobs, len(c.prompt_text) if self._echo else 0)
            if self.chat:
                out.append({"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "token_ids": c.tokens})  # fmt: skip
            else:
                text = (c.prompt_text if self._echo else "") + c.text
                out.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason, "token_ids": c.tokens})  # fmt: skip
        return {
            "id": self.id(), "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
            "model": self.req.model, "choices": out, "usage": self.usage(),
        }  # fmt: skip

    @property
    def _echo(self) -> bool:
        return isinstance(self.req, CompletionRequest) and self.req.echo

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": self.id(), "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created, "model": self.req.model, "choices": choices,
        }  # fmt: skip
        if usage is not None:
            obj["usage"] = usage
        return _sse(obj)

    def chunk_choice(self, c: _Choice, text: str, tokens: list[int], lps: list[Any], offset: int) -> dict[str, Any]:
        lp = self.logprobs_obj(c, tokens, lps, offset)
        fr = c.finish_reason
        if self.chat:
            return {"index": c.index, "delta": {"content": text}, "logprobs": lp, "finish_reason": fr,
                    "stop_reason": c.stop_reason if fr else None, "token_ids": tokens}  # fmt: skip
        return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": fr,
                "stop_reason": c.stop_reason if fr else None, "token_ids": tokens}  # fmt: skip


# ----------------------------------------------------------------------------- the admin surface


class AdminAction(Protocol):
    """One step a pushed plan caused (``start``, ``drain`` or ``keep`` an instance)."""

    @property
    def kind(self) -> str: ...

    @property
    def name(self) -> str: ...


class PlanAdmin(Protocol):
    """The plan controller behind ``/admin/*`` (:class:`coral.runtime.deploy.lifecycle.Controller`
    implements it). The front end only forwards: it does not know the cluster file's schema."""

    def status(self) -> dict[str, Any]:
        """The controller's view: target plan, instances by state, last demand (JSON-ready)."""
        ...

    def push_plan(self, body: Any) -> Sequence[AdminAction]:
        """Validate a plan body (``{"instances": [...]}``) and make it the target.

        Raises:
            CoralError: the body names the field that is wrong (the answer is a 400).
        """
        ...

    def health(self) -> dict[str, str]:
        """model -> ok | degraded | unavailable | starting (the repairs under way included)."""
        ...

    def fleet_stats(self) -> FleetStats:
        """What /metrics reports of the fleet (the registry, starts, repairs, re-plans, the plan's cost)."""
        ...


# ----------------------------------------------------------------------------- the app


@dataclass(slots=True)
class _State:
    coord: Coordinator
    options: ServerOptions
    metrics: ServingMetrics
    tokenizers: dict[str, Tokenizer]
    admin: PlanAdmin | None
    created: int
    default_tokenizer: Tokenizer = field(default_factory=ByteTokenizer)

    def tokenizer(self, model: str) -> Tokenizer:
        return self.tokenizers.get(model, self.default_tokenizer)

    def fleet_stats(self) -> FleetStats:
        """What /metrics reports of the fleet: the plan controller's view, else the coordinator's alone."""
        return self.admin.fleet_stats() if self.admin is not None else self.coord.fleet_stats()

    def health(self) -> dict[str, str]:
        """model -> ok | degraded | unavailable | starting (the controller knows the repairs under way)."""
        return self.admin.health() if self.admin is not None else self.coord.health()


class _ClientGone(Exception):
    """The client of a non-streamed request went away."""


async def _watch_disconnect(request: Request, run: _Run) -> None:
    """Tell the run when the client has gone (the body is already read, so only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    run.queue.put_nowait((-1, None))


async def _complete(run: _Run, request: Request) -> Response:
    watcher = asyncio.ensure_future(_watch_disconnect(request, run))
    try:
        while not run.finished:
            await run.next()
    except _ClientGone:  # cancel its requests upstream; nobody reads the answer
        run.close("abort")
        return Response(status_code=499)
    except RequestError as e:
        run.close("error")
        return _error(e.status, e.message, e.param, e.code)
    except BaseException:
        run.close("abort")
        raise
    finally:
        watcher.cancel()
    run.close("ok")
    return _json_response(run.response())


async def _stream(run: _Run) -> AsyncIterator[bytes]:
    req = run.req
    opts = req.stream_options
    include_usage = opts is not None and opts.include_usage
    continuous = opts is not None and opts.continuous_usage_stats
    status = "abort"
    offsets = {c.index: 0 for c in run.choices}
    try:
        for c in run.choices:
            if run.chat:
                yield run.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            elif run._echo:
                yield run.chunk([run.chunk_choice(c, c.prompt_text, [], [], 0)])
                offsets[c.index] = len(c.prompt_text)
        while not run.finished:
            c, tokens, lps = await run.next()
            text = c.pending_text()
            if not (text or tokens or c.done):
                continue
            choice = run.chunk_choice(c, text, tokens, lps, offsets[c.index])
            offsets[c.index] += sum(len(run.tok.token_text(t)) for t in tokens) if lps else 0
            yield run.chunk([choice], run.usage() if continuous else None)
        if include_usage:
            yield run.chunk([], run.usage())
        status = "ok"
    except RequestError as e:
        status = "error"
        yield _sse({"error": {"message": e.message, "type": "server_error", "param": e.param, "code": e.code}})
    finally:
        run.close(status)  # on a client disconnect the generator is cancelled here: requests cancelled upstream
    yield b"data: [DONE]\n\n"


def build_app(
    coordinator: Coordinator,
    options: ServerOptions | None = None,
    *,
    admin: PlanAdmin | None = None,
    tokenizers: dict[str, Tokenizer] | None = None,
) -> tuple[_Guard, ServingMetrics]:
    """The ASGI application of the front end.

    Args:
        coordinator: the request router.
        options: keys, limits and timeouts.
        admin: the plan controller behind ``/admin/*`` (a :class:`coral.runtime.deploy.lifecycle.Controller`).
        tokenizers: model -> tokenizer (default :class:`ByteTokenizer` for every model).

    Returns:
        (the app with its guard middleware, its metrics).
    """
    o = options or ServerOptions()
    holder: list[_State] = []
    guard: _Guard
    longest = max((m.max_context for m in coordinator.models.values()), default=2)
    metrics = ServingMetrics(lambda: holder[0].fleet_stats() if holder else FleetStats(), max_model_len=longest)
    st = _State(coord=coordinator, options=o, metrics=metrics, tokenizers=dict(tokenizers or {}), admin=admin, created=int(time.time()))
    holder.append(st)
    app = FastAPI(title="Coral OpenAI-compatible API", version="1", openapi_url="/openapi.json", docs_url="/docs", redoc_url=None)

    @app.exception_handler(RequestError)
    async def _on_request_error(request: Request, e: RequestError) -> Response:
        return _error(e.status, e.message, e.param, e.code, retry_after_s=o.retry_after_s if e.status == 503 else None)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, e: RequestValidationError) -> Response:
        err = e.errors()[0]
        loc = [x for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return _error(400, f"malformed JSON body: {err.get('msg')} ({err.get('ctx', {}).get('error', '')})")
        if not loc and err.get("type") == "model_type":
            return _error(400, "the body must be a JSON object")
        param = str(loc[0]) if loc else None
        where = ".".join(str(x) for x in loc) or "body"
        return _error(400, f"invalid field {param!r} ({where}): {err.get('msg')}" if param else f"invalid body: {err.get('msg')}", param)

    @app.exception_handler(ClientDisconnect)
    async def _on_client_left(request: Request, e: ClientDisconnect) -> Response:
        # a client that leaves mid-body is routine (a timeout on its side, a cancelled call): a debug line
        log.debug("client %s left before its %s %s body was read", request.client, request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, e: StarletteHTTPException) -> Response:
        if isinstance(e, _BodyError):
            return _error(e.status, e.message, close=True)
        msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return _error(e.status_code, msg)

    async def _serve(request: Request, body: CompletionRequest | ChatRequest, chat: bool) -> Response:
        if body.model in st.coord.models:  # label only served names (no label per typo)
            request.scope.setdefault("state", {})["model_name"] = body.model
        run = _Run(st, body, chat)
        run.start()
        st.metrics.observe_params(body.model, n=body.n, max_tokens=run.max_tokens)
        if body.stream:
            return StreamingResponse(_stream(run), media_type="text/event-stream", headers={"cache-control": "no-cache"})
        return await _complete(run, request)

    # The two hot endpoints parse their body themselves (pydantic from the raw bytes, in
    # Rust) rather than through FastAPI's dependency machinery: a third of the front end's
    # time per request. Their OpenAPI body schema is still the pydantic model's (below).
    def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
        ref = {"$ref": f"#/components/schemas/{model.__name__}"}
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}

    async def _parse(request: Request, model: type[CompletionRequest] | type[ChatRequest]) -> CompletionRequest | ChatRequest:
        raw = await request.body()
        try:
            with collect_ignored() as ignored:
                body = model.model_validate_json(raw)
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False)) from None
        if ignored.count:
            log.warning("%s", ignored.line())
        return body

    @app.post("/v1/completions", response_model=None, summary="Create a completion", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await _serve(request, await _parse(request, CompletionRequest), chat=False)

    @app.post("/v1/chat/completions", response_model=None, summary="Create a chat completion", openapi_extra=_body_schema(ChatRequest))
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, await _parse(request, ChatRequest), chat=True)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for m in (CompletionRequest, ChatRequest):
                js = m.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[m.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    def _model_card(m: ModelInfo) -> dict[str, Any]:
        return {"id": m.name, "object": "model", "created": st.created, "owned_by": "coral", "root": m.name,
                "parent": None, "max_model_len": m.max_context, "permission": []}  # fmt: skip

    @app.get("/v1/models", summary="List the served models")
    async def models() -> Response:
        return _json_response({"object": "list", "data": [_model_card(st.coord.models[m]) for m in sorted(st.coord.models)]})

    @app.get("/v1/models/{model_id:path}", summary="One served model")
    async def model(model_id: str) -> Response:
        return _json_response(_model_card(st.coord.check_model(model_id)))

    @app.get("/health", summary="Readiness: each model ok, degraded, unavailable or starting")
    async def health() -> Response:
        counts = st.coord.ready_counts()
        models = st.health()
        if guard.draining:
            return _json_response({"status": "draining", "models": models, "instances": counts}, 503)
        serving = all(v in ("ok", "degraded") for v in models.values())
        worst = next((h for h in ("unavailable", "starting", "degraded") if h in models.values()), "ok")
        return _json_response({"status": worst, "models": models, "instances": counts}, 200 if serving else 503)

    @app.get("/metrics", summary="Prometheus metrics (vLLM's names)")
    async def prometheus() -> Response:
        return Response(content=metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/admin/instances", summary="The plan controller's view of the instances")
    def admin_instances() -> Response:
        if st.admin is None:
            raise RequestError(404, "no plan controller")
        return _json_response(st.admin.status())

    @app.post("/admin/plan", summary="Push a new plan")
    def admin_plan(body: Any = Body(...)) -> Response:  # noqa: B008 - FastAPI's idiom
        ctl = st.admin
        if ctl is None:
            raise RequestError(404, "no plan controller")
        try:
            actions = ctl.push_plan(body)
        except CoralError as e:
            raise RequestError(400, str(e), "instances") from None
        return _json_response({"actions": [{"kind": a.kind, "instance": a.name} for a in actions]})

    guard = _Guard(app, o, metrics)
    guard.state = st
    return guard, metrics


# ----------------------------------------------------------------------------- the server


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol with two more timeouts: idle before the first request, and a slow request head."""

    header_timeout_s: float = 10.0

    def connection_made(self, transport: Any) -> None:  # noqa: D102 - asyncio's
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # a response is a head and a body write: without this, Nagle holds the body for
            # the client's delayed ACK (40 ms a response)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        # uvicorn arms its keep-alive timer only after a response: arm it for the first request too
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:  # noqa: D102
        super().data_received(data)
        reading_head = (self.cycle is None or self.cycle.response_complete) and self.conn.their_state is h11.IDLE
        if reading_head and self._head_timer is None and not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.header_timeout_s, self.timeout_keep_alive_handler)
        elif not reading_head and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def on_response_complete(self) -> None:  # noqa: D102
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: D102
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


class ApiServer:
    """The front end served by uvicorn on its own event loop, in a background thread."""

    def __init__(
        self,
        coordinator: Coordinator,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        token_timeout_s: float = 60.0,
        *,
        admin: PlanAdmin | None = None,
        admin_key: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        options: ServerOptions | None = None,
        tokenizers: dict[str, Tokenizer] | None = None,
    ) -> None:
        """Args:
        coordinator: the request router.
        host, port: where to listen (port 0 picks a free one; see :attr:`port`).
        api_key, token_timeout_s, admin_key, max_body_bytes: shorthands for ``options``' fields
            (used when ``options`` is None).
        admin: the plan controller behind ``/admin/*``.
        options: every client-facing setting (:class:`ServerOptions`).
        tokenizers: model -> tokenizer (default :class:`ByteTokenizer`).
        """
        self.options = options or ServerOptions(api_key=api_key, admin_key=admin_key, token_timeout_s=token_timeout_s, max_body_bytes=max_body_bytes)
        self.app, self.metrics = build_app(coordinator, self.options, admin=admin, tokenizers=tokenizers)
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(self.options.backlog)
        self.host, self.port = host, int(self.sock.getsockname()[1])
        protocol = type("CoralH11Protocol", (_Protocol,), {"header_timeout_s": self.options.header_timeout_s})
        config = uvicorn.Config(
            self.app, http=protocol, lifespan="off", log_config=None, access_log=False, backlog=self.options.backlog,
            timeout_keep_alive=self.options.idle_timeout_s, timeout_graceful_shutdown=2, server_header=False,  # type: ignore[arg-type]
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8000``."""
        return f"http://{self.host}:{self.port}"

    @property
    def coordinator(self) -> Coordinator:
        """The coordinator requests go to."""
        return self.app.state.coord  # type: ignore[no-any-return]

    @coordinator.setter
    def coordinator(self, coord: Coordinator) -> None:
        self.app.state.coord = coord

    @property
    def connections(self) -> int:
        """Open client connections now."""
        return len(self.server.server_state.connections)

    def start(self, timeout_s: float = 30.0) -> None:
        """Serve in a daemon thread; returns once the server accepts connections.

        Raises:
            CoralError: if it does not start within ``timeout_s``.
        """
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise CoralError(f"the HTTP server on {self.url} did not start")
            time.sleep(0.01)

    @property
    def in_flight(self) -> int:
        """API requests being answered now (streams included)."""
        return self.app.in_flight

    def drain(self, timeout_s: float = 30.0) -> int:
        """Stop admitting API requests (503 with ``Retry-After``, ``/health`` 503 ``draining``) and wait
        up to ``timeout_s`` for the ones in flight, streams included, to finish.

        Returns:
            The requests still in flight when it gave up waiting (0: all finished).
        """
        self.app.draining = True
        deadline = time.monotonic() + timeout_s
        while self.app.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.app.in_flight

    def stop(self) -> None:
        """Stop serving (open streams get up to 2 s) and close the socket."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.sock.close()
