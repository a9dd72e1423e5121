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

The parts: :mod:`~coral.runtime.serving.guard` (keys, body limits, draining),
:mod:`~coral.runtime.serving.completions` (the two generation endpoints),
:mod:`~coral.runtime.serving.admin` (``/admin/*``); this module adds the models, health and
metrics routes, the error handlers, and serves the whole on uvicorn.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from coral.errors import CoralError
from coral.runtime.serving.admin import AdminAction, PlanAdmin, add_admin_routes
from coral.runtime.serving.completions import LoopInbox, add_completion_routes
from coral.runtime.serving.coordinator import Coordinator, ModelInfo, RequestError
from coral.runtime.serving.guard import BodyError, Guard
from coral.runtime.serving.metrics import CONTENT_TYPE, FleetStats, ServingMetrics
from coral.runtime.serving.responses import error_response, json_response
from coral.runtime.serving.server_state import MAX_BODY_BYTES, ServerOptions, ServerState
from coral.runtime.serving.tokenizer import Tokenizer

__all__ = ["AdminAction", "ApiServer", "LoopInbox", "PlanAdmin", "ServerOptions", "build_app"]

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- the app


def _add_error_handlers(app: FastAPI, o: ServerOptions) -> None:
    """Every error in OpenAI's ``{"error": {...}}`` shape, a bad body's naming the field at fault."""

    @app.exception_handler(RequestError)
    async def _on_request_error(request: Request, e: RequestError) -> Response:
        return error_response(e.status, e.message, e.param, e.code, retry_after_s=o.retry_after_s if e.status == 503 else None)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, e: RequestValidationError) -> Response:
        err = e.errors()[0]
        loc = [x for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {err.get('msg')} ({err.get('ctx', {}).get('error', '')})")
        if not loc and err.get("type") == "model_type":
            return error_response(400, "the body must be a JSON object")
        param = str(loc[0]) if loc else None
        where = ".".join(str(x) for x in loc) or "body"
        return error_response(400, f"invalid field {param!r} ({where}): {err.get('msg')}" if param else f"invalid body: {err.get('msg')}", param)

    @app.exception_handler(ClientDisconnect)
    async def _on_client_left(request: Request, e: ClientDisconnect) -> Response:
        # a client that leaves mid-body is routine (a timeout on its side, a cancelled call): a debug line
        log.debug("client %s left before its %s %s body was read", request.client, request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, e: StarletteHTTPException) -> Response:
        if isinstance(e, BodyError):
            return error_response(e.status, e.message, close=True)
        msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return error_response(e.status_code, msg)


def _add_model_routes(app: FastAPI, st: ServerState) -> None:
    """``GET /v1/models`` and ``GET /v1/models/{id}`` (with ``max_model_len``)."""

    def _model_card(m: ModelInfo) -> dict[str, Any]:
        return {"id": m.name, "object": "model", "created": st.created, "owned_by": "coral", "root": m.name,
                "parent": None, "max_model_len": m.max_context, "permission": []}  # fmt: skip

    @app.get("/v1/models", summary="List the served models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [_model_card(st.coord.models[m]) for m in sorted(st.coord.models)]})

    @app.get("/v1/models/{model_id:path}", summary="One served model")
    async def model(model_id: str) -> Response:
        return json_response(_model_card(st.coord.check_model(model_id)))


def _add_health_routes(app: FastAPI, st: ServerState, guard: Guard, metrics: ServingMetrics) -> None:
    """``GET /health`` (readiness per model; 503 while draining) and ``GET /metrics`` (Prometheus)."""

    @app.get("/health", summary="Readiness: each model ok, degraded, unavailable or starting")
    async def health() -> Response:
        counts = st.coord.ready_counts()
        models = st.health()
        if guard.draining:
            return json_response({"status": "draining", "models": models, "instances": counts}, 503)
        serving = all(v in ("ok", "degraded") for v in models.values())
        worst = next((h for h in ("unavailable", "starting", "degraded") if h in models.values()), "ok")
        return json_response({"status": worst, "models": models, "instances": counts}, 200 if serving else 503)

    @app.get("/metrics", summary="Prometheus metrics (vLLM's names)")
    async def prometheus() -> Response:
        return Response(content=metrics.render(), media_type=CONTENT_TYPE)


def build_app(
    coordinator: Coordinator,
    options: ServerOptions | None = None,
    *,
    admin: PlanAdmin | None = None,
    tokenizers: dict[str, Tokenizer] | None = None,
) -> tuple[Guard, ServingMetrics]:
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
    holder: list[ServerState] = []
    longest = max((m.max_context for m in coordinator.models.values()), default=2)
    metrics = ServingMetrics(lambda: holder[0].fleet_stats() if holder else FleetStats(), max_model_len=longest)
    st = ServerState(coord=coordinator, options=o, metrics=metrics, tokenizers=dict(tokenizers or {}), admin=admin, created=int(time.time()))
    holder.append(st)
    app = FastAPI(title="Coral OpenAI-compatible API", version="1", openapi_url="/openapi.json", docs_url="/docs", redoc_url=None)
    guard = Guard(app, o, metrics, st)
    _add_error_handlers(app, o)
    add_completion_routes(app, st)
    _add_model_routes(app, st)
    _add_health_routes(app, st, guard, metrics)
    add_admin_routes(app, admin)
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
        return self.app.state.coord

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
