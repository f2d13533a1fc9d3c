"""The HTTP server: OpenAI's completions and chat completions, vLLM's
Prometheus metrics, the live event stream and the health check.

:func:`build_app` only assembles: it stores the :class:`~engine.serve.host.EngineHost`
on ``app.state.host``, includes the routers of :mod:`~engine.serve.routes_openai` and
:mod:`~engine.serve.routes_observability`, and adds the middleware (CORS, trusted
hosts, and :class:`~engine.serve.http_limits.BoundedBody`: the body's size and time
bounds), the OpenAI-shaped error handlers and the OpenAPI schema that
documents them. Everything observable is a bus subscriber attached before the engine
starts (see :mod:`~engine.serve.host`); handlers never touch the engine: they submit
through :class:`~engine.serve.async_engine.AsyncEngine`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.serve import kv_cache_info, routes_observability, routes_openai, routes_vllm
from engine.serve.host import LOOPBACK_HOSTS, EngineHost, EventHub, ServerSettings
from engine.serve.http_limits import BoundedBody
from engine.serve.protocol import APIError, ErrorResponse
from engine.serve.route_support import StampArrival, error_response
from engine.serve.shared_folds import LockedView
from engine.serve.startup_health import STARTING, StartupGate, engine_state

__all__ = ["LOOPBACK_HOSTS", "EngineHost", "EventHub", "LockedView", "ServerSettings", "build_app"]

# A request body holds the prompt (at most --max-model-len tokens of at most the longest
# token's bytes each, JSON-escaped) and a little else.
BODY_SLACK_BYTES = 1 << 20
JSON_ESCAPE_FACTOR = 6  # "\\u00e9" is 6 bytes for one


# ----------------------------------------------------------------------- app
def build_app(host: EngineHost) -> FastAPI:
    settings = host.settings
    app = FastAPI(title="kvscope", lifespan=_lifespan)
    app.state.host = host
    app.openapi = _openapi_with_openai_errors(app)  # type: ignore[method-assign]

    # Outermost first: the body limit answers before anything reads the body.
    if settings.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    if settings.trusted_hosts is not None:
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(settings.trusted_hosts))
    # Reads every body under the size and time bounds before any route runs (413/408).
    app.add_middleware(BoundedBody, limit=partial(_body_limit, host), idle_timeout_s=settings.body_idle_timeout_s,
                       timeout_s=settings.body_timeout_s)
    # Outermost: every request's clock starts before its body is read (TTFT from arrival).
    app.add_middleware(StampArrival, clock=host.bus.now, in_flight=host.in_flight)
    # Outside that: during startup, what needs the engine waits for it (/health says how long)
    app.add_middleware(StartupGate, host=host)

    for exc_class, handler in EXCEPTION_HANDLERS:
        app.add_exception_handler(exc_class, handler)

    app.include_router(routes_openai.router)
    app.include_router(routes_observability.router)
    app.include_router(routes_vllm.router)
    app.include_router(kv_cache_info.router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    host: EngineHost = app.state.host
    loop = asyncio.get_running_loop()
    yield  # serving from the start: the engine starts on its thread, StartupGate holds what needs it
    host.begin_shutdown()
    if engine_state(host.engine)[0] != STARTING:  # stopped mid-startup: its daemon thread ends with the process
        await loop.run_in_executor(None, partial(host.engine.shutdown, 0.0))


# ---------------------------------------------------------------- errors
async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(exc)
    return error_response(400, message, param=param)


async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, str(exc.detail), type_=kind, headers=exc.headers)  # 405 keeps its Allow


async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # A bug, not bad input: still an OpenAI-shaped body, and the connection stays open.
    return error_response(500, f"internal error ({type(exc).__name__}); the server log has the traceback",
                          type_="internal_error")


EXCEPTION_HANDLERS: tuple[tuple[type[Exception], Callable[..., Any]], ...] = (
    (APIError, on_api_error),
    (RequestValidationError, on_validation_error),
    (StarletteHTTPException, on_http_error),
    (Exception, on_unexpected),
)


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


# ------------------------------------------------------------ body limit
def _body_limit(host: EngineHost) -> int | None:
    if host.settings.max_body_bytes is not None:
        return host.settings.max_body_bytes
    if not host.engine.ready:
        return None
    llm = host.llm
    return BODY_SLACK_BYTES + JSON_ESCAPE_FACTOR * llm.max_model_len * llm.tokenizer.max_token_bytes


# --------------------------------------------------------------- OpenAPI
# What any route may answer besides its own result, always in OpenAI's error shape.
ERROR_STATUSES = {
    "400": "Invalid request: a bad field, body or Host header",
    "401": "Missing or wrong API key (when the server has one)",
    "404": "Unknown model or path",
    "405": "Method not allowed (see the Allow header)",
    "408": "The request's headers or body did not arrive in time (--timeout-headers, --timeout-body-idle, "
           "--timeout-body); the connection is closed",
    "413": "Request body too large (from Content-Length, or while a chunked body arrives)",
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
