"""The phase-aware iteration histograms on a real `engine serve`'s /metrics (bundled SmolLM2,
fp32, loopback, a recording): after a few requests, some concurrent so prefills and decodes
share steps, each phase's counts and sums as prometheus_client's text parser reads them equal
what the recording's step events scheduled."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from bench.bench_server import free_port, start_server, stop_server
from engine.events import StepEvent, read_events
from engine.modelspec.presets import bundled_gguf_path
from tests.events.test_iteration_phase_metrics import expected, scraped
from tests.serve.test_server_hardening import Server

pytestmark = pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")


def complete(server: Server, prompt: str, max_tokens: int) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200


def test_served_phase_histograms_match_the_recorded_steps(tmp_path: Path) -> None:
    events = tmp_path / "run.jsonl"
    port = free_port()
    proc = start_server(
        port, "--max-model-len", "512", "--kv-cache-memory-bytes", "32Mi", "--dtype", "float32",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--threads", "1", "--events", str(events),
        log_path=tmp_path / "serve.log",
    )  # fmt: skip
    server = Server(proc, port, tmp_path / "serve.log")
    try:
        complete(server, "The capital of France is", 3)
        prompts = ["Once upon a time there was a little fox who lived in a forest near the sea and",
                   "Water boils at one hundred degrees Celsius at sea level, which means that"]
        threads = [threading.Thread(target=complete, args=(server, p, 12)) for p in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        server.wait_idle()
        got = scraped(httpx.get(server.url + "/metrics", timeout=10).text)
    finally:
        stop_server(proc)
    steps = [e for e in read_events(events).events if isinstance(e, StepEvent)]
    assert got == expected(steps)
    assert got[("vllm:iteration_requests", "_count", "prefill")] >= 3  # the long prompts were chunked
    assert got[("vllm:iteration_requests", "_sum", "decode")] > 0
