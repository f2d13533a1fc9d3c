"""Where the monitor's events come from: the in-process bus, a server's
``GET /events`` stream, or a JSONL recording.

Live feeds only queue events (the bus calls us on the engine thread, the HTTP
reader runs on its own thread); the app drains the queue on its timer, so a fast
engine never waits on the terminal.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from engine.errors import UserError
from engine.events import Event, EventBus, LogEvent, SnapshotEvent, event_from_dict, read_events
from monitor.state import Timeline


class LiveFeed:
    """A thread-safe queue of events with a name for the status line."""

    description = "live"

    def __init__(self) -> None:
        self._queue: deque[Event] = deque()
        self._skip_through_seq = 0

    def push(self, event: Event) -> None:
        self._queue.append(event)

    def drain(self) -> list[Event]:
        out: list[Event] = []
        while self._queue:
            event = self._queue.popleft()
            if isinstance(event, SnapshotEvent):
                self._skip_through_seq = int(event.state.get("last_seq", 0))
            elif 0 < event.seq <= self._skip_through_seq:
                continue  # already inside the snapshot
            out.append(event)
        return out

    def start(self) -> None:
        """Begin receiving events."""

    def stop(self) -> None:
        """Stop receiving events."""


class BusFeed(LiveFeed):
    """Subscribes to an in-process :class:`EventBus`.

    ``snapshot_fn`` (optional) returns the current :meth:`EngineView.snapshot`
    dict, so a dashboard opened mid-run starts from the present state.
    """

    description = "in-process"

    def __init__(self, bus: EventBus, snapshot_fn: Callable[[], dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.bus = bus
        self.snapshot_fn = snapshot_fn

    def start(self) -> None:
        # Subscribe before taking the snapshot; drain() drops the overlap by seq.
        self.bus.subscribe(self.push)
        if self.snapshot_fn is not None:
            self._queue.appendleft(SnapshotEvent(state=self.snapshot_fn()))

    def stop(self) -> None:
        self.bus.unsubscribe(self.push)


def events_url(url: str) -> str:
    """``http://host:port`` or ``.../events`` -> the events endpoint."""
    if not url.startswith(("http://", "https://")):
        raise UserError(f"{url!r} is not a server URL; pass http://HOST:PORT (or use `monitor replay FILE`)")
    url = url.rstrip("/")
    return url if url.endswith("/events") else url + "/events"


def parse_sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """Server-sent events -> one JSON object per event (``data:`` lines joined)."""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                payload = "\n".join(data)
                data = []
                try:
                    obj = json.loads(payload)
                except json.JSONDecodeError:
                    continue
                if isinstance(obj, dict):
                    yield obj
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        # comments (": keep-alive"), event:, id:, retry: carry nothing we need
    if data:
        try:
            obj = json.loads("\n".join(data))
        except json.JSONDecodeError:
            return
        if isinstance(obj, dict):
            yield obj


class HttpFeed(LiveFeed):
    """Reads a server's ``GET /events`` SSE stream on a background thread,
    reconnecting after a drop (each reconnect starts with a fresh snapshot)."""

    def __init__(self, url: str, api_key: str | None = None, retry_s: float = 1.0) -> None:
        super().__init__()
        self.url = events_url(url)
        self.description = self.url
        self.api_key = api_key
        self.retry_s = retry_s
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="monitor-sse", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _note(self, level: str, message: str) -> None:
        self.push(LogEvent(level=level, message=message))

    def _run(self) -> None:
        headers = {"Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        timeout = httpx.Timeout(connect=5.0, read=None, write=5.0, pool=5.0)
        while not self._stop.is_set():
            try:
                with httpx.Client(timeout=timeout) as client, client.stream("GET", self.url, headers=headers) as r:
                    if r.status_code in (401, 403):
                        self._note("error", f"{self.url}: API key rejected (HTTP {r.status_code}); pass --api-key")
                        return
                    if r.status_code != 200:
                        self._note("error", f"{self.url}: HTTP {r.status_code}")
                    else:
                        self.connected.set()
                        for obj in parse_sse(r.iter_lines()):
                            if self._stop.is_set():
                                return
                            try:
                                self.push(event_from_dict(obj))
                            except (ValueError, TypeError) as exc:
                                self._note("warning", f"skipped an event: {exc}")
            except httpx.HTTPError as exc:
                self._note("warning", f"{self.url}: {exc.__class__.__name__}: {exc}; retrying")
            self.connected.clear()
            self._stop.wait(self.retry_s)


def load_timeline(path: str | Path, checkpoint_every: int = 500) -> Timeline:
    """Open a JSONL recording for replay; bad files become a one-line UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such recording; pass a .jsonl file written by the engine (engine ... --events FILE)")
    try:
        recording = read_events(path)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    return Timeline(recording.events, checkpoint_every=checkpoint_every)
