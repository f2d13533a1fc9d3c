"""``engine doctor http://…`` against a real ``engine serve`` (the bundled SmolLM2 on a
KV pool of 11 blocks, so concurrent requests preempt each other): the doctor follows
the server's /events stream while 8 clients stream completions, and names the
preempted requests and the pool. Slow: the model loads and generates on the CPU."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from bench.bench_server import free_port, start_server, stop_server
from doctor.cli import examine
from engine.modelspec.presets import bundled_gguf_path

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("doctor-serve") / "serve.log"
    # 8 MiB of float32 KV = 11 blocks of 16 tokens: three 120-token requests already overfill it
    proc = start_server(port, "--max-model-len", "128", "--kv-cache-memory-bytes", "8Mi", "--dtype", "float32",
                        "--max-num-seqs", "8", "--threads", "1", log_path=log)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)


def test_doctor_follows_a_live_server_into_a_preemption_storm(server_url: str) -> None:
    def complete(i: int) -> None:
        httpx.post(f"{server_url}/v1/completions", timeout=120,
                   json={"prompt": f"Count slowly from {i} upwards:", "max_tokens": 100, "ignore_eos": True})

    clients = [threading.Thread(target=complete, args=(i,)) for i in range(8)]
    result: dict[str, object] = {}

    def doctor() -> None:
        result["answer"] = examine(server_url, duration_s=25.0, simulate=False)

    judge = threading.Thread(target=doctor)
    judge.start()
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    judge.join()
    kind, findings, _ = result["answer"]  # type: ignore[misc]
    assert kind == "live"
    pool = next(f for f in findings if f.rule == "pool_binds")
    assert pool.numbers["preemptions"] >= 1 and pool.numbers["pool_tokens"] == 176
    assert pool.evidence[1].startswith(f"request {pool.numbers['worst_request']} was preempted ")
