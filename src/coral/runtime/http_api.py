"""The OpenAI-compatible HTTP front end of the coordinator (standard library ``http.server``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``"stream": true`` for server-sent events), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text), and for operators ``GET /admin/instances`` and
``POST /admin/plan`` (push a new plan; bearer ``admin_key``, else ``api_key``). Bodies are validated with pydantic
(``extra="forbid"``); every error is OpenAI's ``{"error": {...}}`` shape.

No tokenizer weights are available, so text goes through :class:`ByteTokenizer`: a
prompt may be a list of token ids (used as is) or a string, whose UTF-8 bytes are the
token ids (0-255); generated ids are rendered as the byte ``id % 256``. Every choice
also carries the generated ``token_ids`` (an extension, like vLLM's).
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from coral.errors import CoralError
from coral.runtime.coordinator import Coordinator, RequestError, RequestHandle

__all__ = ["ApiServer", "ByteTokenizer", "ChatRequest", "CompletionRequest"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024


class ByteTokenizer:
    """Deterministic byte-level tokenizer: token id = UTF-8 byte; decode renders ``id % 256``."""

    @staticmethod
    def encode(text: str) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes)."""
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids: list[int]) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD)."""
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")

    @staticmethod
    def chat_prompt(messages: list[ChatMessage]) -> str:
        """The built-in chat template: ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``."""
        parts = []
        for m in messages:
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
            parts.append(f"<|{m.role}|>\n{content}\n")
        return "".join(parts) + "<|assistant|>\n"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """OpenAI's ``stream_options``."""

    include_usage: bool = Field(False, description="Send a last chunk with token usage.")


