"""Deferred delivery: the bus's observers get events in batches, at most ``DEFER_S`` late.

Why: an engine step's forward pass streams the weights through every cache, so an observer
called right after it runs its code and touches its state cold (on a 2-core Zen 4, the server's
sinks cost ~450 µs a SmolLM2 decode step cold against ~150 µs warm). Called with a few steps'
events in a row, each observer's code and state stay warm after the first event.

The rules (docs/observability.md, "When observers see an event"):

- a deferred subscriber sees every event, in ``seq`` order, exactly as a synchronous one would,
  only later: when the oldest waiting event is ``DEFER_S`` old, at the publisher's next event,
  or when the publisher has gone quiet, on this module's flusher thread;
- a reader of what the observers fold (``/metrics``, ``/debug/state``, ``/debug/requests``, a
  response's per-request metrics) calls :meth:`DeferredDelivery.flush` first, so it never reads
  behind the engine;
- unsubscribing a deferred subscriber flushes first, so a closed sink has had everything;
- one thread delivers at a time (a lock); the publisher never waits for it: when a reader is
  delivering, the publisher's events join the batch the reader is draining.

A killed process loses the events that had not reached the deferred sinks (the last ``DEFER_S``
while the publisher steps, up to ``FLUSHER_MAX_SLEEP_S`` more once it is quiet); a clean stop or a crash flushes them. So the JSONL recording, what a post-mortem reads, is
not deferred: it is written as events are published.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from engine.events.record import Event

# The most an observer lags the engine. A batch costs its first event's cold start plus the rest
# warm, all on one step: on Zen 4 with SmolLM2's ~25 ms decode steps, 0.1 s (four steps a batch)
# took ITL p99 to 1.05-1.09x all-off over 30 pairs, 0.05 s (two) to 0.97x at about the same throughput.
DEFER_S = 0.05
DEFERRED_THREAD = "kvscope-deferred-events"  # the flusher thread's name
# The flusher's longest look-away while the publisher delivers its own batches. Each look wakes a
# thread (30-100 µs of CPU on a 2-core Zen 4 VM): woken once a batch and again at every quiet check,
# the flusher spent ~220-300 µs of CPU a SmolLM2 decode step doing nothing. While events flow its
# looks back off from DEFER_S to this, so a batch the publisher leaves behind waits at most ~this long.
FLUSHER_MAX_SLEEP_S = 0.4


class DeferredDelivery:
    """The waiting events and who delivers them; ``deliver(events)`` hands a batch to the
    deferred subscribers (the bus's, with its failure handling)."""

    def __init__(self, deliver: Callable[[list[Event]], None], period_s: float = DEFER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._deliver = deliver
        self.period_s = period_s
        self._clock = clock  # when batches age; the flusher's waits are real seconds
        self._pending: list[Event] = []
        self._since = 0.0  # monotonic time of the oldest pending event
        self._last = 0.0  # and of the newest
        self._pending_lock = threading.Lock()
        self._deliver_lock = threading.Lock()
        self._delivering: int | None = None  # the thread delivering now (its ident)
        self._wake = threading.Event()
        self._parked = False  # the flusher waits for a first event (nothing pending): add wakes it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, event: Event) -> None:
        """Queue ``event``; deliver the batch here when its oldest is ``period_s`` old (the
        publisher's thread pays, between its steps), else leave it to a later event or, once
        the publisher has been quiet ``period_s``, to the flusher thread."""
        now = self._clock()
        with self._pending_lock:
            first = not self._pending
            self._pending.append(event)
            self._last = now
            if first:
                self._since = now
            wake = first and self._parked
            if wake:
                self._parked = False
        if wake:
            self._wake.set()
        elif not first and now - self._since >= self.period_s:
            self.flush(wait=False)

    def flush(self, wait: bool = True) -> None:
        """Deliver every waiting event now. ``wait=False``: return at once when another thread
        is delivering (it drains what this thread queued). Called by a subscriber while it is
        being delivered to, it returns too: the batch under way goes on in order."""
        me = threading.get_ident()
        if self._delivering == me or not self._deliver_lock.acquire(blocking=wait):
            return
        self._delivering = me
        try:
            while True:
                with self._pending_lock:
                    batch, self._pending = self._pending, []
                if not batch:
                    return
                self._deliver(batch)
        finally:
            self._delivering = None
            self._deliver_lock.release()

    def start(self) -> None:
        """Start the flusher thread (idempotent): it delivers a batch the publisher left
        behind when it went quiet."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._flusher, name=DEFERRED_THREAD, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Deliver what waits, then end the flusher thread."""
        self.flush()
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(10)

    def _flusher(self) -> None:
        """Deliver a batch once the publisher has been quiet ``period_s`` (idle, or inside a
        long step): while it publishes, its own thread delivers between steps, not this one
        beside the forward pass, and this one looks less and less often (up to
        :data:`FLUSHER_MAX_SLEEP_S`); once nothing has come for that long it sleeps until the next event."""
        sleep = self.period_s
        while True:
            with self._pending_lock:  # park once nothing came for a longest look: idle, not between steps
                parked = self._parked = not self._pending and self._clock() - self._last >= FLUSHER_MAX_SLEEP_S
                if parked:
                    self._wake.clear()
            if parked:
                self._wake.wait()
                sleep = self.period_s  # a new burst: first look after one period
            if self._stop.is_set() or self._stop.wait(sleep):
                return
            with self._pending_lock:
                last = self._last if self._pending else None
            if last is not None and self._clock() - last >= self.period_s:
                self.flush()
                sleep = self.period_s
            else:  # delivered by the publisher meanwhile, or still publishing: look later
                sleep = min(sleep * 2, FLUSHER_MAX_SLEEP_S)


def _nothing_held_back() -> None:
    return None


class FlushedOnRead:
    """A fold that other threads read (the server's view, request fold and metrics): subscribed
    deferred, each of its reads first delivers what the bus holds back (:meth:`settle`), so a
    reader never sees the engine's past."""

    _flush: Callable[[], None] = staticmethod(_nothing_held_back)

    def read_through(self, flush: Callable[[], None]) -> None:
        """``flush``: the bus's ``flush``, called before every read."""
        self._flush = flush

    def settle(self) -> None:
        self._flush()
