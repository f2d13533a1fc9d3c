"""What every route module shares: the :class:`~engine.serve.host.EngineHost` behind a
request (:func:`host_of`), the API-key dependencies, OpenAI-shaped error responses,
and server-sent-event streaming that notices a client leaving (and then aborts its
request)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import structlog
from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.serve.host import EngineHost, InFlight
from engine.serve.protocol import APIError


def host_of(request: Request) -> EngineHost:
    """The host :func:`engine.serve.app.build_app` stored on the app."""
    return request.app.state.host


# --------------------------------------------------------------- arrival
ARRIVAL_KEY = "kvscope_arrival_t"


class StampArrival:
    """Outermost middleware: stamps each HTTP request with the bus clock when its
    headers arrived, before its body is read and parsed (vLLM's ``arrival_time``),
    so a request's TTFT and e2e count the parsing and tokenising too; and counts the
    completion and chat requests in flight until their answer ends (``GET /load``)."""

    def __init__(self, app: ASGIApp, clock: Callable[[], float], in_flight: InFlight) -> None:
        self.app = app
        self.clock = clock
        self.in_flight = in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})[ARRIVAL_KEY] = self.clock()
        # log records of this request carry its ids (request_id is bound once it is made);
        # trace_id: the W3C traceparent's, as vLLM's OpenTelemetry path reads it
        structlog.contextvars.clear_contextvars()
        trace_id = _trace_id(scope)
        if trace_id is not None:
            structlog.contextvars.bind_contextvars(trace_id=trace_id)
        if scope["path"] not in InFlight.PATHS:
            await self.app(scope, receive, send)
            return
        self.in_flight.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight.count -= 1


def _trace_id(scope: Scope) -> str | None:
    """The trace id of a ``traceparent: 00-<32 hex>-<16 hex>-<2 hex>`` header, if well formed."""
    for name, value in scope.get("headers", ()):
        if name == b"traceparent":
            parts = value.decode("latin-1").strip().split("-")
            if len(parts) == 4 and len(parts[1]) == 32 and all(c in "0123456789abcdef" for c in parts[1]):
                return parts[1]
    return None


def arrival_of(request: Request) -> float:
    """When the server received ``request`` (the bus clock); now if it was not stamped."""
    stamped = request.scope.get("state", {}).get(ARRIVAL_KEY)
    return float(stamped) if stamped is not None else host_of(request).bus.now()


# ------------------------------------------------------------------ auth
def require_key(request: Request) -> None:
    api_key = host_of(request).settings.api_key
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
        raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


def require_key_for_metrics(request: Request) -> None:
    if host_of(request).settings.metrics_require_key:
        require_key(request)


KEYED = [Depends(require_key)]


# ---------------------------------------------------------------- errors
def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, type_, param, code).body(), status_code=status, headers=headers)


# ------------------------------------------------------------- streaming
class DisconnectAwareStreamingResponse(StreamingResponse):
    """Streams while watching for the client leaving, whatever the ASGI spec
    version, and closes the body iterator (which aborts the request) either way."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def streaming(body: AsyncIterator[str]) -> DisconnectAwareStreamingResponse:
    return DisconnectAwareStreamingResponse(body, media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache"})


def sse(data: str) -> str:
    return f"data: {data}\n\n"


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``; if the client leaves first, cancel it (its stream aborts the request)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