class _Sampling(_Strict):
    model: str = Field(description="Name of a served model (see /v1/models).")
    max_tokens: StrictInt = Field(16, ge=1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy; otherwise seeded sampling.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Accepted for compatibility; only 1.0 is honoured.")
    seed: StrictInt | None = Field(None, description="Sampling seed; same seed, same tokens.")
    stream: bool = Field(False, description="Stream server-sent events as tokens are produced.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    n: StrictInt = Field(1, ge=1, le=1, description="Choices per request; only 1 is supported.")
    user: str | None = Field(None, description="End-user id (ignored).")
    ignore_eos: bool = Field(False, description="Keep generating past end-of-sequence tokens (vLLM's extension; for benchmarks).")


class CompletionRequest(_Sampling):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[StrictInt] = Field(description="Text (byte-tokenized) or a list of token ids.")


class TextPart(_Strict):
    """A text part of a chat message's content."""

    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text.")


class ChatMessage(_Strict):
    """One chat message."""

    role: Literal["system", "user", "assistant", "tool", "developer"] = Field(description="Author role.")
    content: str | list[TextPart] = Field(description="Text, or a list of text parts.")
    name: str | None = Field(None, description="Author name (ignored).")


class ChatRequest(_Sampling):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        # small responses on keep-alive connections: no Nagle / delayed-ACK stalls (40 ms)
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("http: " + format, *args)

    # ---------------------------------------------------------------- plumbing

    def _send_json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, e: RequestError) -> None:
        type_ = {401: "authentication_error", 404: "invalid_request_error"}.get(e.status, "invalid_request_error" if e.status < 500 else "server_error")
        self._send_json(e.status, error_body(e.message, type_, e.param, e.code))

    def _tokenizer(self, model: str) -> Any:
        """The model's tokenizer (:mod:`coral.runtime.engine.tokenizer`), bytes by default."""
        from coral.runtime.engine.tokenizer import ByteTokenizer as _Bytes

        return self.server.tokenizers.get(model) or _Bytes()

    def _authorized(self, admin: bool = False) -> bool:
        key = (self.server.admin_key or self.server.api_key) if admin else self.server.api_key
        if not key:
            return True
        given = self.headers.get("Authorization", "").encode("utf-8", "replace")
        if hmac.compare_digest(given, f"Bearer {key}".encode()):
            return True
        self._send_error(RequestError(401, "Incorrect or missing API key (Authorization: Bearer ...).", None, "invalid_api_key"))
        return False

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True  # the body (if any) was not read: do not reuse the connection
            raise RequestError(411, "a Content-Length header is required")
        limit = self.server.max_body_bytes
        if int(length) > limit:
            self.close_connection = True
            raise RequestError(413, f"body larger than {limit} bytes")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"malformed JSON body: {e}") from None
        except RecursionError:
            raise RequestError(400, "malformed JSON body: nested too deeply") from None

    # ---------------------------------------------------------------- routes

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        path = self.path.split("?", 1)[0]
        coord = self.server.coordinator
        if path == "/health":
            counts = coord.ready_counts()
            ok = all(coord.can_serve(m) for m in counts)
            self._send_json(200 if ok else 503, {"status": "ok" if ok else "starting", "instances": counts})
        elif path == "/v1/models":
            if self._authorized():
                data = [{"id": m, "object": "model", "created": self.server.created, "owned_by": "coral"} for m in sorted(coord.models)]
                self._send_json(200, {"object": "list", "data": data})
        elif path == "/admin/instances":
            if self._authorized(admin=True):
                if self.server.admin is None:
                    self._send_error(RequestError(404, "no plan controller"))
                else:
                    self._send_json(200, self.server.admin.status())
        elif path == "/metrics":
            if self._authorized():
                text = coord.metrics.render(coord.ready_counts()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)
        else:
            self._send_error(RequestError(404, f"no route GET {path}"))

    def _admin_plan(self) -> None:
        from coral.runtime.cluster_config import parse_instances

        if not self._authorized(admin=True):
            return
        ctl = self.server.admin
        try:
            body = self._read_json()
            if ctl is None:
                raise RequestError(404, "no plan controller")
            try:
                desired = parse_instances(body, ctl.cluster)
            except CoralError as e:
                raise RequestError(400, str(e), "instances") from None
            actions = ctl.apply_plan(desired)
        except RequestError as e:
            self._send_error(e)
            return
        self._send_json(200, {"actions": [{"kind": a.kind, "instance": a.name} for a in actions]})

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        try:
            self._post()
        except OSError:
            raise  # the client went away; http.server closes the connection
        except Exception as e:  # a bug must cost one request, never the server
            log.exception("http: unexpected error on POST %s", self.path)
            self.close_connection = True
            try:
                self._send_error(RequestError(500, f"internal error: {type(e).__name__}"))
            except OSError:
                pass

    def _post(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/admin/plan":
            self._admin_plan()
            return
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self._send_error(RequestError(404, f"no route POST {path}"))
            return
        if not self._authorized():
            return
        try:
            body = self._read_json()
            chat = path == "/v1/chat/completions"
            if not isinstance(body, dict):
                raise RequestError(400, "the body must be a JSON object")
            if isinstance(body.get("model"), str):
                self.server.coordinator.check_model(body["model"])  # 404 before field errors
            try:
                req: CompletionRequest | ChatRequest = (ChatRequest if chat else CompletionRequest).model_validate(body)
            except ValidationError as e:
                err = e.errors()[0]
                loc = ".".join(str(x) for x in err["loc"])
                field_ = str(err["loc"][0]) if err["loc"] else None
                raise RequestError(400, f"invalid field {field_!r} ({loc}): {err['msg']}", field_) from None
            tok = self._tokenizer(req.model)
            if isinstance(req, ChatRequest):
                prompt = tok.encode_chat(req.messages)
            elif isinstance(req.prompt, str):
                prompt = tok.encode(req.prompt)
            else:
                prompt = list(req.prompt)
            h = self.server.coordinator.submit(req.model, prompt, req.max_tokens, req.temperature, req.seed, req.ignore_eos)
        except RequestError as e:
            self._send_error(e)
            return
        if req.stream:
            self._stream(h, req, chat)
        else:
            self._complete(h, req, chat)

    def _complete(self, h: RequestHandle, req: Any, chat: bool) -> None:
        coord = self.server.coordinator
        ids: list[int] = []
        reason = ""
        try:
            for msg in coord.tokens(h, self.server.token_timeout_s):
                ids += msg.tokens
                reason = msg.finish_reason
        except RequestError as e:
            coord.close(h, "error")
            self._send_error(e)
            return
        coord.close(h, "ok")
        text = self._tokenizer(req.model).decode(ids)
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason, "token_ids": ids}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "token_ids": ids}
        self._send_json(200, {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{h.request_id}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": req.model, "choices": [choice],
            "usage": {"prompt_tokens": h.prompt_len, "completion_tokens": len(ids), "total_tokens": h.prompt_len + len(ids)},
        })  # fmt: skip

    def _stream(self, h: RequestHandle, req: Any, chat: bool) -> None:
        coord = self.server.coordinator
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{h.request_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": req.model,
        }  # fmt: skip
        dec = self._tokenizer(req.model).stream()

        def event(obj: dict[str, Any]) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        status = "ok"
        n = 0
        try:
            if chat:
                event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            for msg in coord.tokens(h, self.server.token_timeout_s):
                piece = dec.step(msg.tokens, msg.finished)
                n += len(msg.tokens)
                reason = msg.finish_reason or None
                if chat:
                    choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}, "finish_reason": reason, "token_ids": list(msg.tokens)}
                else:
                    choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": reason, "token_ids": list(msg.tokens)}
                event({**base, "choices": [choice]})
            if req.stream_options is not None and req.stream_options.include_usage:
                event({**base, "choices": [], "usage": {"prompt_tokens": h.prompt_len, "completion_tokens": n, "total_tokens": h.prompt_len + n}})
        except RequestError as e:
            status = "error"
            event(error_body(e.message, "server_error", e.param, e.code))
        except OSError:  # client went away; the request still runs to completion upstream
            status = "error"
        finally:
            coord.close(h, status)
        try:
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:
            pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    coordinator: Coordinator
    api_key: str | None
    admin_key: str | None
    admin: Any
    max_body_bytes: int
    token_timeout_s: float
    created: int
    tokenizers: dict[str, Any]


