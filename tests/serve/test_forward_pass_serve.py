"""`engine serve --forward-pass-metrics-port` end to end (slow: it loads the bundled model): a
subscriber with the struct of vLLM's PR #52061 reads one message a step while a real openai
client's completion runs, folded from the server's own request fold (the one behind
/debug/requests): one prefill, then a decode in every step after it, the last included, then
the idle heartbeat."""

from __future__ import annotations

from pathlib import Path

import msgspec
import openai
import pytest
import zmq

from bench.bench_server import free_port, start_server, stop_server
from engine.modelspec.presets import bundled_gguf_path
from tests.events.test_forward_pass import ForwardPassMetrics, ScheduledRequestMetrics

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")]


def _until_idle(sub: zmq.Socket, decoder: msgspec.msgpack.Decoder) -> list[ForwardPassMetrics]:
    """The messages up to and including the idle heartbeat (empty when none came)."""
    messages: list[ForwardPassMetrics] = []
    while sub.poll(5000):
        message = decoder.decode(sub.recv_multipart()[2])
        messages.append(message)
        if message.wall_time == 0.0 and message.scheduled_requests == ScheduledRequestMetrics():
            return messages
    return []


def test_serve_publishes_every_step_of_a_completion_and_the_heartbeat(tmp_path: Path) -> None:
    port, fpm_port = free_port(), free_port()
    proc = start_server(port, "--max-model-len", "512", "--kv-cache-memory-bytes", "64Mi", "--threads", "1",
                        "--forward-pass-metrics-port", str(fpm_port), log_path=tmp_path / "serve.log")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{fpm_port}")
    decoder = msgspec.msgpack.Decoder(ForwardPassMetrics)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        model = client.models.list().data[0].id
        for attempt in range(5):  # a slow joiner: until one whole completion's messages arrive
            client.completions.create(model=model, prompt=f"Warm up {attempt}:", max_tokens=2, temperature=0)
            if _until_idle(sub, decoder):
                break
        else:
            pytest.fail("no forward-pass message reached the subscriber")
        client.completions.create(model=model, prompt="One, two, three, four,", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
        messages = _until_idle(sub, decoder)
    finally:
        sub.close()
        assert stop_server(proc) == 0
    steps = messages[:-1]
    assert [m.scheduled_requests.num_prefill_requests for m in steps] == [1] + [0] * 5
    assert [m.scheduled_requests.num_decode_requests for m in steps] == [0] + [1] * 5  # the finishing step too
    kv = [m.scheduled_requests.sum_decode_kv_tokens for m in steps[1:]]
    assert kv == list(range(kv[0], kv[0] + 5))  # one more token of context each step
    assert all(m.wall_time > 0 for m in steps) and [m.counter_id for m in messages] == sorted(
        m.counter_id for m in messages)
