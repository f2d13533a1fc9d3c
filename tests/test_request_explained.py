"""The real engine explains its requests (issue 33): SmolLM2 with shared prefixes, where each
admission's prefix-cache explanation holds against the prompts it was given, and the
server's ``GET /debug/requests`` shows the same lives (slow: a server of its own)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.core.sampling_params import SamplingParams
from engine.events import Event, EventBus
from engine.events.folds.request_record import lifecycle_of
from engine.llm import LLM

pytestmark = pytest.mark.slow  # a model startup (seconds to a minute on a loaded 2-core machine)

FLAGS = dict(max_model_len=512, kv_cache_memory_bytes=32 * 2**20, max_num_batched_tokens=256, max_num_seqs=8,
             dtype="float32", stats_interval=0.0)
SHARED = list(range(1000, 1040))  # 2 full blocks of 16 and 8 tokens


@pytest.fixture(scope="module")
def lives() -> Iterator[dict[str, object]]:
    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with LLM("smollm2-135m", bus=bus, **FLAGS) as llm:
        first = llm.generate([SHARED], greedy)
        later = llm.generate([SHARED, SHARED[:32], list(range(2000, 2010)), SHARED[:16] + list(range(3000, 3024))],
                             greedy)
    ids = [o.request_id for o in (*first, *later)]
    yield dict(zip(("first", "again", "one_block_short", "short", "forked"), (lifecycle_of(events).lives[i] for i in ids),
                   strict=True))


def test_each_admission_says_where_its_prefix_match_stopped(lives: dict[str, object]) -> None:
    expected = {"first": (0, "diverged"), "again": (32, "complete"), "one_block_short": (16, "last_token"),
                "short": (0, "short_prompt"), "forked": (16, "diverged")}
    for name, (hit, cause) in expected.items():
        life = lives[name]
        assert [(lk.hit_tokens, lk.cause) for lk in life.lookups] == [(hit, cause)], name  # type: ignore[attr-defined]
        assert life.finish_reason == "length" and life.output_tokens == 3, name  # type: ignore[attr-defined]
    again = lives["again"]
    assert again.chunks[0].tokens == 8 and again.chunks[0].computed == 40  # type: ignore[attr-defined]


def test_the_server_shows_each_request_and_why_it_waits(tmp_path: Path) -> None:
    """``--max-num-seqs 1`` and three concurrent requests: while one runs the others wait,
    and ``GET /debug/requests?state=waiting`` says why; each finished one's life is there."""
    import threading

    from bench.bench_server import free_port, start_server, stop_server

    port = free_port()
    proc = start_server(port, "--max-model-len", "512", "--kv-cache-memory-bytes", "32Mi", "--dtype", "float32",
                        "--max-num-seqs", "1", "--threads", "1", log_path=tmp_path / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        def complete(i: int) -> None:
            httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": "smollm2-135m", "prompt": f"Count to {i}:", "max_tokens": 24, "temperature": 0,
                "ignore_eos": True})

        clients = [threading.Thread(target=complete, args=(i,)) for i in range(3)]
        for client in clients:
            client.start()
        waiting: list[dict[str, object]] = []
        while any(c.is_alive() for c in clients) and not any(row["reason"] for row in waiting):
            waiting = httpx.get(f"{url}/debug/requests", params={"state": "waiting"}).json()["requests"]
        for client in clients:
            client.join()
        assert waiting, "no request was seen waiting"
        assert any("--max-num-seqs reached: all 1 sequence slots taken" in str(row["why"]) for row in waiting)
        finished = httpx.get(f"{url}/debug/requests", params={"state": "finished"}).json()["requests"]
        assert len(finished) == 3 and all(row["output_tokens"] == 24 for row in finished)
        life = httpx.get(f"{url}/debug/requests/{finished[-1]['id']}").json()
        assert life["finish_reason"] == "length" and any("waited" in row["what"] for row in life["timeline"])
        assert httpx.get(f"{url}/debug/requests", params={"state": "sleeping"}).status_code == 400
        assert httpx.get(f"{url}/debug/requests/nope").status_code == 404
    finally:
        stop_server(proc)


def test_per_request_metrics_equal_what_the_events_say(tmp_path: Path) -> None:
    """``--enable-per-request-metrics`` and ``"include_metrics": true``: vLLM's five timings and
    kvscope's own, each equal to the recording's request.finished and step events."""
    from bench.bench_server import free_port, start_server, stop_server
    from engine.events import RequestFinished, StepEvent, read_events

    port, events_path = free_port(), tmp_path / "events.jsonl"
    proc = start_server(port, "--max-model-len", "512", "--kv-cache-memory-bytes", "32Mi", "--dtype", "float32",
                        "--threads", "1", "--enable-per-request-metrics", "--events", str(events_path),
                        log_path=tmp_path / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        answer = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 20, "temperature": 0,
            "ignore_eos": True, "include_metrics": True}).json()
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
            "include_metrics": True}).json()
        streamed = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "smollm2-135m", "prompt": "x", "max_tokens": 2, "stream": True, "include_metrics": True})
        plain = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "smollm2-135m", "prompt": "x", "max_tokens": 2}).json()
    finally:
        stop_server(proc)
    assert streamed.status_code == 200 and "metrics" not in plain and "metrics" in chat
    # a stream carries them on its last chunk (issue 33's leftover; a 400 before)
    last = json.loads(streamed.text.split("data: ")[-2])
    events = read_events(events_path).events
    streamed_end = next(e for e in events if isinstance(e, RequestFinished) and e.request_id == last["id"])
    assert last["metrics"]["time_to_first_token_ms"] == pytest.approx(streamed_end.ttft_s * 1e3)
    finished = next(e for e in events if isinstance(e, RequestFinished) and e.request_id == answer["id"])
    metrics = answer["metrics"]
    assert metrics["time_to_first_token_ms"] == pytest.approx(finished.ttft_s * 1e3)
    assert metrics["generation_time_ms"] == pytest.approx(finished.e2e_s * 1e3)
    assert metrics["queue_time_ms"] == pytest.approx(finished.queue_time_s * 1e3)
    itls = finished.inter_token_latencies_s
    assert len(itls) == 19 and metrics["mean_itl_ms"] == pytest.approx(sum(itls) / len(itls) * 1e3)
    assert metrics["tokens_per_second"] == pytest.approx(20 / finished.e2e_s)
    held, peak = 0, 0  # the request's blocks, step by step
    for event in events:
        if isinstance(event, StepEvent):
            held += len(event.allocated.get(answer["id"], [])) - len(event.freed.get(answer["id"], []))
            peak = max(peak, held)
    assert metrics["kvscope"] == {"preemptions": finished.num_preemptions,
                                  "prefix_tokens_reused": finished.prefix_hit_tokens, "peak_blocks": peak}
    assert peak == 2  # 5 prompt tokens + 20 out in blocks of 16