class ApiServer:
    """The HTTP server bound to a coordinator, run in a background thread."""

    def __init__(
        self,
        coordinator: Coordinator,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        token_timeout_s: float = 60.0,
        *,
        admin: Any = None,
        admin_key: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        tokenizers: dict[str, Any] | None = None,
    ) -> None:
        """Args:
        coordinator: the request router.
        host, port: where to listen (port 0 picks a free one; see :attr:`port`).
        api_key: if set, requests need ``Authorization: Bearer <api_key>`` (``/health`` is open).
        token_timeout_s: longest wait for the next token before the request fails with 504.
        admin: the plan controller behind ``/admin/*`` (a :class:`coral.runtime.lifecycle.Controller`).
        admin_key: bearer key of ``/admin/*`` (default ``api_key``).
        max_body_bytes: larger request bodies get 413.
        tokenizers: model name -> tokenizer (:mod:`coral.runtime.engine.tokenizer`); default bytes.
        """
        self.httpd = _Server((host, port), _Handler)
        self.httpd.coordinator = coordinator
        self.httpd.api_key = api_key
        self.httpd.admin_key = admin_key
        self.httpd.admin = admin
        self.httpd.max_body_bytes = max_body_bytes
        self.httpd.tokenizers = tokenizers or {}
        self.httpd.token_timeout_s = token_timeout_s
        self.httpd.created = int(time.time())
        self.host, self.port = str(self.httpd.server_address[0]), int(self.httpd.server_address[1])
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8000``."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Serve in a daemon thread."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.httpd.shutdown()
        self.httpd.server_close()
