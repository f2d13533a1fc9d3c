"""Live event feeds: the in-process bus, or a server's ``GET /events`` stream (the
wire format of engine/serve's events route, read back), with the connection state a
reader shows.

Feeds only queue events (the bus calls them on the engine thread, the HTTP reader runs
on its own thread); the reader (the monitor's timer, ``engine doctor``'s live input)
drains the queue when it likes, so a fast engine never waits on a terminal. They live in
the event wing so that the monitor and the doctor both import them downward.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx

from engine.errors import UserError
from engine.events import Event, EventBus, LogEvent, SnapshotEvent, event_from_dict
from engine.events.folds.view import snapshot_dp_rank

CONNECTING = "connecting"
LIVE = "live"
REFUSED = "refused"
DISCONNECTED = "disconnected"


@dataclass(frozen=True, slots=True)
class Connection:
    """Where a feed stands: ``connecting``, ``live``, ``refused`` (the server answered
    and said no; not retried) or ``disconnected`` (no answer or a dropped stream;
    retried at ``retry_at``, a ``time.monotonic()`` instant)."""

    state: str
    reason: str = ""
    retry_at: float | None = None
    attempt: int = 0


class LiveFeed:
    """A thread-safe queue of events with a name and a :class:`Connection` for the header."""

    description = "live"
    connection = Connection(LIVE)  # an in-process bus is live from the start

    def __init__(self) -> None:
        self._queue: deque[Event] = deque()
        self._skip_through: dict[int, int] = {}  # per DP rank: the seq its latest snapshot holds events to

    def push(self, event: Event) -> None:
        self._queue.append(event)

    def drain(self) -> list[Event]:
        out: list[Event] = []
        while self._queue:
            event = self._queue.popleft()
            if isinstance(event, SnapshotEvent):
                rank, seq = snapshot_dp_rank(event.state) or 0, int(event.state.get("last_seq", 0))
                # The stream's own snapshot (rank 0's) starts afresh; another rank's (follow_rank) adds it.
                self._skip_through = {0: seq} if rank == 0 else self._skip_through | {rank: seq}
            elif 0 < event.seq <= self._skip_through.get(getattr(event, "dp_rank", 0), 0):
                continue  # already inside that rank's snapshot (each DP rank's bus counts its own seq)
            out.append(event)
        return out

    def follow_rank(self, rank: int) -> str | None:
        """Ask for data-parallel rank ``rank``'s state: a snapshot of it arrives through the
        queue (the reader's view then follows that rank). None when asked, else why this
        feed cannot."""
        return "this feed carries one engine's events"

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

    def follow_rank(self, rank: int) -> str | None:
        return ("the in-process dashboard reads DP rank 0's bus alone; to follow another rank, watch the "
                "server with `monitor http://HOST:PORT`")


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


def refusal_reason(status: int, api_key: str | None) -> str:
    """What an HTTP refusal of ``GET /events`` means, in one line."""
    if status in (401, 403):
        return f"{status}: pass --api-key" if not api_key else f"{status}: --api-key rejected"
    if status == 404:
        return "404: no /events here (is it a kvscope server?)"
    return f"HTTP {status}"


def _error_reason(exc: httpx.HTTPError, connect_timeout: float) -> str:
    if isinstance(exc, httpx.ConnectTimeout):
        return f"no answer in {connect_timeout:g} s"
    if isinstance(exc, httpx.ConnectError):
        text = str(exc)
        if "refused" in text.lower():
            return "connection refused (is the server running?)"
        return f"cannot connect: {text.split('] ')[-1] or exc.__class__.__name__}"
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError):
        return "the server dropped the stream"
    return f"{exc.__class__.__name__}: {exc}"


class HttpFeed(LiveFeed):
    """Reads a server's ``GET /events`` SSE stream on a background thread.

    :attr:`connection` says whether it is connecting, live, refused (HTTP 4xx: a
    missing or wrong key, not an events endpoint; never retried) or disconnected
    (nothing listening, no answer, HTTP 5xx, a dropped stream). A disconnected feed
    reconnects with exponential backoff (``retry_s``, doubling to ``max_retry_s``,
    back to ``retry_s`` once a stream was live); each reconnect starts with the
    server's fresh snapshot."""

    def __init__(self, url: str, api_key: str | None = None, retry_s: float = 1.0,
                 max_retry_s: float = 30.0, connect_timeout_s: float = 5.0) -> None:
        super().__init__()
        self.url = events_url(url)
        self.description = self.url
        self.api_key = api_key
        self.retry_s = retry_s
        self.max_retry_s = max(retry_s, max_retry_s)
        self.connect_timeout_s = connect_timeout_s
        self.connected = threading.Event()
        self.connection = Connection(CONNECTING)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.followed_rank = 0  # the DP rank whose snapshot follows the stream's (rank 0's) on each connect

    @property
    def base_url(self) -> str:
        return self.url.removesuffix("/events")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def follow_rank(self, rank: int) -> str | None:
        """Fetch rank ``rank``'s snapshot (``GET /debug/state?dp_rank=R``) on a thread of its
        own, and again after every reconnect (the stream's snapshot is rank 0's)."""
        self.followed_rank = rank
        threading.Thread(target=self._fetch_rank, args=(rank,), name="monitor-dp-rank", daemon=True).start()
        return None

    def _fetch_rank(self, rank: int) -> None:
        """Queue rank ``rank``'s snapshot, or a warning (``data.follow_dp_rank``) saying why not."""
        url = f"{self.base_url}/debug/state?dp_rank={rank}"
        c = self.connect_timeout_s
        try:
            with httpx.Client(timeout=httpx.Timeout(connect=c, read=60.0, write=c, pool=c)) as client:
                r = client.get(url, headers=self._headers())
            if r.status_code == 200:
                state = r.json()
                if rank == self.followed_rank:  # not a rank the reader has since moved on from
                    self.push(SnapshotEvent(state=state, seq=int(state.get("last_seq", 0)),
                                            t=float(state.get("t", 0.0))))
                return
            try:
                why = f"HTTP {r.status_code}: {r.json()['error']['message']}"
            except (ValueError, KeyError, TypeError):
                why = refusal_reason(r.status_code, self.api_key)
        except httpx.HTTPError as exc:
            why = _error_reason(exc, c)
        except ValueError as exc:  # not JSON
            why = f"not a snapshot ({exc})"
        self.push(LogEvent(level="warning", message=f"cannot follow DP rank {rank}: {url}: {why}",
                           data={"follow_dp_rank": rank}))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="monitor-sse", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _note(self, level: str, message: str) -> None:
        self.push(LogEvent(level=level, message=message))

    def _set(self, connection: Connection) -> None:
        previous, self.connection = self.connection, connection
        if connection.state == LIVE:
            self.connected.set()
        else:
            self.connected.clear()
        if (previous.state, previous.reason) == (connection.state, connection.reason):
            return  # a retry that failed the same way: the header's countdown says enough
        if connection.state == REFUSED:
            self._note("error", f"{self.url}: refused, {connection.reason}")
        elif connection.state == DISCONNECTED:
            self._note("warning", f"{self.url}: disconnected, {connection.reason}; reconnecting")
        elif connection.state == LIVE and previous.state == DISCONNECTED:
            self._note("info", f"{self.url}: reconnected")

    def _stream(self, client: httpx.Client, headers: dict[str, str]) -> str | None:
        """One connection; returns why it ended (None: stopped or refused)."""
        with client.stream("GET", self.url, headers=headers) as r:
            if 400 <= r.status_code < 500:
                self._set(Connection(REFUSED, refusal_reason(r.status_code, self.api_key)))
                return None
            if r.status_code != 200:
                return f"HTTP {r.status_code}"
            self._set(Connection(LIVE))
            first = True
            for obj in parse_sse(r.iter_lines()):
                if self._stop.is_set():
                    return None
                try:
                    self.push(event_from_dict(obj))
                except (ValueError, TypeError) as exc:
                    self._note("warning", f"skipped an event: {exc}")
                if first and self.followed_rank:  # the stream's snapshot is rank 0's: the followed rank's after it
                    self._fetch_rank(self.followed_rank)
                first = False
        return "the server closed the stream"

    def _run(self) -> None:
        headers = {"Accept": "text/event-stream", **self._headers()}
        c = self.connect_timeout_s
        timeout = httpx.Timeout(connect=c, read=None, write=c, pool=c)
        failures = 0
        while not self._stop.is_set():
            # The first attempt is "connecting"; a retry stays "disconnected" with its reason.
            self._set(replace(self.connection, retry_at=None) if failures else Connection(CONNECTING))
            try:
                with httpx.Client(timeout=timeout) as client:
                    reason = self._stream(client, headers)
            except httpx.HTTPError as exc:
                reason = _error_reason(exc, c)
            if reason is None:
                return
            failures = 1 if self.connection.state == LIVE else failures + 1
            delay = min(self.max_retry_s, self.retry_s * 2 ** (failures - 1))
            self._set(Connection(DISCONNECTED, reason, time.monotonic() + delay, failures))
            self._stop.wait(delay)
