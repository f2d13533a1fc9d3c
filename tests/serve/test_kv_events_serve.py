"""`engine serve --kv-events-config` end to end (slow: it loads the bundled model): the
test's SUB socket binds a loopback port and the server's PUB connects to it (vLLM's
"connect" case: the address has no wildcard), a real openai client sends prompts that
share a prefix, and the subscriber, written from the protocol, sees the prefix stored
once and the later prompts' blocks chained onto it; the replay socket answers with the
same batches and /metrics counts them, none dropped."""

from __future__ import annotations

import json

import httpx
import msgspec
import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from zmq.utils.monitor import recv_monitor_message

from bench.bench_server import free_port, start_server, stop_server
from engine.modelspec.presets import bundled_gguf_path
from monitor.kv_events import subscriber_side

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")]

TOPIC = b"kv-events"
SHARED = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill. " * 3


def _decode(payload: bytes) -> list[dict]:
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and rank == 0
    return events


def test_serve_publishes_vllm_kv_events_for_shared_prefixes(tmp_path) -> None:
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.bind("tcp://127.0.0.1:*")
    endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    replay = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay, "topic": "kv-events"}
    proc = start_server(port, "--max-model-len", "1024", "--kv-cache-memory-bytes", "64Mi", "--dtype", "float32",
                        "--threads", "1", "--kv-events-config", json.dumps(config), log_path=tmp_path / "serve.log")
    try:
        # The server's PUB connects during startup; a bound SUB sends it the subscription
        # only once the SUB socket is used after that, so wait for the handshake here.
        assert monitor.poll(60_000), "the server's PUB never connected"
        while monitor.poll(100):
            recv_monitor_message(monitor)
        sub.poll(200)
        # vLLM's discovery route maps each DP rank to its KVEventsConfig as resolved; the
        # monitor, applying vLLM's rule in mirror, binds where this server connects (this
        # test's SUB stands in for it: the address is taken, so a probe tells it apart)
        sources = httpx.get(f"http://127.0.0.1:{port}/kv_event_sources", timeout=10).json()
        assert sources == {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                                 "replay_endpoint": replay, "buffer_steps": 10_000, "hwm": 100_000,
                                 "max_queue_size": 100_000, "topic": "kv-events"}}
        assert subscriber_side(sources["0"]["endpoint"], "127.0.0.1") == (endpoint, True)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        model = client.models.list().data[0].id
        for suffix in ("Then it rains.", "Then the sun sets over the hills.", "Then nothing happens at all."):
            client.completions.create(model=model, prompt=SHARED + suffix, max_tokens=4, temperature=0)
        received: list[tuple[int, bytes]] = []
        while sub.poll(3000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC and len(seq) == 8
            received.append((int.from_bytes(seq, "big"), payload))
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        whole: list[tuple[int, bytes]] = []
        while True:
            assert dealer.poll(5000), "no end marker from the replay socket"
            _, topic, seq, payload = dealer.recv_multipart()  # vLLM 0.32's replay framing
            number = int.from_bytes(seq, "big", signed=True)
            assert topic == (b"" if number == -1 else TOPIC)
            if number == -1:
                break
            whole.append((number, payload))
        dealer.close()
        assert [s for s, _ in whole] == list(range(len(whole)))
        assert received and received == whole[len(whole) - len(received):], "live batches are the replay's tail"

        stored: list[dict] = [e for _, p in whole for e in _decode(p) if e["type"] == "BlockStored"]
        assert len(stored) >= 3, "each prompt stores blocks"
        hashes = [h for e in stored for h in e["block_hashes"]]
        assert len(hashes) == len(set(hashes)), "the shared prefix is stored once, then hit"
        assert all(e["medium"] == "CPU" and e["block_size"] == 16 for e in stored)
        assert all(len(e["token_ids"]) == 16 * len(e["block_hashes"]) for e in stored)
        first_blocks = set(stored[0]["block_hashes"])
        assert stored[0]["parent_block_hash"] is None
        assert any(e["parent_block_hash"] in first_blocks for e in stored[1:]), "later prompts chain onto the prefix"

        families = {f.name: f for f in text_string_to_metric_families(
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)}
        assert families["kvscope:kv_events_dropped"].samples[0].value == 0
        assert families["kvscope:kv_events_published"].samples[0].value >= len(whole)  # batches; a message holds 1+
    finally:
        monitor.close(linger=0)
        sub.close()
        assert stop_server(proc) == 0
