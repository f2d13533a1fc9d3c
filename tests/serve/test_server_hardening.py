"""The server's edges, each a defect a reliability probe found (issue 16), against a real
`engine serve` with one sequence slot and two waiting places, no API key (so the
loopback Host check is on) and one CORS origin: abandoned queued requests must leave
the waiting count, bad Unicode and non-finite numbers are 400s on a connection that
stays open, a huge body is refused before it is parsed while /health keeps
answering, and the HTTP surface (405 Allow, OpenAPI's error codes, CORS) matches
what clients and tools expect. Schemathesis runs under ``make test-slow`` (the
500-client load test is in test_server.py)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.bench_server import free_port, start_server, stop_server
from engine.modelspec.presets import bundled_gguf_path

ORIGIN = "http://ui.example"
pytestmark = pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")


class Server:
    def __init__(self, proc: Any, port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path

    def post(self, path: str, body: Any, **kw: Any) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url + path, content=content, headers={"Content-Type": "application/json"},
                          timeout=kw.pop("timeout", 60), **kw)

    def waiting(self) -> int:
        return int(httpx.get(self.url + "/debug/state", timeout=10).json()["server"]["waiting_requests"])

    def metric(self, name: str) -> float:
        families = text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=10).text)
        return next(s.value for f in families for s in f.samples if s.name == name)

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            state = httpx.get(self.url + "/debug/state", timeout=10).json()
            if not state["requests"] and state["kv"]["used"] == 0 and state["server"]["waiting_requests"] == 0:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle: {len(state['requests'])} requests, kv {state['kv']}, "
                                     f"waiting {state['server']}")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("hardening") / "serve.log"
    port = free_port()
    proc = start_server(
        port, "--max-model-len", "1024", "--kv-cache-memory-bytes", "64Mi", "--dtype", "float32",
        "--max-num-seqs", "1", "--max-waiting-requests", "2", "--threads", "1", "--shutdown-timeout", "2",
        "--allowed-origins", json.dumps([ORIGIN]), log_path=log_path,
    )  # fmt: skip
    yield Server(proc, port, log_path)
    stop_server(proc)


def _long_stream(server: Server, started: threading.Event, stop: threading.Event) -> None:
    """Hold the one sequence slot until ``stop``."""
    body = {"prompt": "Tell a very long story.", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                started.set()
            if stop.is_set():
                return


def test_requests_abandoned_while_queued_leave_the_waiting_count(server: Server) -> None:
    """Two clients give up while queued behind a long request: with two waiting places a
    leak would answer 429 to everyone for good. The count returns to 0 at once, and
    after the long request ends fresh requests are admitted."""
    started, stop = threading.Event(), threading.Event()
    holder = threading.Thread(target=_long_stream, args=(server, started, stop), daemon=True)
    holder.start()
    assert started.wait(60)
    for _ in range(2):
        with pytest.raises(httpx.ReadTimeout):
            server.post("/v1/completions", {"prompt": "queued", "max_tokens": 4}, timeout=1.0)
    deadline = time.monotonic() + 5
    while server.waiting() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.waiting() == 0
    # still queued behind the holder, a third is accepted (not 429): the places are free
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", {"prompt": "queued again", "max_tokens": 4}, timeout=1.0)
    stop.set()
    holder.join(30)
    server.wait_idle()
    assert server.metric("vllm:num_requests_waiting") == 0
    for _ in range(3):
        r = server.post("/v1/completions", {"prompt": "fresh", "max_tokens": 2})
        assert r.status_code == 200, r.text


def _same_connection_twice(server: Server, first: bytes) -> tuple[http.client.HTTPResponse, int, int]:
    """Send ``first`` then a valid request on one keep-alive connection; the first
    response, the second's status, and whether the socket was the same (1) or reopened (0)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=first, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.body = response.read()  # type: ignore[attr-defined]
        sock = conn.sock
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "max_tokens": 1}).encode(),
                     headers={"Content-Type": "application/json"})
        second = conn.getresponse()
        second.read()
        return response, second.status, int(sock is not None and conn.sock is sock)
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "\\ud800 lone high surrogate"}', "prompt"),
        (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
        (b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
        (b'{"prompt": "hi", "top_p": 1e400}', "top_p"),
    ],
)
def test_bad_unicode_and_non_finite_numbers_are_400_on_a_kept_connection(server: Server, body: bytes,
                                                                        param: str) -> None:
    response, second, same = _same_connection_twice(server, body)
    assert response.status == 400, response.body  # type: ignore[attr-defined]
    error = json.loads(response.body)["error"]  # type: ignore[attr-defined]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert second == 200 and same == 1  # the keep-alive connection survived the refusal


