"""A stalled data-parallel core caught and named (engine/serve/stall.py): a real ``engine
serve -dp 2 --stall-timeout 2`` of the tiny dummy-weight Llama under load; the test SIGSTOPs
rank 1's engine-core process, ``/health`` answers 503 ``engine_stalled`` naming rank 1 (its
heartbeat lives in the server's shared memory, so the stopped core still shows its last
step), the dump is written beside the recording, and after SIGCONT the core steps again,
``/health`` is 200 and every request completes. Real time, with generous bounds."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_data_parallel import tiny_dp_server

pytestmark = pytest.mark.slow  # two engine cores start (40-90 s on the loaded 2-core machine)

REQUESTS = 8


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with tiny_dp_server(tmp_path_factory.mktemp("tiny-llama-dp-stall"), "--stall-timeout", "2") as server:
        yield server


def _complete(url: str, index: int) -> int:
    body = {"prompt": [5 + index, 17, 29, 31, 40 + index], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300).status_code


def _health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


def _until(what: str, timeout_s: float, check: Any) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout_s:g} s")


def test_a_stopped_core_is_named_by_health_then_recovers(dp_server: dict[str, Any]) -> None:
    url = dp_server["url"]
    state = httpx.get(f"{url}/debug/state", timeout=10).json()
    pid = next(r["pid"] for r in state["data_parallel"]["ranks"] if r["rank"] == 1)
    with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
        answers = [pool.submit(_complete, url, i) for i in range(REQUESTS)]
        _until("rank 1 given requests", 60, lambda: next(
            r["routed"] for r in httpx.get(f"{url}/debug/state", timeout=10).json()["data_parallel"]["ranks"]
            if r["rank"] == 1))
        os.kill(pid, signal.SIGSTOP)
        try:
            stalled = _until("/health 503", 60, lambda: (r := _health(url)).status_code == 503 and r.json())
        finally:
            os.kill(pid, signal.SIGCONT)
        assert stalled["error"] == "engine_stalled" and stalled["rank"] == 1, stalled
        assert stalled["stalled_s"] >= 2.0 and stalled["limit_s"] == 2.0
        assert stalled["last_step"]["pid"] == pid
        dump = Path(stalled["dump"])
        assert dump.parent == Path(dp_server["events"]).parent and dump.name.startswith("run.stall-dp1-")
        body = json.loads(dump.read_text())
        assert body["stall"]["rank"] == 1 and set(body) >= {"stacks", "last_step", "requests"}
        _until("/health 200 after SIGCONT", 120, lambda: _health(url).status_code == 200)
        assert [a.result() for a in answers] == [200] * REQUESTS
    kinds = [e["type"] for e in httpx.get(f"{url}/debug/state", timeout=10).json()["recent"]]
    assert "engine.stalled" in kinds and "engine.recovered" in kinds
    # the stopped core records its own stall once it runs again (the server told it)
    recording = Path(dp_server["events"]).with_name("run.dp1.jsonl")
    _until("the stall in rank 1's recording", 60, lambda: '"engine.recovered"' in recording.read_text())
    assert '"engine.stalled"' in recording.read_text()
