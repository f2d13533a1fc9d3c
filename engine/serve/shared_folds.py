"""The folds the server's routes read and its exporters share, folded on the engine thread and
read under a lock: the engine view (``/debug/state``, ``/events``' snapshot; the metrics' token
usage) and every request's life (``/debug/requests``; the OTLP and Perfetto exporters). Each is
called by every reader before it reads and folds an event once, for whichever calls first. No
torch: ``engine serve`` builds them before its exporters, whose flags are checked first."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from engine.errors import UserError
from engine.events import Event, EventBus
from engine.events.deferred_delivery import FlushedOnRead
from engine.events.folds.request_record import RequestFold, request_metrics
from engine.events.folds.view import EngineView


class FoldedLast:
    """The event a shared fold folded last, with its stamps then: each reader of the fold calls
    it before reading, and only the first to call with an event folds it."""

    __slots__ = ("event", "seq", "t")

    def __init__(self) -> None:
        self.event: Event | None = None
        self.seq = 0
        self.t = 0.0

    def first_sight(self, event: Event) -> bool:
        """Whether ``event`` is new here; it is marked folded if so."""
        if self.event is event and self.seq == event.seq and self.t == event.t:
            return False
        self.event, self.seq, self.t = event, event.seq, event.t
        return True


class LockedView(FlushedOnRead):
    """An :class:`EngineView` folded on the engine thread and read by handlers; the metrics'
    token usage reads it too (each event folded once, by whichever reader calls first)."""

    def __init__(self) -> None:
        self.view = EngineView()
        self._lock = threading.Lock()
        self._folded = FoldedLast()

    def __call__(self, event: Event) -> None:
        with self._lock:
            if self._folded.first_sight(event):
                self.view.apply(event)

    def snapshot(self) -> dict[str, Any]:
        self.settle()
        with self._lock:
            return self.view.snapshot()

    def request_ids(self) -> list[str]:
        """The requests the engine holds: arrived and not yet finished."""
        self.settle()
        with self._lock:
            return list(self.view.requests)

    def snapshot_of_rank(self, rank: int) -> dict[str, Any]:
        """``GET /debug/state?dp_rank=``: one engine core here, rank 0."""
        if rank != 0:
            raise UserError(f"dp_rank {rank}: this server runs one engine core (rank 0); start it with "
                            "--data-parallel-size to have more")
        return self.snapshot()


class LockedLifecycle(FlushedOnRead):
    """Every request's life (engine/events/folds/request_record.py), folded on the engine thread
    and read by ``GET /debug/requests`` (a copy under the lock: the fold moves on); the OTLP and
    Perfetto exporters read it too (each event folded once, by whichever reader calls first)."""

    def __init__(self) -> None:
        self.fold = RequestFold()
        self._lock = threading.Lock()
        self._folded = FoldedLast()

    def __call__(self, event: Event) -> None:
        with self._lock:
            if self._folded.first_sight(event):
                self.fold(event)

    def life(self, request_id: str) -> dict[str, Any] | None:
        self.settle()
        with self._lock:
            life = self.fold.get(request_id)
            return None if life is None else {**life.to_dict(), "timeline": [
                {"step": step, "what": text} for step, text in life.timeline()]}

    def metrics(self, request_id: str) -> dict[str, Any] | None:
        """A finished request's per-request metrics (vLLM's names, kvscope's own beside)."""
        self.settle()
        with self._lock:
            life = self.fold.get(request_id)
            return None if life is None else request_metrics(life)

    def rows(self, state: str | None, now: float) -> list[dict[str, Any]]:
        self.settle()
        with self._lock:
            return [life.summary(now) for life in self.fold.in_state(state)]


def subscribe_observers(bus: EventBus, observers: Iterable[Callable[[Event], None]]) -> None:
    """The server's observers on ``bus``, deferred (engine/events/deferred_delivery.py: in
    batches, 0.05 s behind the engine while it steps); a fold that other threads read flushes the bus
    before each read, so a route never answers from behind the engine."""
    for observer in observers:
        bus.subscribe(observer, deferred=True)
        if isinstance(observer, FlushedOnRead):
            observer.read_through(bus.flush)
