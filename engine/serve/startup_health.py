"""The server while the engine starts: ``GET /health`` answers 503 with the phase running
and the startup's ETA (from the ``startup.eta`` and ``startup.phase`` events the view folded),
and every route that needs the engine waits for it.

The port is bound before startup and uvicorn serves from the start, so a supervisor or a
load balancer polling ``/health`` learns how long to wait instead of hanging in the backlog.
``/metrics``, ``/events`` and ``/debug/state`` / ``/debug/requests`` read bus subscribers
only and answer at once (a dashboard shows phases A-G live); every other request
(completions, ``/v1/models``, ``/tokenize``...) is held by :class:`StartupGate` until phase
G ends, then runs as it always did (its arrival is stamped then: startup is no part of its
TTFT), or gets a 503 naming the failure if startup fails.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.events.folds.startup_state import snapshot_startup_eta
from engine.serve.host import EngineHost
from engine.serve.protocol import APIError

STARTING, READY, FAILED = "starting", "ready", "failed"
# Routes that read only the bus's subscribers: they answer during startup.
ANSWER_WHILE_STARTING = ("/health", "/metrics", "/events", "/debug/state", "/debug/requests")


def engine_state(engine: Any, timeout: float | None = 0) -> tuple[str, BaseException | None]:
    """``starting`` until startup ends, then ``ready`` or ``failed`` with what it raised;
    ``timeout`` None waits for the end."""
    try:
        engine.wait_ready(timeout)
    except TimeoutError:
        return STARTING, None
    except BaseException as exc:  # the startup's own failure, re-raised by wait_ready
        return FAILED, exc
    return READY, None


def startup_status(host: EngineHost) -> dict[str, Any]:
    """The phase running and the ETA, from the view: ``{"phase", "name", "status",
    "elapsed_s", "predicted_s", "eta_s"}`` (the last two None without a prediction)."""
    eta = snapshot_startup_eta(host.view.snapshot(), host.bus.now())
    return eta if eta is not None else {"phase": None, "name": None, "status": "pending", "elapsed_s": None,
                                        "predicted_s": None, "eta_s": None}


def starting_message(status: dict[str, Any]) -> str:
    """``the engine is starting: phase C load_weights, 12.0 s of ~30.0 s; ready in ~25 s``."""
    if status.get("phase") is None:
        return "the engine is starting"
    text = f"the engine is starting: phase {status['phase']} {status['name']}"
    elapsed, predicted, eta = status.get("elapsed_s"), status.get("predicted_s"), status.get("eta_s")
    if elapsed is not None:
        text += f", {elapsed:.1f} s"
    late = elapsed is not None and predicted is not None and elapsed > predicted
    if predicted is not None:
        text += f", past the ~{predicted:.1f} s predicted" if late else f" of ~{predicted:.1f} s"
    if eta is not None:  # past its prediction, a phase's own rest is unknown: only the phases after it count
        text += f"; the phases after it ~{eta:.0f} s" if late else f"; ready in ~{eta:.0f} s"
    return text


def starting_response(host: EngineHost) -> JSONResponse | None:
    """``/health`` during startup: 503, OpenAI's error shape with code ``starting``, the
    phase and ETA under ``startup``, and Retry-After; None once startup has ended."""
    state, _ = engine_state(host.engine)
    if state != STARTING:
        return None
    status = startup_status(host)
    body = APIError(503, starting_message(status), "service_unavailable", None, "starting").body()
    retry = max(1, math.ceil(status["eta_s"])) if status.get("eta_s") is not None else 1
    return JSONResponse(body | {"startup": status}, status_code=503, headers={"Retry-After": str(retry)})


class StartupGate:
    """ASGI middleware: while the engine starts, hold every HTTP request but those of
    :data:`ANSWER_WHILE_STARTING` until startup ends (one thread waits for it, every held
    request awaits that one future); a failed startup answers 503 naming the failure."""

    def __init__(self, app: ASGIApp, host: EngineHost) -> None:
        self.app = app
        self.host = host
        self._ended: asyncio.Future[Any] | None = None
        self._ready = False  # once ready, every request passes straight through

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._ready or scope["type"] != "http" or scope["path"].startswith(ANSWER_WHILE_STARTING):
            await self.app(scope, receive, send)
            return
        state, error = engine_state(self.host.engine)
        if state == STARTING:
            if self._ended is None:
                self._ended = asyncio.get_running_loop().run_in_executor(None, engine_state, self.host.engine, None)
            state, error = await asyncio.shield(self._ended)
        if state == FAILED:
            response = JSONResponse(APIError(503, f"the engine failed to start: {type(error).__name__}: {error}",
                                             "service_unavailable", None, "engine_dead").body(), status_code=503)
            await response(scope, receive, send)
            return
        self._ready = True
        await self.app(scope, receive, send)
