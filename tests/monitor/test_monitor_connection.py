"""The header says where a followed server stands: connecting, live, refused (with
why) or disconnected (with why, reconnecting with backoff). Every state is reached
against a real HTTP server on 127.0.0.1 (or a port nobody listens on)."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from engine.events import LogEvent, SnapshotEvent, dumps, read_events
from engine.events.feed import CONNECTING, DISCONNECTED, LIVE, REFUSED, HttpFeed
from engine.events.folds.view import EngineView
from monitor.app import MonitorApp
from monitor.widgets.replay_bar import ReplayBar
from monitor.widgets.title_bar import TitleBar
from tests.monitor_fixtures import SAMPLE

SIZE = (160, 50)


class _Server:
    """A ThreadingHTTPServer whose GET /events does what ``mode`` says:
    ``auth`` (401 unless the key is right, then hold), ``hold`` (a snapshot, then
    the stream stays open until ``release``), ``close`` (a snapshot, then the
    server ends the stream half a second later), ``crash`` (HTTP 503)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self.release = threading.Event()
        events = read_events(SAMPLE).events[:120]
        view = EngineView().fold(events)
        self.payload = [dumps(SnapshotEvent(state=view.snapshot(), seq=view.last_seq).to_dict())]
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                server.connections += 1
                if server.mode == "crash":
                    self._plain(503)
                    return
                if server.mode == "auth" and self.headers.get("Authorization") != "Bearer secret":
                    self._plain(401)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for line in server.payload:
                    self.wfile.write(f"data: {line}\n\n".encode())
                self.wfile.flush()
                server.release.wait(0.5 if server.mode == "close" else 30)
                self.close_connection = True

            def _plain(self, status: int) -> None:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[[str], _Server]]:
    servers: list[_Server] = []

    def start(mode: str) -> _Server:
        servers.append(_Server(mode))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _header(app: MonitorApp) -> str:
    return str(app.query_one(TitleBar).render())


async def _wait_for(pilot, predicate: Callable[[], bool], seconds: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(seconds / 0.05)):
        if predicate():
            return
        await pilot.pause(0.05)


async def test_connecting_until_the_server_answers() -> None:
    # A listening socket that never accepts: the TCP handshake completes in the
    # kernel's backlog but no HTTP answer ever comes, so the feed stays "connecting".
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        feed = HttpFeed(f"http://127.0.0.1:{silent.getsockname()[1]}", connect_timeout_s=30)
        app = MonitorApp(feed=feed)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.3)
            assert feed.connection.state == CONNECTING
            assert "◌ CONNECTING" in _header(app)
            assert "LIVE" not in _header(app) and "LIVE" not in str(app.query_one(ReplayBar).render())
        feed.stop()


async def test_live_once_the_stream_is_open(serve) -> None:  # type: ignore[no-untyped-def]
    server = serve("hold")
    feed = HttpFeed(server.url)
    app = MonitorApp(feed=feed)
    async with app.run_test(size=SIZE) as pilot:
        await _wait_for(pilot, lambda: "LIVE" in _header(app) and app.view.step is not None)
        assert feed.connection.state == LIVE
        assert _header(app) == f"kvscope monitor · {server.url}/events  ● LIVE"
        assert str(app.query_one(ReplayBar).render()).startswith("● LIVE")
    feed.stop()


async def test_refused_without_the_api_key_says_why_and_stops(serve) -> None:  # type: ignore[no-untyped-def]
    server = serve("auth")
    feed = HttpFeed(server.url, retry_s=0.05)
    app = MonitorApp(feed=feed)
    async with app.run_test(size=SIZE) as pilot:
        await _wait_for(pilot, lambda: "REFUSED" in _header(app))
        assert _header(app).endswith("✕ REFUSED 401: pass --api-key")
        assert "LIVE" not in str(app.query_one(ReplayBar).render())
        await pilot.pause(0.4)
        assert server.connections == 1  # a refusal is not retried: the key cannot change by itself
        notes = [e.message for e in app.view.recent if isinstance(e, LogEvent)]
        assert any("refused, 401: pass --api-key" in n for n in notes)
    feed.stop()


async def test_a_wrong_api_key_is_named_as_such(serve) -> None:  # type: ignore[no-untyped-def]
    server = serve("auth")
    feed = HttpFeed(server.url, api_key="wrong")
    app = MonitorApp(feed=feed)
    async with app.run_test(size=SIZE) as pilot:
        await _wait_for(pilot, lambda: "REFUSED" in _header(app))
        assert _header(app).endswith("✕ REFUSED 401: --api-key rejected")
    feed.stop()


async def test_the_right_api_key_is_live(serve) -> None:  # type: ignore[no-untyped-def]
    server = serve("auth")
    feed = HttpFeed(server.url, api_key="secret")
    app = MonitorApp(feed=feed)
    async with app.run_test(size=SIZE) as pilot:
        await _wait_for(pilot, lambda: "LIVE" in _header(app))
        assert _header(app).endswith("● LIVE")
    feed.stop()


async def test_nobody_listening_is_disconnected_and_retried_with_backoff() -> None:
    feed = HttpFeed(f"http://127.0.0.1:{_unused_port()}", retry_s=0.1, max_retry_s=0.4)
    app = MonitorApp(feed=feed)
    async with app.run_test(size=SIZE) as pilot:
        await _wait_for(pilot, lambda: feed.connection.attempt >= 4)
        header = _header(app)
        assert "○ DISCONNECTED connection refused (is the server running?)" in header
        assert "LIVE" not in header and "LIVE" not in str(app.query_one(ReplayBar).render())
        assert feed.connection.state == DISCONNECTED and feed.connection.retry_at is not None
        # Backoff doubles 0.1, 0.2, 0.4 and stays at the cap; one note, not one per retry.
        notes = [e.message for e in app.view.recent if isinstance(e, LogEvent)]
        assert sum("disconnected" in n for n in notes) == 1
    feed.stop()


async def test_a_dropped_stream_is_disconnected_then_reconnects(serve) -> None:  # type: ignore[no-untyped-def]
    server = serve("close")
    feed = HttpFeed(server.url, retry_s=0.3)
    app = MonitorApp(feed=feed)
    seen: set[str] = set()
    async with app.run_test(size=SIZE) as pilot:
        def reconnected() -> bool:
            seen.add(_header(app))
            return server.connections >= 3

        await _wait_for(pilot, reconnected)
        assert server.connections >= 3
        assert any(h.endswith("● LIVE") for h in seen)
        assert any("○ DISCONNECTED the server closed the stream" in h for h in seen)
        assert app.view.step is not None  # the view the stream sent stays on screen
    feed.stop()


async def test_server_errors_are_disconnects_not_refusals(serve) -> None:  # type: ignore[no-untyped-def]
    server = serve("crash")
    feed = HttpFeed(server.url, retry_s=0.05, max_retry_s=0.1)
    app = MonitorApp(feed=feed)
    async with app.run_test(size=SIZE) as pilot:
        await _wait_for(pilot, lambda: server.connections >= 3)
        assert server.connections >= 3
        assert "○ DISCONNECTED HTTP 503" in _header(app)
        assert feed.connection.state != REFUSED
    feed.stop()
