"""One request's fault stays that request's (issue 30, item 1), against a real server on
127.0.0.1 (uvicorn in this process, so a fault can be injected into the live engine):

* a ``top_k`` past the vocabulary (50,000 on SmolLM2's 49,152; 2**62) is no limit, as vLLM
  clamps it; it once raised inside the batched sampler and killed the engine thread;
* a request whose own sampling raises ends with a 500 (finish reason ``error`` in the
  events and ``vllm:request_success_total{finished_reason="error"}``), while the request
  beside it in the same batch completes and the next one is served;
* a request whose own detokenising raises gets an in-stream error, the same way.

The injected faults replace only what would raise: the row-by-row retry, the scheduler's
``error`` finish, the block frees, the routes and the metrics are the real ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import engine.llm_engine as llm_engine_module
from bench.bench_server import free_port
from engine.cli.commands.serve import make_server
from engine.core.sampling_params import SamplingParams
from engine.events import Event, RequestArrived, RequestFinished
from engine.llm import engine_config
from engine.model.loading.tokenizer import IncrementalDetokenizer
from engine.modelspec.presets import bundled_gguf_path
from engine.serve.host import EngineHost, ServerSettings

pytestmark = pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")

FAULT_SEED = 424_242  # a request with this seed makes the sampler raise (its row only)
FAULT_STOP = "<<detokeniser fault>>"  # a request with this stop string makes its detokeniser raise


class _FaultySampler:
    """The real sampler, except that any batch holding a FAULT_SEED row raises, as a
    bug reached by one request's parameters would."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               positions: Sequence[int] | None = None) -> torch.Tensor:
        if any(p.seed == FAULT_SEED for p in params):
            raise RuntimeError("injected sampler fault")
        return self.real.sample(logits, params, positions)


