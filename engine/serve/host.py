"""The engine side of the server, with no HTTP in it: the bus
subscribers attached before the engine starts (:class:`LockedView` for ``/debug/state``,
:class:`EventHub` for ``/events``, and
:class:`~engine.events.exporters.metrics.PrometheusMetrics` for ``/metrics``) and
:class:`EngineHost`, which holds them with the engine thread. The app stores one
:class:`EngineHost` on ``app.state.host``; routes reach it through
:func:`engine.serve.route_support.host_of`."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.events import Event, EventBus
from engine.events.exporters.metrics import PrometheusMetrics
from engine.events.recording import event_line
from engine.llm_engine import LLMEngine
from engine.profiling import TorchProfiler
from engine.serve.async_engine import AsyncEngine, EngineFront
from engine.serve.settings import LOOPBACK_HOSTS, ServerSettings
from engine.serve.shared_folds import LockedLifecycle, LockedView, subscribe_observers
from engine.serve.stall import StallDetector, one_core_detector

__all__ = ["LOOPBACK_HOSTS", "EngineHost", "EventHub", "ServerSettings", "SseClient"]

SSE_CLIENT_MAX_QUEUE = 20_000  # events buffered for one slow /events client before it is dropped
# While events flow, how often a client's loop takes them. Each take wakes the loop (on a 2-core Zen 4
# VM a wake-up costs ~100-300 µs of CPU, the epoll return most of it); the bus's batches come every
# 0.05 s. At 0.1 s the bench's /events client cost ~100 µs a SmolLM2 decode step, at 0.25 s ~55:
# five takes a second keep a dashboard (the monitor draws every 0.1 s) live for ~half the cost.
SSE_TAKE_S = 0.2


# ------------------------------------------------------------------ observers
# One /events item: (the data-parallel rank whose bus published it, its seq there, the
# serialised event); each rank's bus counts its own seq.
SseItem = tuple[int, int, str]


class SseClient:
    """One ``/events`` client: its queue of :data:`SseItem` batches, fed from the engine thread(s).

    Events are posted to a list the client's loop takes from: the first post after a quiet spell
    wakes the loop at once; while events keep coming the loop takes them every :data:`SSE_TAKE_S`
    (the hub is a deferred subscriber: posts come in the bus's batches, every 0.05 s at most, so a
    take holds a couple of them), and the stream writes what it took as one chunk
    (:meth:`next_batch`). A take that finds nothing lets the loop sleep until the next post."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[list[SseItem] | None] = asyncio.Queue()
        self.closed = False
        self._queued = 0  # items in the queue's batches, bounded by SSE_CLIENT_MAX_QUEUE
        self._posted: list[SseItem | None] = []  # posted, not yet on the loop, in order
        self._posted_lock = threading.Lock()
        self._taking = False  # a take is scheduled on the loop: posts need not wake it

    def post(self, item: SseItem | None) -> None:
        if self.closed:  # ended: its stream is leaving the hub
            return
        with self._posted_lock:
            self._posted.append(item)
            if self._taking:
                return
            self._taking = True
        try:
            self.loop.call_soon_threadsafe(self._take)
        except RuntimeError:  # loop closed at shutdown: nobody will take them
            with self._posted_lock:
                self._posted.clear()

    def _take(self) -> None:
        """On the loop: what was posted since the last take, queued as one batch; the end
        (``None`` posted, or a client more than SSE_CLIENT_MAX_QUEUE events behind) closes it."""
        with self._posted_lock:
            items, self._posted = self._posted, []
            if not items:
                self._taking = False  # quiet: the next post wakes the loop
                return
        if self.closed:
            return
        end = items.index(None) if None in items else None
        batch = [item for item in items[:end] if item is not None]
        if self._queued + len(batch) > SSE_CLIENT_MAX_QUEUE:
            end, batch = 0, []  # this far behind, it reconnects and gets a fresh snapshot
        if batch:
            self._queued += len(batch)
            self.queue.put_nowait(batch)
        if end is not None:
            self.closed = True
            self.queue.put_nowait(None)
            return
        self.loop.call_later(SSE_TAKE_S, self._take)

    async def next_batch(self) -> list[SseItem] | None:
        """The next batch of events, in order; None once the client is closed."""
        batch = await self.queue.get()
        if batch is not None:
            self._queued -= len(batch)
        return batch


