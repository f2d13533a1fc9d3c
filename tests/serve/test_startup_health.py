"""While the engine starts, the real server (uvicorn on 127.0.0.1, the bundled model) answers
``/health`` with 503, the phase and the ETA; ``/metrics`` answers; a completion sent then waits
and is served once phase G ends. Startup is held at phase D's begin by a bus subscriber (the
engine thread publishes it), so the test sees startup whatever the machine's pace."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.bench_server import free_port
from engine.cli.commands.serve import make_server
from engine.events import Event, EventBus, StartupPhase
from engine.llm import engine_config
from engine.modelspec.presets import bundled_gguf_path
from engine.serve.host import EngineHost, ServerSettings
from engine.serve.startup_health import starting_message
from engine.startup_eta import HISTORY_ENV

pytestmark = pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")


class HoldAt:
    """Blocks the engine thread when phase ``letter`` begins, until :meth:`release`."""

    def __init__(self, letter: str) -> None:
        self.letter = letter
        self.reached = threading.Event()
        self._go = threading.Event()

    def __call__(self, event: Event) -> None:
        if isinstance(event, StartupPhase) and event.phase == self.letter and event.status == "begin":
            self.reached.set()
            self._go.wait(120)

    def release(self) -> None:
        self._go.set()


def _until(predicate: Callable[[], Any], seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {seconds:g} s: {what}")


@pytest.fixture
def starting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, HoldAt]]:
    monkeypatch.setenv(HISTORY_ENV, str(tmp_path / "startup-history.json"))
    hold = HoldAt("D")
    bus = EventBus()
    bus.subscribe(hold)
    config = engine_config("smollm2-135m", max_model_len=512, kv_cache_memory_bytes=32 * 2**20,
                           max_num_batched_tokens=256, max_num_seqs=4, stats_interval=0.0, dtype="float32")
    host = EngineHost.create(config, ServerSettings(served_model_name="smollm2", shutdown_timeout_s=2.0), bus=bus)
    port = free_port()
    server = make_server(host, "127.0.0.1", port)
    thread = threading.Thread(target=server.run, name="test-http", daemon=True)
    thread.start()
    try:
        _until(lambda: server.started, 60, "uvicorn serving before the engine is ready")
        yield f"http://127.0.0.1:{port}", hold
    finally:
        hold.release()
        host.begin_shutdown()
        server.should_exit = True
        thread.join(timeout=60)


def test_health_says_the_phase_and_the_eta_during_startup_and_requests_wait(starting: tuple[str, HoldAt]) -> None:
    url, hold = starting
    assert hold.reached.wait(120), "startup never reached phase D"
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503
    body = health.json()
    assert body["error"]["code"] == "starting" and body["error"]["type"] == "service_unavailable"
    status = body["startup"]
    assert status["phase"] == "D" and status["name"] == "profile_run"
    assert status["predicted_s"] is not None and status["predicted_s"] > 0  # the startup.eta event's phase D
    assert status["eta_s"] >= status["predicted_s"] - (status["elapsed_s"] or 0.0)  # D's rest, then E-G
    assert body["error"]["message"].startswith("the engine is starting: phase D profile_run")
    assert "ready in ~" in body["error"]["message"]
    assert int(health.headers["Retry-After"]) >= 1
    assert httpx.get(url + "/metrics", timeout=10).status_code == 200  # observability answers at once
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                           timeout=120)
        hold.release()
        answer = held.result()
    assert answer.status_code == 200, answer.text  # held through startup, then served
    assert answer.json()["usage"]["completion_tokens"] <= 2
    _until(lambda: httpx.get(url + "/health", timeout=10).status_code == 200, 60, "/health 200 once ready")


def test_the_starting_message() -> None:
    status = {"phase": "C", "name": "load_weights", "status": "running", "elapsed_s": 12.0, "predicted_s": 30.0,
              "eta_s": 25.4}
    assert starting_message(status) == "the engine is starting: phase C load_weights, 12.0 s of ~30.0 s; ready in ~25 s"
    late = {**status, "elapsed_s": 40.0, "eta_s": 7.0}
    assert starting_message(late) == ("the engine is starting: phase C load_weights, 40.0 s, past the ~30.0 s "
                                      "predicted; the phases after it ~7 s")
    assert starting_message({"phase": None}) == "the engine is starting"
