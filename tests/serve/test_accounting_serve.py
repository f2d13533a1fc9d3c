"""Every request accounted for and its session recorded, against a real `engine serve`
(bundled SmolLM2, fp32, loopback, a recording): a request's session is its X-Session-Id
header, else its cache_salt, else its user (an over-long key is a 400 naming the header); a
stream the client closes mid-decode finishes ``abort`` with cause ``client_disconnect``; one
still running when the server stops finishes ``abort`` with cause ``shutdown``; every arrival
in the recording has exactly one finish, and /metrics' per-request token sums equal the
token counters while the server runs."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.bench_server import free_port, start_server, stop_server
from engine.events import RequestArrived, RequestFinished, read_events
from engine.events.folds.accounting import RequestLedger
from engine.modelspec.presets import bundled_gguf_path
from tests.serve.test_server_hardening import Server

pytestmark = pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    folder = tmp_path_factory.mktemp("accounting")
    events = folder / "run.jsonl"
    port = free_port()
    proc = start_server(
        port, "--max-model-len", "512", "--kv-cache-memory-bytes", "32Mi", "--dtype", "float32",
        "--max-num-seqs", "4", "--threads", "1", "--shutdown-timeout", "0", "--events", str(events),
        log_path=folder / "serve.log",
    )  # fmt: skip
    server = Server(proc, port, folder / "serve.log")
    yield server, events
    stop_server(proc)


def complete(server: Server, headers: dict[str, str] | None = None, **fields: object) -> httpx.Response:
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, **fields}
    return httpx.post(server.url + "/v1/completions", json=body, headers=headers or {}, timeout=120)


def test_sessions_aborts_and_token_sums(served: tuple[Server, Path]) -> None:
    server, events = served
    assert complete(server, {"X-Session-Id": "conv-1"}, user="someone").status_code == 200
    assert complete(server, user="alice").status_code == 200
    assert complete(server, cache_salt="tenant-7", user="bob").status_code == 200
    assert complete(server).status_code == 200
    refused = complete(server, {"X-Session-Id": "x" * 300})
    assert refused.status_code == 400 and "X-Session-Id" in refused.json()["error"]["message"]

    # a stream the client leaves after two chunks
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "stream": True,
                            "ignore_eos": True}) as stream:
        chunks = 0
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if chunks == 2:
                    break
    server.wait_idle()
    assert server.metric("vllm:request_prompt_tokens_sum") == server.metric("vllm:prompt_tokens_total")
    assert server.metric("vllm:request_generation_tokens_sum") == server.metric("vllm:generation_tokens_total")

    # one running when the server stops (--shutdown-timeout 0): aborted by the shutdown
    started = threading.Event()

    def long_request() -> None:
        started.set()
        with contextlib.suppress(httpx.HTTPError):  # the shutdown may cut the answer
            complete(server, max_tokens=400, ignore_eos=True)

    thread = threading.Thread(target=long_request)
    thread.start()
    started.wait()
    for _ in range(1200):  # until the engine is decoding it
        state = httpx.get(server.url + "/debug/state", timeout=10).json()
        if any(r.get("generated_tokens", 0) > 1 for r in state["requests"].values()):
            break
        time.sleep(0.05)
    stop_server(server.proc)
    thread.join(60)

    recording = read_events(events)
    arrived = {e.request_id: e for e in recording.events if isinstance(e, RequestArrived)}
    sessions = [arrived[rid].session for rid in sorted(arrived, key=lambda r: arrived[r].seq)]
    assert sessions[:4] == ["conv-1", "alice", "tenant-7", ""]
    finished = [e for e in recording.events if isinstance(e, RequestFinished)]
    causes = {e.request_id: (e.reason, e.abort_cause) for e in finished}
    order = sorted(arrived, key=lambda r: arrived[r].seq)
    assert causes[order[4]] == ("abort", "client_disconnect")
    assert causes[order[5]] == ("abort", "shutdown")
    assert all(causes[rid] == ("length", "") for rid in order[:4])
    ledger = RequestLedger()
    for event in recording.events:
        ledger(event)
    assert ledger.balanced, ledger.summary()
    assert json.dumps(ledger.summary()["by_reason"]) == json.dumps(
        {"abort:client_disconnect": 1, "abort:shutdown": 1, "length": 4})
