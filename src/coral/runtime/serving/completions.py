"""One completion request through the front end: submit every choice, gather its tokens, answer whole or streamed.

``/v1/completions`` and ``/v1/chat/completions`` parse their own body (pydantic from the raw
bytes) and go through :class:`CompletionRun`: tokenize and submit one sub-request per choice
and prompt, take their tokens from the coordinator's thread through a coalescing
:class:`LoopInbox`, apply stop strings, and render OpenAI's completion or chunk objects.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from coral.runtime.protocol import SamplingParams, TokenOut
from coral.runtime.serving.coordinator import ModelInfo, RequestError, RequestHandle
from coral.runtime.serving.models import ChatRequest, CompletionRequest, collect_ignored
from coral.runtime.serving.responses import error_response, json_response, sse_event
from coral.runtime.serving.server_state import ServerState
from coral.runtime.serving.tokenizer import StreamDecoder

__all__ = ["CompletionRun", "LoopInbox", "add_completion_routes"]

log = logging.getLogger(__name__)


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


class CompletionRun:
    """The sub-requests of one HTTP request and the queue their tokens arrive on."""

    def __init__(self, server: ServerState, req: CompletionRequest | ChatRequest, chat: bool) -> None:
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
        return sse_event(obj)

    def chunk_choice(self, c: _Choice, text: str, tokens: list[int], lps: list[Any], offset: int) -> dict[str, Any]:
        lp = self.logprobs_obj(c, tokens, lps, offset)
        fr = c.finish_reason
        if self.chat:
            return {"index": c.index, "delta": {"content": text}, "logprobs": lp, "finish_reason": fr,
                    "stop_reason": c.stop_reason if fr else None, "token_ids": tokens}  # fmt: skip
        return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": fr,
                "stop_reason": c.stop_reason if fr else None, "token_ids": tokens}  # fmt: skip



class _ClientGone(Exception):
    """The client of a non-streamed request went away."""


async def _watch_disconnect(request: Request, run: CompletionRun) -> None:
    """Tell the run when the client has gone (the body is already read, so only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    run.queue.put_nowait((-1, None))


async def _complete(run: CompletionRun, request: Request) -> Response:
    watcher = asyncio.ensure_future(_watch_disconnect(request, run))
    try:
        while not run.finished:
            await run.next()
    except _ClientGone:  # cancel its requests upstream; nobody reads the answer
        run.close("abort")
        return Response(status_code=499)
    except RequestError as e:
        run.close("error")
        return error_response(e.status, e.message, e.param, e.code)
    except BaseException:
        run.close("abort")
        raise
    finally:
        watcher.cancel()
    run.close("ok")
    return json_response(run.response())


async def _stream(run: CompletionRun) -> AsyncIterator[bytes]:
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
        yield sse_event({"error": {"message": e.message, "type": "server_error", "param": e.param, "code": e.code}})
    finally:
        run.close(status)  # on a client disconnect the generator is cancelled here: requests cancelled upstream
    yield b"data: [DONE]\n\n"


# ----------------------------------------------------------------------------- the routes


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


async def _serve(st: ServerState, request: Request, body: CompletionRequest | ChatRequest, chat: bool) -> Response:
    if body.model in st.coord.models:  # label only served names (no label per typo)
        request.scope.setdefault("state", {})["model_name"] = body.model
    run = CompletionRun(st, body, chat)
    run.start()
    st.metrics.observe_params(body.model, n=body.n, max_tokens=run.max_tokens)
    if body.stream:
        return StreamingResponse(_stream(run), media_type="text/event-stream", headers={"cache-control": "no-cache"})
    return await _complete(run, request)


def add_completion_routes(app: FastAPI, st: ServerState) -> None:
    """``POST /v1/completions`` and ``POST /v1/chat/completions``, and the OpenAPI schema of their bodies.

    The two hot endpoints parse their body themselves (pydantic from the raw bytes, in Rust)
    rather than through FastAPI's dependency machinery: a third of the front end's time per
    request. Their OpenAPI body schema is still the pydantic model's.
    """

    @app.post("/v1/completions", response_model=None, summary="Create a completion", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await _serve(st, request, await _parse(request, CompletionRequest), chat=False)

    @app.post("/v1/chat/completions", response_model=None, summary="Create a chat completion", openapi_extra=_body_schema(ChatRequest))
    async def chat_completions(request: Request) -> Response:
        return await _serve(st, request, await _parse(request, ChatRequest), chat=True)

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
