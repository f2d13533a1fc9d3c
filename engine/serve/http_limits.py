"""What one connection and one request may cost the server in time and bytes.

uvicorn bounds only the idle time after a response (``timeout_keep_alive``); a
client that opens a connection and sends nothing, sends its headers a line at a
time, or trickles a body holds the connection (and, with a body, a task) for as
long as it likes. Two pieces close those gaps:

- :class:`DeadlineH11Protocol`, uvicorn's h11 protocol plus two timers: a fresh
  connection that sends nothing is closed after the keep-alive bound, as an idle
  one between requests already is; and a request's line and headers must be
  complete within ``header_timeout_s`` of its first byte, or the server answers
  408 and closes. Headers are parsed before the ASGI app is called, so this has to
  live in the protocol. The server pins this class (``uvicorn.Config(http=...)``)
  instead of letting uvicorn pick httptools when it is installed, so the bounds
  hold whatever is installed.
- :class:`BoundedBody`, ASGI middleware that reads the whole body before the app
  runs: over the size limit (from Content-Length at once, or while a chunked body
  streams in, reading no more than the limit) it answers 413; when no byte comes
  for ``idle_timeout_s`` or the body is not complete within ``timeout_s`` it
  answers 408. Both in OpenAI's error shape with ``Connection: close``. Answering
  here, not by raising inside ``receive()``, matters: FastAPI's body reader
  catches what ``receive()`` raises and answers 400 "error parsing the body".

A refusal leaves the rest of the body unread. Closing a socket with unread bytes
makes the kernel send a reset, and a client still uploading then loses the answer
(curl got the 413 status line and "connection reset" instead of its body), so the
protocol closes such a connection the way web servers do: its write side at once,
after the answer, then it reads and discards what the client still sends until the
client closes, sends nothing for ``LINGER_IDLE_S`` or ``LINGER_MAX_S`` pass (nginx's
lingering close, with shorter bounds).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

import h11
from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.serve.protocol import APIError

log = logging.getLogger("uvicorn.error")

# How long a refused upload is drained after the answer (above).
LINGER_IDLE_S = 2.0
LINGER_MAX_S = 10.0


def _error_body(status: int, message: str, code: str) -> bytes:
    return json.dumps(APIError(status, message, code=code).body()).encode()


# --------------------------------------------------------------- headers
class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's line and headers
    (counted from the request's first byte) and the keep-alive bound applied to a
    fresh connection too. Subclass it with ``header_timeout_s`` set
    (:func:`protocol_with_header_timeout`)."""

    header_timeout_s: ClassVar[float] = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._linger_until = 0.0
        self._linger_last = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn arms its keep-alive timer only after a response; a connection that
        # never sends a byte would otherwise stay open for good. data_received cancels it.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        if self._linger is not None:
            self._linger_last = self.loop.time()
            return  # the rest of a refused body: discarded
        if self._header_deadline is None and self.conn.their_state is h11.IDLE:
            self._arm_header_deadline()
        super().data_received(data)
        self._headers_done_if_past_them()

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and not isinstance(cycle.transport, _CloseLingering):
            cycle.transport = _CloseLingering(self.transport, self._close_after_response)  # type: ignore[assignment]

    def _close_after_response(self) -> None:
        """How the request cycle closes the connection after its response."""
        transport = self.transport
        if self.conn.their_state is not h11.SEND_BODY or transport.is_closing() or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()  # the answer, then FIN; the client's bytes still in flight are read below
        self._linger_last = self.loop.time()
        self._linger_until = self._linger_last + LINGER_MAX_S
        self._linger = self.loop.call_later(LINGER_IDLE_S, self._end_linger_when_due)
        self.flow.resume_reading()

    def _end_linger_when_due(self) -> None:
        now = self.loop.time()
        due = min(self._linger_until, self._linger_last + LINGER_IDLE_S)
        if now >= due:
            self.transport.close()
        else:
            self._linger = self.loop.call_later(due - now, self._end_linger_when_due)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request already buffered (part of it) gets the same deadline.
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0] and not self.transport.is_closing():
            self._arm_header_deadline()
        self._headers_done_if_past_them()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _headers_done_if_past_them(self) -> None:
        # Any state but IDLE means h11 has the whole request line and headers (or gave up on them).
        if self.conn.their_state is not h11.IDLE:
            self._cancel_header_deadline()

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_timeout(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing():
            return
        log.debug("%s: request headers not complete within %.1f s; closing", self.client, self.header_timeout_s)
        # h11 will not send a response before it has a request, so the 408 is written as is.
        body = _error_body(408, f"the request line and headers did not arrive within {self.header_timeout_s:g} s "
                                "(--timeout-headers)", "request_timeout")
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        self.transport.close()


class _CloseLingering:
    """The transport as a request cycle sees it: the same, except that ``close()``
    is the protocol's lingering close."""

    def __init__(self, transport: asyncio.Transport, close: Callable[[], None]) -> None:
        self._transport = transport
        self.close = close

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def protocol_with_header_timeout(header_timeout_s: float) -> type[DeadlineH11Protocol]:
    """The protocol class uvicorn builds per connection, with this header deadline."""
    return type("KvscopeH11Protocol", (DeadlineH11Protocol,), {"header_timeout_s": header_timeout_s})


# ------------------------------------------------------------------ body
class BoundedBody:
    """ASGI middleware: read the whole request body under a size limit (``limit()``
    bytes; None: no limit), an idle bound (``idle_timeout_s`` with no byte) and an
    overall deadline (``timeout_s`` from the end of the headers), then call the app
    with that body. 413 or 408 in OpenAI's error shape otherwise, before the app
    (and the JSON parser, and the tokeniser) has seen any of it."""

    def __init__(self, app: Any, limit: Callable[[], int | None], idle_timeout_s: float, timeout_s: float) -> None:
        self.app = app
        self.limit = limit
        self.idle_timeout_s = idle_timeout_s
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if limit is not None and declared is not None and declared.isdigit() and int(declared) > limit:
            await _refuse(send, 413, _too_large(limit), "request_too_large")
            return
        chunks: list[bytes] = []
        seen = 0
        deadline = time.monotonic() + self.timeout_s
        more = True
        while more:
            wait = min(self.idle_timeout_s, deadline - time.monotonic())
            try:
                if wait <= 0:
                    raise TimeoutError
                message = await asyncio.wait_for(receive(), wait)
            except TimeoutError:
                await _refuse(send, 408, self._timeout_message(seen, deadline), "request_timeout")
                return
            if message["type"] == "http.disconnect":
                return  # the client left: nobody to answer
            body = message.get("body", b"")
            seen += len(body)
            if limit is not None and seen > limit:
                await _refuse(send, 413, _too_large(limit), "request_too_large")
                return
            chunks.append(body)
            more = bool(message.get("more_body", False))
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _timeout_message(self, seen: int, deadline: float) -> str:
        if time.monotonic() >= deadline:
            return (f"the request body was not complete within {self.timeout_s:g} s ({seen:,} bytes arrived; "
                    "--timeout-body)")
        return f"no byte of the request body arrived for {self.idle_timeout_s:g} s ({seen:,} bytes so far; " \
               "--timeout-body-idle)"


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the server's own receive (so a streaming
    response still hears the client disconnect)."""
    delivered = False

    async def replayed() -> Message:
        nonlocal delivered
        if delivered:
            return await receive()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def _too_large(limit: int) -> str:
    return (f"the request body is over {limit:,} bytes (more than a prompt of --max-model-len tokens can be); "
            "send a shorter prompt")


async def _refuse(send: Send, status: int, message: str, code: str) -> None:
    # Connection: close, because the rest of the body is never read: without it h11
    # would keep the connection and go on reading (and discarding) whatever comes.
    body = _error_body(status, message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