def test_chat_message_with_a_lone_surrogate(server: Server) -> None:
    r = server.post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x \\udfff"}]}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "surrogate" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [10_000_000]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"best_of": 3}, "best_of"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_values_kvscope_would_have_to_guess_at_are_refused(server: Server, extra: dict[str, Any],
                                                           param: str) -> None:
    r = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_neutral_values_of_unsupported_fields_are_accepted(server: Server) -> None:
    r = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 1, "best_of": 1, "tools": None,
                                        "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text


def test_a_huge_body_is_refused_at_once_while_health_answers(server: Server) -> None:
    """A 10 MB prompt: 413 from its Content-Length, before any parsing; /health meanwhile
    answers within 100 ms. A prompt under the body limit but longer than any fit is a
    400 found before tokenising."""
    latencies: list[float] = []
    unhealthy: list[str] = []  # what a poll got instead of a 200 (the thread's own assert would die unseen)
    done = threading.Event()
    answered = threading.Event()  # the poller is under way: the posts below overlap its polls, whatever the pace

    def poll_health() -> None:
        with httpx.Client(timeout=10) as client:
            while not done.is_set():
                start = time.perf_counter()
                try:
                    answer = client.get(server.url + "/health")
                except httpx.HTTPError as exc:
                    unhealthy.append(f"{type(exc).__name__}: {exc}")
                    continue
                latencies.append(time.perf_counter() - start)
                answered.set()
                if answer.status_code != 200:
                    unhealthy.append(f"{answer.status_code}: {answer.text[:300]}")
                time.sleep(0.01)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    assert answered.wait(60), f"/health never answered: {unhealthy}"
    try:
        start = time.perf_counter()
        r = server.post("/v1/completions", json.dumps({"prompt": "x " * 5_000_000}).encode())
        refused_in = time.perf_counter() - start
        big = server.post("/v1/completions", {"prompt": "word " * 100_000})  # 500 kB
    finally:
        done.set()
        poller.join(10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert refused_in < 5.0
    assert big.status_code == 400 and "--max-model-len" in big.json()["error"]["message"], big.text
    assert not unhealthy, unhealthy
    assert latencies and max(latencies) < 0.1, max(latencies)


def test_http_surface(server: Server) -> None:
    r = httpx.get(server.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "error" in r.json()
    schema = httpx.get(server.url + "/openapi.json", timeout=10).json()
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text
    assert "400" in schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "application/json" not in schema["paths"]["/health"]["get"]["responses"]["200"].get("content", {})
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "text/event-stream" in schema["paths"]["/events"]["get"]["responses"]["200"]["content"]
    assert "text/event-stream" in schema["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    # no API key on a loopback bind: only loopback Host names are served (DNS rebinding)
    assert httpx.get(server.url + "/health", headers={"Host": "attacker.example"}, timeout=10).status_code == 400
    assert httpx.get(server.url + "/health", headers={"Host": f"localhost:{server.port}"},
                     timeout=10).status_code == 200
    # CORS for the one allowed origin only
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    r = httpx.options(server.url + "/v1/completions", headers=preflight, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(server.url + "/v1/completions", headers={**preflight, "Origin": "http://other.example"},
                      timeout=10)
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(server: Server) -> None:
    """200 generated examples against /openapi.json: no 5xx and no response the schema
    does not document."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    checks = (not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance)
    failures: list[str] = []
    # /events never ends (it is the live stream); its content type is checked in test_http_surface
    operations = [op for op in (result.ok() for result in schema.get_all_operations()) if op.path != "/events"]

    def exercise(op: Any) -> None:
        @settings(max_examples=200 // len(operations) + 1, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)
        @given(case=op.as_strategy())
        def examples(case: Any) -> None:
            if isinstance(case.body, dict):  # keep each example one short step
                case.body["max_tokens"] = 1
                case.body.pop("max_completion_tokens", None)
            response = case.call(base_url=server.url, timeout=60)
            for checker in checks:
                try:
                    case.validate_response(response, checks=(checker,))
                except BaseException as exc:  # schemathesis raises groups: collect them all
                    detail = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())[:600]
                    failures.append(f"{op.method.upper()} {op.path} {checker.__name__}: {detail}")

        examples()

    for op in operations:
        exercise(op)
    assert not failures, sorted(set(failures))[:10]
