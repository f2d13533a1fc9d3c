"""The routes that show the engine rather than use it: ``GET /health``, vLLM's
Prometheus ``GET /metrics``, ``GET /debug/state`` (the
:class:`~engine.events.folds.view.EngineView` snapshot plus the server's queue),
``GET /debug/requests`` (every request kvscope knows: id, state, age, tokens and why;
``?state=waiting`` for one state) and ``GET /debug/requests/{id}`` (one request's whole
life, engine/events/folds/request_record.py), and ``GET /events`` (that snapshot, then every
event, as server-sent events). Each reads a bus subscriber of
:class:`~engine.serve.host.EngineHost`, never the engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.errors import UserError
from engine.events import SnapshotEvent, dumps
from engine.events.folds.request_record import FINISHED_KEPT, STATES
from engine.serve.host import EngineHost, SseClient
from engine.serve.route_support import (
    KEYED,
    error_response,
    host_of,
    require_key_for_metrics,
    sse,
    streaming,
)
from engine.serve.startup_health import starting_response

SSE_KEEPALIVE_S = 15.0

router = APIRouter()


@router.get("/health", response_class=Response,
            responses={200: {"description": "The engine is running: an empty body, or, when an event sink "
                                            "(the recording, an exporter) was stopped by a failure, "
                                            '{"status": "degraded", "failed_sinks": {sink: error}}',
                             "content": {}},
                       503: {"description": "The engine is not running (starting, stopping, or stopped by a "
                                            "failure the message names), or an engine core is stalled: "
                                            '{"error": "engine_stalled", "rank", "phase", "stalled_s", '
                                            '"limit_s", "last_step", "requests", "dump", "message"}',
                             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}})
async def health(request: Request) -> Response:
    host = host_of(request)
    engine = host.engine
    stalled = host.stall.health() if engine.alive and host.stall is not None else None
    if stalled is not None:  # alive but making no progress (engine/serve/stall.py): the rank and what it was doing
        return JSONResponse(stalled, status_code=503)
    if engine.alive:
        failed = host.bus.failed_sinks
        if failed:  # serving goes on (200), but a recording or an exporter stopped: say which and why
            return JSONResponse({"status": "degraded", "failed_sinks": dict(failed)})
        return Response(status_code=200)
    if engine.error is not None:  # the thread died after startup; the server is on its way out (exit 1)
        return error_response(503, f"the engine stopped: {type(engine.error).__name__}: {engine.error}",
                              type_="service_unavailable", code="engine_dead")
    starting = starting_response(host)  # during startup: the phase running and the ETA
    if starting is not None:
        return starting
    return error_response(503, "the engine is not running", type_="service_unavailable")


@router.get("/metrics", dependencies=[Depends(require_key_for_metrics)], response_class=Response,
            responses={200: {"description": "Prometheus text exposition",
                             "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    return Response(host_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/debug/state", dependencies=KEYED)
async def debug_state(request: Request, dp_rank: int | None = None) -> Response:
    """The engine's state (rank 0's under ``--data-parallel-size``, with every rank's queue
    under ``data_parallel``); ``?dp_rank=R``: rank R's."""
    host = host_of(request)
    try:
        state = host.view.snapshot() if dp_rank is None else host.view.snapshot_of_rank(dp_rank)
    except UserError as exc:
        return error_response(400, str(exc), param="dp_rank")
    state["server"] = {"waiting_requests": host.engine.num_waiting(),
                       "max_waiting_requests": host.settings.max_waiting_requests}
    return JSONResponse(state)


@router.get("/debug/requests", dependencies=KEYED)
async def debug_requests(request: Request, state: str | None = None) -> Response:
    """Requests in the engine and recently finished, oldest first: id, state, age, tokens,
    blocks and kvscope's why (the latest step's reason for a waiting request)."""
    if state is not None and state not in STATES:
        return error_response(400, f"state {state!r}: use one of {', '.join(STATES)}", param="state")
    host = host_of(request)
    now = host.bus.now()
    return JSONResponse({"t": now, "requests": host.lifecycle.rows(state, now)})


@router.get("/debug/requests/{request_id}", dependencies=KEYED)
async def debug_request(request: Request, request_id: str) -> Response:
    """One request's life, step by step, as data and as the timeline's lines."""
    life = host_of(request).lifecycle.life(request_id)
    if life is None:
        return error_response(404, f"no request {request_id!r} (the last {FINISHED_KEPT:,} finished ones are "
                                   "kept)", type_="not_found", param="request_id")
    return JSONResponse(life)


@router.get("/events", dependencies=KEYED, response_model=None, response_class=Response,
            responses={200: {"description": "Every event as server-sent events, a snapshot first",
                             "content": {"text/event-stream": {"schema": {}}}}})
async def events(request: Request) -> Response:
    host = host_of(request)
    # Connect before the snapshot: an event folded after it reaches the queue.
    client = host.hub.connect(asyncio.get_running_loop())
    state = host.view.snapshot()
    return streaming(_event_stream(host, client, state))


async def _event_stream(host: EngineHost, client: SseClient, state: dict[str, Any]) -> AsyncIterator[str]:
    """The snapshot as the first event, then every event queued after it, with a
    keep-alive comment every SSE_KEEPALIVE_S quiet seconds, until the hub closes. Under
    data parallelism every rank's step and request events follow too (each with its
    ``dp_rank``; each rank's bus counts its own ``seq``): the snapshot is rank 0's state,
    so only rank 0's events it already holds are left out."""
    last_seq = int(state.get("last_seq", 0))
    try:
        yield sse(dumps(SnapshotEvent(state=state, seq=last_seq, t=float(state.get("t", 0.0))).to_dict()))
        while True:
            try:
                async with asyncio.timeout(SSE_KEEPALIVE_S):  # no task a wait, as wait_for makes
                    batch = await client.next_batch()
            except TimeoutError:
                yield ": keep-alive\n\n"
                continue
            if batch is None:
                return
            # one chunk a batch: one write, not one per event
            frames = "".join([sse(data) for rank, seq, data in batch if rank != 0 or seq > last_seq])
            if frames:
                yield frames
    finally:
        host.hub.disconnect(client)

