"""Sources other than a kvscope event stream: live (pollers and KV-event subscribers
feeding one queue) or recorded (a seekable timeline of scrapes), both folded into
one :class:`~monitor.replica.ReplicaState` per replica.

:class:`ExternalFeed` owns the live readers and a thread-safe queue the app drains;
:class:`ReplicaTimeline` replays a recording made by ``monitor record`` (or any
recording with ``metrics.scrape`` events), with checkpoints every
``checkpoint_every`` scrapes so a seek re-folds at most that many.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine.errors import UserError
from engine.events import Event, KvEventBatch, LogEvent, MetricsScrape, iter_jsonl, read_events
from monitor.kv_events import KvEventSubscriber
from monitor.poller import MetricsPoller, base_url
from monitor.replica import ReplicaState

RECORDER = "monitor record"  # the recording header's config.source of `monitor record`


@dataclass(frozen=True, slots=True)
class KvEndpoint:
    """Where one replica publishes its KV events (``replay`` optional)."""

    source: str
    endpoint: str
    replay: str | None = None
    bind: bool = False  # the publisher connects to ``endpoint`` (vLLM's rule): the subscriber binds it
    topic: str = ""


def event_source(event: Event) -> str | None:
    """The replica an event belongs to."""
    if isinstance(event, MetricsScrape | KvEventBatch):
        return event.source
    if isinstance(event, LogEvent):
        return event.data.get("source")
    return None


def fold_into(states: dict[str, ReplicaState], events: Sequence[Event]) -> bool:
    """Fold ``events`` into their replicas' states; True when any changed."""
    changed = False
    for event in events:
        state = states.get(event_source(event) or "")
        if state is not None:
            state.apply(event)
            changed = True
    return changed


class ExternalFeed:
    """Polls every replica's /metrics (one asyncio task each) and reads KV events
    (one thread each) into one queue. :meth:`start` runs inside the app's event loop."""

    def __init__(self, urls: Sequence[str], *, kv: Sequence[KvEndpoint] = (), interval_s: float = 1.0,
                 timeout_s: float = 2.0, max_retry_s: float = 10.0,
                 deliver: Callable[[Event], None] | None = None) -> None:
        """``deliver`` (optional) takes each event as it arrives instead of the queue
        (``monitor record`` writes them)."""
        self.urls = [base_url(u) for u in urls]
        self._queue: deque[Event] = deque()
        self._lock = threading.Lock()
        target = deliver or self.push
        self.pollers = [MetricsPoller(u, target, interval_s=interval_s, timeout_s=timeout_s, max_retry_s=max_retry_s)
                        for u in self.urls]
        self.subscribers = [KvEventSubscriber(k.endpoint, target, replay=k.replay, source=base_url(k.source),
                                              bind=k.bind, topic=k.topic) for k in kv]
        self.kv_sources = {base_url(k.source): k.endpoint for k in kv}
        self._tasks: list[asyncio.Task[None]] = []
        self._client: httpx.AsyncClient | None = None

    def push(self, event: Event) -> None:
        with self._lock:
            self._queue.append(event)

    def drain(self) -> list[Event]:
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out

    def start(self) -> None:
        self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=max(10, 2 * len(self.pollers))))
        self._tasks = [asyncio.get_running_loop().create_task(p.run(self._client)) for p in self.pollers]
        for subscriber in self.subscribers:
            subscriber.start()

    async def stop(self) -> None:
        for poller in self.pollers:
            poller.stop()
        for subscriber in self.subscribers:
            subscriber.stop()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()


class ReplicaTimeline:
    """A recording of external sources, indexed by scrape (position ``k``: every event
    up to and including the ``k``-th ``metrics.scrape``)."""

    def __init__(self, events: Sequence[Event], checkpoint_every: int = 50) -> None:
        self.events = list(events)
        self.sources = list(dict.fromkeys(e.source for e in self.events if isinstance(e, MetricsScrape)))
        if not self.sources:
            raise ValueError("the recording holds no metrics.scrape events (record one with `monitor record URL`)")
        self.positions = [i for i, e in enumerate(self.events) if isinstance(e, MetricsScrape)]
        self.times = [self.events[i].t for i in self.positions]
        self.checkpoint_every = max(1, checkpoint_every)
        self._checkpoints: dict[int, dict[str, ReplicaState]] = {}
        states = self._fresh()
        done = 0
        for k in range(0, len(self.positions), self.checkpoint_every):
            end = self.positions[k] + 1
            fold_into(states, self.events[done:end])
            done = end
            self._checkpoints[k] = {s: state.copy() for s, state in states.items()}
        self.position = 0
        self.states = self.seek(0)

    def _fresh(self) -> dict[str, ReplicaState]:
        return {s: ReplicaState(source=s) for s in self.sources}

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def t(self) -> float:
        return self.events[self.positions[self.position]].t

    def position_at(self, t: float) -> int:
        """The last scrape at or before time ``t``."""
        return max(0, bisect.bisect_right(self.times, t) - 1)

    def seek(self, k: int) -> dict[str, ReplicaState]:
        k = max(0, min(k, len(self.positions) - 1))
        base = k // self.checkpoint_every * self.checkpoint_every
        states = {s: state.copy() for s, state in self._checkpoints[base].items()}
        fold_into(states, self.events[self.positions[base] + 1 : self.positions[k] + 1])
        self.position, self.states = k, states
        return states


def load_external_timeline(path: str | Path, checkpoint_every: int = 50) -> ReplicaTimeline | None:
    """A recording ``monitor record`` made (its header says so) as a timeline; None
    for any other recording (a kvscope run: :func:`monitor.sources.load_timeline`)."""
    path = Path(path)
    if not path.is_file():
        return None  # load_timeline words the error
    try:  # the first line only, through the bounded reader (engine/events/bounded.py)
        first = next(iter_jsonl(path), None)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    config = first.get("config") if first else None
    if not isinstance(config, dict) or config.get("source") != RECORDER:
        return None  # a damaged header is load_timeline's to word
    try:
        recording = read_events(path)
    except ValueError as exc:  # read_events names the file, the line and the field
        raise UserError(str(exc)) from None
    try:
        return ReplicaTimeline(recording.events, checkpoint_every=checkpoint_every)
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from exc
