"""When the engine thread dies after startup (issue 30, item 1's last sentence), the
server says so and goes: /health answers 503 naming the cause, and `engine serve`
stops and exits 1 with a log line naming it, so a supervisor restarts it; under
--monitor the HTTP server stops too and the command exits 1 once the dashboard
closes. No request can kill the engine on purpose (that is the point of issue 30),
so each test injects the fault: ``LLMEngine.step`` raises in a real server."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

import engine.cli.plugins as plugins
from bench.bench_server import ROOT, free_port
from engine.llm_engine import LLMEngine
from engine.modelspec.presets import bundled_gguf_path

pytestmark = [pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed"),
              # the engine thread dying with the injected fault is what these tests are about
              pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")]

FAULT = "injected fault: the engine's own state is unknown"
SERVE_FLAGS = ("--max-model-len", "512", "--kv-cache-memory-bytes", "64Mi", "--threads", "1")

# `engine serve` with LLMEngine.step raising: the first step after a request arrives kills the engine thread.
FAULTY_SERVE = f"""
import sys
from engine.llm_engine import LLMEngine
def step(self):
    raise RuntimeError({FAULT!r})
LLMEngine.step = step
from engine.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _raise_fault(*_: object) -> None:
    raise RuntimeError(FAULT)


def _serve_args(port: int, *extra: str) -> argparse.Namespace:
    from engine.cli.main import build_parser

    return build_parser().parse_args(["serve", "--port", str(port), *SERVE_FLAGS, *extra])


def _wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def _health(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url + "/health", timeout=2)
    except httpx.HTTPError:
        return None


@pytest.fixture
def in_process_server() -> Iterator[tuple[str, Any]]:
    """The real app on a real socket, served by plain uvicorn (which, unlike `engine
    serve`, stays up after the engine dies, so /health can be read at leisure)."""
    from engine.cli.commands.serve import settings_from_args
    from engine.cli.flags import engine_config_from_args
    from engine.serve.app import build_app
    from engine.serve.host import EngineHost

    port = free_port()
    args = _serve_args(port)
    host = EngineHost.create(engine_config_from_args(args), settings_from_args(args))
    host.engine.wait_ready()
    server = uvicorn.Server(uvicorn.Config(build_app(host), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    _wait_for(lambda: server.started, 30, "uvicorn started")
    try:
        yield url, host
    finally:
        server.should_exit = True
        thread.join(30)


def test_health_names_what_stopped_the_engine(in_process_server: tuple[str, Any],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    url, host = in_process_server
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    monkeypatch.setattr(host.engine.engine, "step", _raise_fault)
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code >= 500 and "error" in r.json()
    _wait_for(lambda: host.engine.error is not None, 10, "the engine thread's error recorded")
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503
    error = health.json()["error"]
    assert error["code"] == "engine_dead" and f"RuntimeError: {FAULT}" in error["message"], error
    # the event stream says why too: the recording, /debug/state and the dashboard read it
    assert host.view.snapshot()["engine_error"] == f"RuntimeError: {FAULT}"


def test_engine_serve_exits_1_naming_the_cause(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", FAULTY_SERVE, "serve", "--port", str(port), *SERVE_FLAGS],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for(lambda: proc.poll() is not None or getattr(_health(url), "status_code", 0) == 200, 120,
                  "/health 200")
        assert proc.poll() is None, log_path.read_text()[-2000:]
        try:
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert r.status_code >= 500
        except httpx.HTTPError:
            pass  # the server may already be closing the connection
        returncode = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert returncode == 1, text[-2000:]
    assert f"the engine thread stopped (RuntimeError: {FAULT})" in text, text[-2000:]
    assert "exit status 1" in text


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """--monitor points the log at /dev/null for the rest of the process: not for later tests."""
    import structlog

    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.mark.usefixtures("logging_restored")
def test_monitor_stops_serving_and_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--monitor: the dashboard (a stand-in registered as the plug-in, since the real
    one needs a terminal) sends a request that kills the engine, sees the HTTP server
    stop, and closes as the user would; the command returns 1 and says why."""
    from engine.cli.commands import serve

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    seen: dict[str, Any] = {}

    def dashboard(bus: object, snapshot: Callable[[], dict[str, Any]], title: str) -> None:
        _wait_for(lambda: getattr(_health(url), "status_code", 0) == 200, 60, "/health 200")
        try:
            seen["status"] = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                        timeout=30).status_code
        except httpx.HTTPError:
            seen["status"] = "closed"
        _wait_for(lambda: _health(url) is None, 10, "the HTTP server stopped")

    class EntryPoint:
        name = "stand-in"

        def load(self) -> Callable[..., None]:
            return dashboard

    monkeypatch.setattr(plugins, "entry_points", lambda group: [EntryPoint()])
    monkeypatch.setattr(LLMEngine, "step", _raise_fault)
    args = _serve_args(port, "--monitor")
    assert serve._run_with_monitor(args, serve.settings_from_args(args)) == 1
    assert f"the engine thread died (RuntimeError: {FAULT}); exit status 1" in capsys.readouterr().err
    assert seen["status"] != 200