class EventHub:
    """Bus subscriber: serialises each event once and queues it for every
    ``/events`` client on its event loop. Subscribed itself to rank 0's bus; under data
    parallelism :meth:`feed` subscribes it to another rank's."""

    def __init__(self) -> None:
        self._clients: tuple[SseClient, ...] = ()
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        self._post(0, event)

    def feed(self, rank: int, kinds: tuple[type[Event], ...]) -> Callable[[Event], None]:
        """A subscriber for rank ``rank``'s bus that passes on the events of ``kinds`` only."""

        def post(event: Event) -> None:
            if isinstance(event, kinds):
                self._post(rank, event)

        return RankFeed(f"EventHub(dp rank {rank})", post)

    def _post(self, rank: int, event: Event) -> None:
        clients = self._clients
        if not clients:
            return
        item = (rank, event.seq, event_line(event))
        for client in clients:
            client.post(item)

    def connect(self, loop: asyncio.AbstractEventLoop) -> SseClient:
        client = SseClient(loop)
        with self._lock:
            self._clients = (*self._clients, client)
        return client

    def disconnect(self, client: SseClient) -> None:
        with self._lock:
            self._clients = tuple(c for c in self._clients if c is not client)

    def close_all(self) -> None:
        for client in self._clients:
            client.post(None)


class RankFeed:
    """A subscriber with the name the bus reports it by (``sink_name``) when it fails."""

    def __init__(self, sink_name: str, post: Callable[[Event], None]) -> None:
        self.sink_name = sink_name
        self._post = post

    def __call__(self, event: Event) -> None:
        self._post(event)


class StateView(Protocol):
    """``host.view``: one engine core's view (:class:`LockedView`) or D ranks' read as one
    (engine/serve/data_parallel.py's ``DataParallelView``): what /debug/state and /events read."""

    def snapshot(self) -> dict[str, Any]: ...

    def snapshot_of_rank(self, rank: int) -> dict[str, Any]: ...


class RequestLives(Protocol):
    """``host.lifecycle``: every request's life, one core's (:class:`LockedLifecycle`) or
    every rank's (``DataParallelLifecycle``): what /debug/requests reads."""

    def life(self, request_id: str) -> dict[str, Any] | None: ...

    def metrics(self, request_id: str) -> dict[str, Any] | None: ...

    def rows(self, state: str | None, now: float) -> list[dict[str, Any]]: ...


class MetricsText(Protocol):
    """``host.metrics``: the Prometheus exposition, one core's families or every rank's merged."""

    def render(self) -> bytes: ...


class InFlight:
    """The completion and chat requests received and not yet answered in full (vLLM's
    server load); counted by :class:`~engine.serve.route_support.StampArrival`."""

    PATHS = ("/v1/completions", "/v1/chat/completions")

    def __init__(self) -> None:
        self.count = 0  # changed on the event loop only


@dataclass
class EngineHost:
    """The engine thread plus its subscribers and the server settings. One engine core or D
    (engine/serve/data_parallel.py) behind the same faces: the engine (``EngineFront``), the
    view, the metrics and the request lives (the protocols above)."""

    settings: ServerSettings
    bus: EventBus
    engine: EngineFront
    view: StateView
    metrics: MetricsText
    hub: EventHub
    lifecycle: RequestLives
    profiler: TorchProfiler = field(default_factory=lambda: TorchProfiler(os.getcwd()))  # /start_profile
    in_flight: InFlight = field(default_factory=lambda: InFlight())  # /load
    stall: StallDetector | None = None  # --stall-timeout: /health's engine_stalled (engine/serve/stall.py)

    @classmethod
    def create(cls, config: EngineConfig, settings: ServerSettings,
               registry: CollectorRegistry | None = None, bus: EventBus | None = None,
               lifecycle: LockedLifecycle | None = None) -> EngineHost:
        """Subscribe the observers, then start the engine thread (startup runs
        there; ``engine.wait_ready()`` waits for it). ``--data-parallel-size`` > 1: engine
        cores in processes of their own behind the same interface (engine/serve/data_parallel.py).
        ``lifecycle``: the request fold the exporters on ``bus`` already read (one fold for all)."""
        if (config.data_parallel_size or 1) > 1:
            from engine.serve.data_parallel import data_parallel_host

            return data_parallel_host(config, settings, registry, bus, lifecycle)
        bus = bus or EventBus()
        view = LockedView()
        metrics = PrometheusMetrics(registry or CollectorRegistry(), settings.served_model_name,
                                    max_model_len=config.max_model_len, kv_cache_metrics=settings.kv_cache_metrics,
                                    scheduling_policy=config.scheduling_policy, shared_view=view)
        hub = EventHub()
        lifecycle = lifecycle or LockedLifecycle()
        subscribe_observers(bus, (metrics, view, hub, lifecycle))
        engine = AsyncEngine(config, bus, max_waiting_requests=settings.max_waiting_requests,
                             metrics_registry=metrics.registry).start()
        return cls(settings=settings, bus=bus, engine=engine, view=view, metrics=metrics, hub=hub,
                   lifecycle=lifecycle, profiler=TorchProfiler(settings.profile_dir or os.getcwd()),
                   stall=one_core_detector(config, bus, engine, view.snapshot).start())

    @property
    def llm(self) -> LLMEngine:
        return self.engine.wait_ready()

    def begin_shutdown(self) -> None:
        """First half of a graceful stop: refuse new work, end /events streams."""
        self.engine.stop_accepting()
        self.hub.close_all()
