"""The front end's ASGI middleware: API keys, body limits and deadlines, draining, and the error counter."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from coral.runtime.serving.metrics import ServingMetrics
from coral.runtime.serving.responses import error_response
from coral.runtime.serving.server_state import ServerOptions, ServerState

__all__ = ["ASGIApp", "BodyError", "Guard"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Guard:
    """ASGI middleware: API keys, body limits and deadlines, draining, and the error counter.

    It runs before routing, so a refused request never reaches a handler, and it drains
    a refused request's body (bounded by ``max_body_bytes`` and the body deadline) so the
    kept-alive connection's next request starts where the client put it; a refused request
    that asked ``Expect: 100-continue`` is answered without reading its body (the client has
    not sent it: uvicorn sends ``100 Continue`` on the first read, so reading it would invite
    the body of a request already refused).
    """

    def __init__(self, app: ASGIApp, options: ServerOptions, metrics: ServingMetrics, state: ServerState) -> None:
        self.app, self.o, self.metrics = app, options, metrics
        self.state = state  # the handlers' state (to swap in a restarted coordinator)
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
            await refuse(error_response(400, "both Content-Length and Transfer-Encoding given", close=True))
            return
        length = headers.get(b"content-length")
        declared = int(length) if length is not None and length.isdigit() else None
        if declared is not None and declared > self.o.max_body_bytes:
            await refuse(error_response(413, f"body larger than {self.o.max_body_bytes} bytes", close=True))
            return
        key = self._key_for(scope["path"])
        if key:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {key}".encode()):
                drained = not expects_continue and await self._drain(receive, deadline)
                await refuse(error_response(401, "Incorrect or missing API key (Authorization: Bearer ...).", None, "invalid_api_key", close=not drained))
                return
        api = scope["path"].startswith("/v1")
        if self.draining and api:
            if not expects_continue:  # read what the client sent, so closing does not reset the answer away
                await self._drain(receive, deadline)
            await refuse(error_response(503, "the server is shutting down; retry on another replica or after it restarts", None,
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
                    raise BodyError(408, f"request body not received whole within {self.o.body_deadline_s:g} s") from None
                raise BodyError(408, f"request body not received within {self.o.body_timeout_s:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.o.max_body_bytes:
                    raise BodyError(413, f"body larger than {self.o.max_body_bytes} bytes")
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        if api:
            self.in_flight += 1
        try:
            await self.app(scope, guarded_receive, counted_send)
        except BodyError as e:
            await refuse(error_response(e.status, e.message, close=True))
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


class BodyError(StarletteHTTPException):
    """A body too slow or too large (an HTTPException, so FastAPI's body reader lets it through)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status, self.message = status, message