class _FaultyDetokenizer(IncrementalDetokenizer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faulty = FAULT_STOP in kwargs.get("stop", ())

    def add(self, token: int) -> str:
        if self.faulty and len(self.text) > 0:  # after some text has streamed
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokeniser fault")
        return super().add(token)


class Server:
    def __init__(self, host: EngineHost, url: str) -> None:
        self.host = host
        self.url = url
        self.events: list[Event] = []
        host.bus.subscribe(self.events.append)

    def complete(self, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", json={"prompt": "The capital of France is", **body},
                          timeout=120)

    def stream_lines(self, body: dict[str, Any]) -> list[str]:
        with httpx.stream("POST", self.url + "/v1/completions", timeout=120,
                          json={"prompt": "Once upon a time", "stream": True, **body}) as r:
            assert r.status_code == 200
            return [line for line in r.iter_lines() if line.startswith("data: ")]

    def success_by_reason(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {s.labels["finished_reason"]: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "vllm:request_success_total"}

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            state = httpx.get(self.url + "/debug/state", timeout=10).json()
            if not state["requests"] and state["kv"]["used"] == 0:
                return
            assert time.monotonic() < deadline, f"not idle: {state['requests']}, kv {state['kv']}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    patch = pytest.MonkeyPatch()
    patch.setattr(llm_engine_module, "IncrementalDetokenizer", _FaultyDetokenizer)
    config = engine_config("smollm2-135m", max_model_len=512, kv_cache_memory_bytes=48 * 2**20, max_num_seqs=4,
                           stats_interval=0.0, dtype="float32", threads=1, scheduling_policy="priority")
    host = EngineHost.create(config, ServerSettings(served_model_name="smollm2", shutdown_timeout_s=2.0))
    runner = host.engine.wait_ready().runner
    runner.sampler = _FaultySampler(runner.sampler)  # type: ignore[assignment]
    port = free_port()
    http = make_server(host, "127.0.0.1", port)
    thread = threading.Thread(target=http.run, name="test-http", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not http.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield Server(host, url)
    host.begin_shutdown()
    http.should_exit = True
    thread.join(timeout=30)
    patch.undo()


def test_top_k_past_the_vocabulary_is_no_limit_and_the_engine_goes_on(server: Server) -> None:
    with ThreadPoolExecutor(2) as pool:
        huge = pool.submit(server.complete, {"max_tokens": 3, "top_k": 50_000, "top_p": 0.9})
        ordinary = pool.submit(server.complete, {"max_tokens": 3, "top_k": 40})
        assert huge.result().status_code == 200, huge.result().text
        assert ordinary.result().status_code == 200, ordinary.result().text
    overflowing = server.complete({"max_tokens": 3, "top_k": 2**62, "temperature": 0.7})
    assert overflowing.status_code == 200, overflowing.text
    # top_k at the vocabulary's size samples exactly as no limit does, seed for seed
    seeded = {"max_tokens": 8, "temperature": 1.0, "seed": 7}
    texts = {server.complete({**seeded, "top_k": k}).json()["choices"][0]["text"] for k in (0, 49_152, 10**9)}
    assert len(texts) == 1, texts
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert server.complete({"max_tokens": 2}).status_code == 200


def test_a_request_whose_sampling_raises_fails_alone(server: Server) -> None:
    before = server.success_by_reason()
    with ThreadPoolExecutor(2) as pool:
        neighbour = pool.submit(server.stream_lines, {"max_tokens": 24, "ignore_eos": True, "temperature": 0})
        time.sleep(0.3)  # the neighbour is decoding when the faulty request joins its batch
        faulty = server.complete({"max_tokens": 8, "temperature": 0.8, "seed": FAULT_SEED})
        lines = neighbour.result()
    assert faulty.status_code == 500, faulty.text
    error = faulty.json()["error"]
    assert error["type"] == "internal_error" and "sampling failed: RuntimeError: injected sampler fault" in \
        error["message"], error
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2], lines[-3:]
    server.wait_idle()  # the failed request's blocks are back in the pool
    failed = [e for e in server.events if isinstance(e, RequestFinished) and e.reason == "error"]
    assert [e.error for e in failed] == ["sampling failed: RuntimeError: injected sampler fault"]
    after = server.success_by_reason()
    assert after["error"] == before["error"] + 1
    assert after["length"] == before["length"] + 1
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert server.complete({"max_tokens": 2, "temperature": 0.8, "seed": 1}).status_code == 200


def test_a_request_whose_detokenising_raises_gets_an_in_stream_error(server: Server) -> None:
    with ThreadPoolExecutor(2) as pool:
        neighbour = pool.submit(server.complete, {"max_tokens": 16, "ignore_eos": True})
        lines = server.stream_lines({"max_tokens": 16, "ignore_eos": True, "stop": [FAULT_STOP]})
        assert neighbour.result().status_code == 200
    assert lines[-1] == "data: [DONE]"
    assert '"type":"internal_error"' in lines[-2].replace(" ", "") and "injected detokeniser fault" in lines[-2]
    assert any('"text"' in line for line in lines[:-2]), "text streamed before the fault"
    server.wait_idle()
    failed = [e for e in server.events if isinstance(e, RequestFinished) and e.reason == "error"]
    assert any("detokenising failed: UnicodeDecodeError" in (e.error or "") for e in failed), failed
    assert server.complete({"max_tokens": 2}).status_code == 200


class _FailingExporter:
    """An exporter whose every write raises, as one on a full disk or a dead collector would."""

    sink_name = "failing-exporter"

    def __call__(self, event: Event) -> None:
        raise OSError(28, "No space left on device")


@pytest.mark.sink_failures_expected
def test_a_sink_that_raises_on_every_write_leaves_serving_unaffected(server: Server) -> None:
    server.host.bus.subscribe(_FailingExporter())
    responses = [server.complete({"max_tokens": 4}) for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 200]
    text = httpx.get(server.url + "/metrics", timeout=10).text
    failures = {s.labels["sink"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "kvscope:event_sink_failures_total"}
    assert failures == {"failing-exporter": 1.0}
    state = httpx.get(server.url + "/debug/state", timeout=10).json()
    assert state["failed_sinks"] == {"failing-exporter": "OSError: [Errno 28] No space left on device"}
    assert any(e.get("type") == "sink.failed" for e in state["recent"])
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200  # serving goes on: a supervisor must not restart it
    assert health.json()["failed_sinks"] == {"failing-exporter": "OSError: [Errno 28] No space left on device"}


def test_a_requests_priority_reaches_the_scheduler(server: Server) -> None:
    """vLLM's `priority` field (this server runs --scheduling-policy priority; under fcfs a
    non-zero priority is a 400 naming it, tests/serve/test_request_fields.py)."""
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": -3}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                 "priority": 7})):
        assert httpx.post(server.url + path, json=body, timeout=60).status_code == 200
    arrived = [e.priority for e in server.events if isinstance(e, RequestArrived)][-2:]
    assert arrived == [-3, 7]
    too_big = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "priority": 2**63}, timeout=60)
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "priority"
