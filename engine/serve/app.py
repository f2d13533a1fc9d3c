"""The HTTP server: OpenAI's completions and chat completions, vLLM's
Prometheus metrics, the live event stream and the health check.

Everything observable is a bus subscriber attached before the engine starts:
:class:`~engine.events.metrics.PrometheusMetrics` (``GET /metrics``), a locked
:class:`~engine.events.view.EngineView` (``GET /debug/state`` and the first
``snapshot`` event of ``GET /events``) and an :class:`EventHub` that fans each
event out to the ``/events`` clients. Handlers never touch the engine: they
submit through :class:`~engine.serve.async_engine.AsyncEngine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from engine.budget.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.errors import UserError
from engine.events import Event, EventBus, SnapshotEvent, dumps
from engine.events.metrics import PrometheusMetrics
from engine.events.view import EngineView
from engine.llm_engine import LLMEngine, RequestOutput
from engine.serve.async_engine import AsyncEngine, EngineDead, Overloaded, RequestStream
from engine.serve.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
    new_id,
)

SSE_KEEPALIVE_S = 15.0
SSE_CLIENT_MAX_QUEUE = 20_000  # events buffered for one slow /events client before it is dropped
OVERLOAD_RETRY_AFTER_S = 1


@dataclass(slots=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    metrics_require_key: bool = False
    max_waiting_requests: int | None = None
    shutdown_timeout_s: float = 10.0
    # CORS: origins a browser page may call from (vLLM's --allowed-origins; empty: no CORS headers).
    allowed_origins: tuple[str, ...] = ()
    # Host headers answered (None: any). A loopback server without an API key answers only
    # loopback names, so a web page cannot reach it through DNS rebinding.
    trusted_hosts: tuple[str, ...] | None = None
    max_body_bytes: int | None = None  # None: derived from --max-model-len once the engine is up


# ------------------------------------------------------------------ observers
class LockedView:
    """An :class:`EngineView` folded on the engine thread and read by handlers."""

    def __init__(self) -> None:
        self.view = EngineView()
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        with self._lock:
            self.view.apply(event)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self.view.snapshot()


class _SseClient:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int, str] | None] = asyncio.Queue()
        self.closed = False

    def post(self, item: tuple[int, str] | None) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed at shutdown
            self.loop.call_soon_threadsafe(self._put, item)

    def _put(self, item: tuple[int, str] | None) -> None:
        if self.closed:
            return
        if item is None or self.queue.qsize() >= SSE_CLIENT_MAX_QUEUE:
            self.closed = True  # a client this far behind reconnects and gets a fresh snapshot
            self.queue.put_nowait(None)
            return
        self.queue.put_nowait(item)


class EventHub:
    """Bus subscriber: serialises each event once and queues it for every
    ``/events`` client on its event loop."""

    def __init__(self) -> None:
        self._clients: tuple[_SseClient, ...] = ()
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        clients = self._clients
        if not clients:
            return
        item = (event.seq, dumps(event.to_dict()))
        for client in clients:
            client.post(item)

    def connect(self, loop: asyncio.AbstractEventLoop) -> _SseClient:
        client = _SseClient(loop)
        with self._lock:
            self._clients = (*self._clients, client)
        return client

    def disconnect(self, client: _SseClient) -> None:
        with self._lock:
            self._clients = tuple(c for c in self._clients if c is not client)

    def close_all(self) -> None:
        for client in self._clients:
            client.post(None)


@dataclass
class EngineHost:
    """The engine thread plus its subscribers and the server settings."""

    settings: ServerSettings
    bus: EventBus
    engine: AsyncEngine
    view: LockedView
    metrics: PrometheusMetrics
    hub: EventHub

    @classmethod
    def create(cls, config: EngineConfig, settings: ServerSettings,
               registry: CollectorRegistry | None = None, bus: EventBus | None = None) -> EngineHost:
        """Subscribe the observers, then start the engine thread (startup runs
        there; ``engine.wait_ready()`` waits for it)."""
        bus = bus or EventBus()
        metrics = PrometheusMetrics(registry or CollectorRegistry(), settings.served_model_name,
                                    max_model_len=config.max_model_len)
        view = LockedView()
        hub = EventHub()
        for subscriber in (metrics, view, hub):
            bus.subscribe(subscriber)
        engine = AsyncEngine(config, bus, max_waiting_requests=settings.max_waiting_requests).start()
        return cls(settings=settings, bus=bus, engine=engine, view=view, metrics=metrics, hub=hub)

    @property
    def llm(self) -> LLMEngine:
        return self.engine.wait_ready()

    def begin_shutdown(self) -> None:
        """First half of a graceful stop: refuse new work, end /events streams."""
        self.engine.stop_accepting()
        self.hub.close_all()


# -------------------------------------------------------------------- helpers
def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, type_, param, code).body(), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg', '')}", None
    where = ".".join(loc) or "body"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid value')}{more}", where


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


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
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


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
# A request body holds the prompt (at most --max-model-len tokens of at most the longest
# token's bytes each, JSON-escaped) and a little else.
BODY_SLACK_BYTES = 1 << 20
JSON_ESCAPE_FACTOR = 6  # "\\u00e9" is 6 bytes for one


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: a body over ``limit()`` bytes gets 413 in OpenAI's error shape
    before it is parsed, from Content-Length at once or while a chunked body streams in,
    so a 10 MB upload costs neither the JSON parser nor the tokeniser any time."""

    def __init__(self, app: Any, limit: Callable[[], int | None]) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limit() if scope["type"] == "http" else None
        if limit is None:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(send, limit)
            return
        seen = 0
        started = False

        async def counting_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._refuse(send, limit)

    @staticmethod
    async def _refuse(send: Send, limit: int) -> None:
        body = json.dumps(APIError(413, f"the request body is over {limit:,} bytes (more than a prompt of "
                                        "--max-model-len tokens can be); send a shorter prompt",
                                   code="request_too_large").body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


# What any route may answer besides its own result, always in OpenAI's error shape.
ERROR_STATUSES = {
    "400": "Invalid request: a bad field, body or Host header",
    "401": "Missing or wrong API key (when the server has one)",
    "404": "Unknown model or path",
    "405": "Method not allowed (see the Allow header)",
    "413": "Request body too large",
    "429": "Too many waiting requests (--max-waiting-requests; see Retry-After)",
    "500": "Internal error",
    "503": "The engine is not running or is shutting down",
}


def _openapi_with_openai_errors(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """FastAPI documents its 422 validation error; this server answers 400 in OpenAI's
    shape instead (on_validation_error), and every route may also answer the
    ERROR_STATUSES in that shape, so the schema says that."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(error_schema.pop("$defs", {}))
            components["ErrorResponse"] = error_schema
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.setdefault("responses", {})
                    responses.pop("422", None)
                    for status, why in ERROR_STATUSES.items():
                        responses.setdefault(status, {"description": why,
                                                      "content": {"application/json": {"schema": error_ref}}})
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


# ----------------------------------------------------------------------- app
def build_app(host: EngineHost) -> FastAPI:
    settings = host.settings

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, host.engine.wait_ready)
        yield
        host.begin_shutdown()
        await loop.run_in_executor(None, partial(host.engine.shutdown, 0.0))

    app = FastAPI(title="kvscope", lifespan=lifespan)
    app.state.host = host
    app.openapi = _openapi_with_openai_errors(app)  # type: ignore[method-assign]

    def body_limit() -> int | None:
        if settings.max_body_bytes is not None:
            return settings.max_body_bytes
        if not host.engine.ready:
            return None
        llm = host.llm
        return BODY_SLACK_BYTES + JSON_ESCAPE_FACTOR * llm.max_model_len * llm.tokenizer.max_token_bytes

    # Outermost first: the body limit answers before anything reads the body.
    if settings.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    if settings.trusted_hosts is not None:
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(settings.trusted_hosts))
    app.add_middleware(BodyLimit, limit=body_limit)

    # ---------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), type_=kind, headers=exc.headers)  # 405 keeps its Allow

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not bad input: still an OpenAI-shaped body, and the connection stays open.
        return _error(500, f"internal error ({type(exc).__name__}); the server log has the traceback",
                      type_="internal_error")

    # ------------------------------------------------------------------ auth
    def require_key(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), settings.api_key):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def require_key_for_metrics(request: Request) -> None:
        if settings.metrics_require_key:
            require_key(request)

    keyed = [Depends(require_key)]

    # -------------------------------------------------------------- requests
    def check_model(name: str | None) -> None:
        if name is not None and name != settings.served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{settings.served_model_name!r}", param="model", code="model_not_found")

    async def prepare(prompt: str | list[int], params: SamplingParams, param: str = "prompt") -> list[int]:
        """Tokenise and check on a worker thread: a long prompt must not stall the event
        loop (and with it /health, /metrics and every stream)."""
        llm = host.llm

        def encode_and_check() -> list[int]:
            prompt_ids = llm.encode_prompt(prompt)
            llm.check_prompt(prompt_ids, params)
            return prompt_ids

        try:
            return await anyio.to_thread.run_sync(encode_and_check)
        except UserError as exc:
            message = str(exc)
            raise APIError(400, message, param="stop_token_ids" if message.startswith("stop_token_ids")
                           else param) from None

    async def submit(prompt_ids: list[int], params: SamplingParams, prefix: str) -> RequestStream:
        request_id = new_id(prefix)
        try:
            return await host.engine.add_request(prompt_ids, params, request_id)
        except Overloaded as exc:
            if host.engine.draining:
                raise APIError(503, str(exc), type_="service_unavailable") from None
            # 429, not 5xx: the server is healthy, the client should back off (Retry-After).
            raise APIError(429, str(exc), type_="rate_limit_exceeded", code="too_many_waiting_requests",
                           headers={"Retry-After": str(OVERLOAD_RETRY_AFTER_S)}) from None
        except UserError as exc:
            raise APIError(400, str(exc)) from None
        except EngineDead as exc:
            raise APIError(503, str(exc), type_="service_unavailable") from None

    def streaming(body: AsyncIterator[str]) -> DisconnectAwareStreamingResponse:
        return DisconnectAwareStreamingResponse(body, media_type="text/event-stream",
                                                headers={"Cache-Control": "no-cache"})

    async def final_output(stream: RequestStream) -> RequestOutput:
        last: RequestOutput | None = None
        async with contextlib.aclosing(stream.outputs()) as outputs:
            async for output in outputs:
                last = output
        assert last is not None and last.finished
        return last

    streamed = {200: {"description": "The completion (JSON), or with stream=true its chunks as server-sent events",
                      "content": {"text/event-stream": {"schema": {}}}}}

    @app.post("/v1/completions", dependencies=keyed, response_model=None, responses=streamed)  # type: ignore[arg-type]
    async def completions(request: Request, body: CompletionRequest) -> Response:
        body.check_supported()
        check_model(body.model)
        params = body.sampling_params(body.max_tokens)
        prompt_ids = await prepare(body.single_prompt(), params)
        stream = await submit(prompt_ids, params, "cmpl")
        model = settings.served_model_name
        if body.stream:
            return streaming(_completion_chunks(stream, model, body.include_usage,
                                                body.stream_options is not None
                                                and body.stream_options.continuous_usage_stats))

        async def collect() -> Response:
            out = await final_output(stream)
            response = CompletionResponse(
                id=stream.request_id, model=model,
                choices=[CompletionChoice(text=out.text, finish_reason=out.finish_reason)],
                usage=UsageInfo.of(len(prompt_ids), len(out.token_ids)),
            )
            return JSONResponse(response.model_dump())

        return await _unless_disconnected(request, collect())

    @app.post("/v1/chat/completions", dependencies=keyed, response_model=None, responses=streamed)  # type: ignore[arg-type]
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        body.check_supported()
        check_model(body.model)
        params = body.sampling_params(body.effective_max_tokens())
        try:
            prompt = await anyio.to_thread.run_sync(partial(
                host.llm.tokenizer.apply_chat_template, body.conversation(),
                add_generation_prompt=body.add_generation_prompt))
        except UserError as exc:
            raise APIError(400, str(exc), param="messages") from None
        prompt_ids = await prepare(str(prompt), params, param="messages")
        stream = await submit(prompt_ids, params, "chatcmpl")
        model = settings.served_model_name
        if body.stream:
            return streaming(_chat_chunks(stream, model, body.include_usage,
                                          body.stream_options is not None
                                          and body.stream_options.continuous_usage_stats))

        async def collect() -> Response:
            out = await final_output(stream)
            response = ChatCompletionResponse(
                id=stream.request_id, model=model,
                choices=[ChatChoice(message=AssistantMessage(content=out.text), finish_reason=out.finish_reason)],
                usage=UsageInfo.of(len(prompt_ids), len(out.token_ids)),
            )
            return JSONResponse(response.model_dump())

        return await _unless_disconnected(request, collect())

    @app.get("/v1/models", dependencies=keyed)
    async def models() -> dict[str, Any]:
        llm = host.llm
        card = ModelCard(id=settings.served_model_name, root=str(llm.config.model), max_model_len=llm.max_model_len)
        return ModelList(data=[card]).model_dump()

    # --------------------------------------------------------- observability
    @app.get("/health", response_class=Response,
             responses={200: {"description": "The engine is running (empty body)", "content": {}},
                        503: {"description": "The engine is not running",
                              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}})
    async def health() -> Response:
        if host.engine.alive:
            return Response(status_code=200)
        return _error(503, "the engine is not running", type_="service_unavailable")

    @app.get("/metrics", dependencies=[Depends(require_key_for_metrics)], response_class=Response,
             responses={200: {"description": "Prometheus text exposition",
                              "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(host.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/state", dependencies=keyed)
    async def debug_state() -> dict[str, Any]:
        state = host.view.snapshot()
        state["server"] = {"waiting_requests": host.engine.num_waiting(),
                           "max_waiting_requests": settings.max_waiting_requests}
        return state

    @app.get("/events", dependencies=keyed, response_model=None, response_class=Response,
             responses={200: {"description": "Every event as server-sent events, a snapshot first",
                              "content": {"text/event-stream": {"schema": {}}}}})
    async def events() -> Response:
        # Connect before the snapshot: an event folded after it reaches the queue.
        client = host.hub.connect(asyncio.get_running_loop())
        state = host.view.snapshot()
        last_seq = int(state.get("last_seq", 0))

        async def body() -> AsyncIterator[str]:
            try:
                yield _sse(dumps(SnapshotEvent(state=state, seq=last_seq, t=float(state.get("t", 0.0))).to_dict()))
                while True:
                    try:
                        item = await asyncio.wait_for(client.queue.get(), SSE_KEEPALIVE_S)
                    except TimeoutError:
                        yield ": keep-alive\n\n"
                        continue
                    if item is None:
                        return
                    seq, data = item
                    if seq > last_seq:
                        yield _sse(data)
            finally:
                host.hub.disconnect(client)

        return streaming(body())

    return app


# ------------------------------------------------------------ stream bodies
def _usage(stream: RequestStream, out: RequestOutput) -> UsageInfo:
    return UsageInfo.of(len(stream.prompt_ids), len(out.token_ids))


async def _stream_chunks(stream: RequestStream, include_usage: bool, continuous_usage: bool,
                         chunk: Callable[[RequestOutput | None, UsageInfo | None], str],
                         first: str | None = None) -> AsyncIterator[str]:
    """The shared SSE framing of both endpoints: optional first chunk, one chunk
    per output with text or a finish reason, the usage chunk, ``[DONE]``."""
    last: RequestOutput | None = None
    try:
        if first is not None:
            yield _sse(first)
        async with contextlib.aclosing(stream.outputs()) as outputs:
            async for out in outputs:
                last = out
                if out.delta_text or out.finished:
                    yield _sse(chunk(out, _usage(stream, out) if continuous_usage else None))
        if include_usage and last is not None:
            yield _sse(chunk(None, _usage(stream, last)))
    except (EngineDead, UserError) as exc:
        yield _sse(json.dumps(APIError(500, str(exc), type_="internal_error").body()))
    yield "data: [DONE]\n\n"


def _completion_chunks(stream: RequestStream, model: str, include_usage: bool,
                       continuous_usage: bool) -> AsyncIterator[str]:
    def chunk(out: RequestOutput | None, usage: UsageInfo | None) -> str:
        choices = [] if out is None else [CompletionChoice(text=out.delta_text, finish_reason=out.finish_reason)]
        return CompletionResponse(id=stream.request_id, model=model, choices=choices, usage=usage).model_dump_json()

    return _stream_chunks(stream, include_usage, continuous_usage, chunk)


def _chat_chunks(stream: RequestStream, model: str, include_usage: bool,
                 continuous_usage: bool) -> AsyncIterator[str]:
    def chunk(out: RequestOutput | None, usage: UsageInfo | None) -> str:
        choices = [] if out is None else [
            ChatChunkChoice(delta=DeltaMessage(content=out.delta_text), finish_reason=out.finish_reason)
        ]
        return ChatCompletionChunk(id=stream.request_id, model=model, choices=choices,
                                   usage=usage).model_dump_json()

    first = ChatCompletionChunk(id=stream.request_id, model=model,
                                choices=[ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))])
    return _stream_chunks(stream, include_usage, continuous_usage, chunk, first=first.model_dump_json())
