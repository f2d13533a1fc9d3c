"""One engine core's stall through the real server (engine/serve/stall.py's wiring in
EngineHost): ``--stall-timeout 1`` and a forward the test holds on a gate (patched in the
test's own code): ``/health`` answers 503 ``engine_stalled`` for rank 0 in its forward with
the request it holds, ``/debug/state`` shows the stall, the dump beside the recording has
the engine thread's stack in the held forward; released, the request completes and
``/health`` is 200 again. Real time, generous bounds: the limit is 1 s, the gate is the
test's."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from bench.bench_server import free_port
from engine.modelspec.presets import bundled_gguf_path

pytestmark = pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")


def _until(what: str, timeout_s: float, check: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Any, Path]]:
    from engine.cli.commands.serve import settings_from_args
    from engine.cli.flags import engine_config_from_args
    from engine.cli.main import build_parser
    from engine.serve.app import build_app
    from engine.serve.host import EngineHost

    port = free_port()
    events = tmp_path / "run.jsonl"
    args = build_parser().parse_args(["serve", "--port", str(port), "--max-model-len", "512", "--kv-cache-memory-bytes",
                                      "64Mi", "--threads", "1", "--stall-timeout", "1", "--events", str(events)])
    host = EngineHost.create(engine_config_from_args(args), settings_from_args(args))
    host.engine.wait_ready()
    uv = uvicorn.Server(uvicorn.Config(build_app(host), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    _until("uvicorn started", 30, lambda: uv.started)
    try:
        yield f"http://127.0.0.1:{port}", host, events
    finally:
        uv.should_exit = True
        thread.join(30)
        host.engine.shutdown(drain_timeout_s=5)


def test_a_held_forward_is_a_stall_on_health_until_it_returns(server: tuple[str, Any, Path]) -> None:
    url, host, events = server
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    runner = host.engine.engine.runner
    real, gate, held = runner.execute, threading.Event(), threading.Event()

    def held_forward(batch: Sequence[Any]) -> dict[str, int]:
        if not gate.is_set():
            held.set()
            gate.wait(60)  # the test lets it go
        return real(batch)  # type: ignore[no-any-return]

    runner.execute = held_forward
    answer: dict[str, Any] = {}

    def complete() -> None:
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=120)
        answer.update(status=r.status_code, body=r.json())

    client = threading.Thread(target=complete, daemon=True)
    client.start()
    try:
        assert held.wait(60)
        health = _until("/health 503", 30, lambda: (r := httpx.get(url + "/health", timeout=10)).status_code == 503
                        and r.json())
        assert health["error"] == "engine_stalled" and health["rank"] == 0 and health["phase"] == "forward", health
        assert health["limit_s"] == 1.0 and health["stalled_s"] >= 1.0
        assert [r["state"] for r in health["requests"]] == ["scheduled"]  # admitted into the held step
        assert httpx.get(url + "/debug/state", timeout=10).json()["stalled"]["0"]["phase"] == "forward"
        dump = json.loads(Path(health["dump"]).read_text())
        assert Path(health["dump"]).parent == events.parent
        assert any("held_forward" in stack for name, stack in dump["stacks"].items() if name.startswith("kvscope-engine"))
    finally:
        gate.set()
    _until("/health 200 again", 30, lambda: httpx.get(url + "/health", timeout=10).status_code == 200)
    client.join(60)
    assert answer["status"] == 200 and answer["body"]["choices"][0]["finish_reason"] == "length"
    assert "stalled" not in httpx.get(url + "/debug/state", timeout=10).json()
