"""The event bus: synchronous fan-out of events to subscribers, each event stamped with
``seq`` and ``t`` on the bus clock (wall monotonic for the real engine, simulated seconds for
``engine simulate``); a subscriber that raises is stopped and said so once."""

from __future__ import annotations

import collections
import threading
import time
import types
from collections.abc import Callable

from engine.events.deferred_delivery import DEFER_S, DeferredDelivery
from engine.events.engine_records import SinkFailed
from engine.events.record import Event
from engine.logs import log_failure

Subscriber = Callable[[Event], None]


def _without(subscribers: tuple[Subscriber, ...], fn: Subscriber) -> tuple[Subscriber, ...]:
    return tuple(s for s in subscribers if not _same_subscriber(s, fn))


def _same_subscriber(subscribed: Subscriber, fn: Subscriber) -> bool:
    """A subscriber by identity, except a bound method (``feed.push``, ``events.append``): each
    attribute access makes a new one, equal to the others of the same object and function."""
    if isinstance(fn, types.MethodType | types.BuiltinMethodType):
        return subscribed == fn
    return subscribed is fn

class EventBus:
    """Synchronous fan-out of events to subscribers.

    ``publish`` stamps ``seq`` and ``t`` and calls every subscriber in order.
    Thread-safe subscribe/unsubscribe; publishing happens on the engine thread.
    An event published by a subscriber while an event is being delivered (the
    stats reporter's ``stats`` event) is queued and delivered right after it, so
    every subscriber sees events in ``seq`` order.

    A subscriber that raises never stops the publisher: it is unsubscribed, the
    failure is logged once with its traceback, kept in ``failed_sinks`` and
    published as a :class:`SinkFailed` event to the subscribers left (the metrics
    count it, the view and ``/health`` show it), and delivery goes on.

    A subscriber subscribed with ``deferred=True`` (the server's and the engine's observers)
    gets the same events in the same order in batches, ``DEFER_S`` late while it publishes
    (engine/events/deferred_delivery.py); a reader of what it folds calls :meth:`flush` first.
    """

    def __init__(self, clock: Callable[[], float] | None = None, defer_s: float = DEFER_S) -> None:
        self._start = time.monotonic()
        self._clock = clock or (lambda: time.monotonic() - self._start)
        self._subscribers: tuple[Subscriber, ...] = ()
        self._lock = threading.Lock()
        self._seq = 0
        self._delivering = False
        self._queued: collections.deque[Event] = collections.deque()
        self._guard: threading.RLock | None = None  # see guard()
        self._deferred_subscribers: tuple[Subscriber, ...] = ()
        self._deferred = DeferredDelivery(self._deliver_batch, defer_s)
        self.failed_sinks: dict[str, str] = {}  # sink name -> the error that stopped it

    @property
    def has_subscribers(self) -> bool:
        return bool(self._subscribers or self._deferred_subscribers)

    def now(self) -> float:
        return self._clock()

    def set_clock(self, clock: Callable[[], float]) -> None:
        self._clock = clock

    def subscribe(self, fn: Subscriber, *, deferred: bool = False) -> Subscriber:
        """``fn`` gets every event from now on: as it is published, or with ``deferred``
        in batches (``DEFER_S`` late while the engine publishes; publishing becomes thread-safe then: the
        deferred batch may fail a sink on another thread, which publishes ``sink.failed``)."""
        if deferred:
            self.guard()
            with self._lock:
                self._deferred_subscribers = (*self._deferred_subscribers, fn)
            self._deferred.start()
            return fn
        with self._lock:
            self._subscribers = (*self._subscribers, fn)
        return fn

    def unsubscribe(self, fn: Subscriber) -> None:
        """``fn`` gets nothing more; a deferred subscriber first gets what waits for it."""
        if any(_same_subscriber(s, fn) for s in self._deferred_subscribers):
            self._deferred.flush()
            with self._lock:
                self._deferred_subscribers = _without(self._deferred_subscribers, fn)
                last = not self._deferred_subscribers
            if last:
                self._deferred.stop()
        with self._lock:
            self._subscribers = _without(self._subscribers, fn)

    def flush(self) -> None:
        """Deliver every event the deferred subscribers have not seen yet (a reader of their
        folds calls this first); a no-op without deferred subscribers."""
        if self._deferred_subscribers:
            self._deferred.flush()

    def guard(self) -> None:
        """From now on every publish holds a lock, so another thread may publish too: the
        stall detector's ``engine.stalled`` while the engine thread is stuck mid-step (the
        lock is free then; held, it is held for one event's delivery)."""
        if self._guard is None:
            self._guard = threading.RLock()

    def publish(self, event: Event) -> Event:
        guard = self._guard
        if guard is None:
            return self._publish(event)
        with guard:
            return self._publish(event)

    def _publish(self, event: Event) -> Event:
        self._seq += 1
        event.seq = self._seq
        event.t = self._clock()
        if self._delivering:
            self._queued.append(event)
            return event
        self._delivering = True
        try:
            self._deliver(event)
            queued = self._queued
            while queued:
                self._deliver(queued.popleft())
        finally:
            self._delivering = False
        return event

    def _deliver(self, event: Event) -> None:
        for fn in self._subscribers:
            try:
                fn(event)
            except Exception as exc:
                self._stop_failed(fn, event, exc)
        if self._deferred_subscribers:
            self._deferred.add(event)

    def _deliver_batch(self, events: list[Event]) -> None:
        """A deferred batch, event by event: each deferred subscriber in order, as ``_deliver``."""
        for event in events:
            for fn in self._deferred_subscribers:
                try:
                    fn(event)
                except Exception as exc:
                    self._stop_failed(fn, event, exc)

    def _stop_failed(self, fn: Subscriber, event: Event, exc: Exception) -> None:
        """Unsubscribe a subscriber that raised; say so once (a log line with the traceback,
        a ``sink.failed`` event for the subscribers left: queued right behind the event it
        failed on, or, from a deferred batch, published)."""
        if any(_same_subscriber(s, fn) for s in self._deferred_subscribers):
            with self._lock:  # no flush: the batch under way is being delivered to it
                self._deferred_subscribers = _without(self._deferred_subscribers, fn)
            self.publish(self._failure(fn, event, exc))
            return
        self.unsubscribe(fn)
        failed = self._failure(fn, event, exc)
        self._seq += 1
        failed.seq, failed.t = self._seq, self._clock()
        self._queued.append(failed)

    def _failure(self, fn: Subscriber, event: Event, exc: Exception) -> SinkFailed:
        """The stopped subscriber kept in ``failed_sinks``, logged once with its traceback."""
        name = sink_name(fn)
        error = f"{type(exc).__name__}: {exc}"
        self.failed_sinks[name] = error
        log_failure("kvscope.events", f"event sink {name} failed on a {event.type} event and is stopped; "
                                      "the engine goes on without it")
        return SinkFailed(sink=name, error=error, at_event=event.type)


def sink_name(fn: Subscriber) -> str:
    """What the logs, ``/health`` and the metrics call a subscriber: its ``sink_name``
    attribute when it has one, else its class or function name."""
    named = getattr(fn, "sink_name", None)
    if isinstance(named, str):
        return named
    owner = getattr(fn, "__self__", None)  # a bound method: its object's name
    if owner is not None:
        return sink_name(owner)
    return getattr(fn, "__qualname__", None) or type(fn).__name__
