"""``monitor record URL... --out FILE``: another server's /metrics scrapes and KV-event
batches, with timestamps, in kvscope's JSONL recording format.

Every event goes through an :class:`~engine.events.EventBus` (one ``seq`` order for the
pollers' task and the subscribers' threads, ``t`` in seconds since the recording
began) into a :class:`~engine.events.JsonlSink`, so ``monitor replay FILE`` seeks it
like a kvscope run: the same fold (:class:`monitor.replica.ReplicaState`) reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from engine.events import Event, EventBus, JsonlSink
from monitor.external import RECORDER, ExternalFeed, KvEndpoint
from monitor.poller import base_url


class Recorder:
    """A sink for events arriving from several threads: stamped by one bus, written in order."""

    def __init__(self, path: str | Path, sources: Sequence[str], kv: Sequence[KvEndpoint]) -> None:
        start = time.monotonic()
        self.bus = EventBus(clock=lambda: time.monotonic() - start)
        self.sink = JsonlSink(path, config={"source": RECORDER, "sources": [base_url(s) for s in sources],
                                            "kv_events": {k.source: k.endpoint for k in kv},
                                            "started_unix": time.time()})
        self.bus.subscribe(self.sink)
        self._lock = threading.Lock()
        self.count = 0

    def __call__(self, event: Event) -> None:
        with self._lock:
            self.bus.publish(event)
            self.count += 1

    def close(self) -> None:
        self.sink.close()


async def record(urls: Sequence[str], out: str | Path, *, kv: Sequence[KvEndpoint] = (), interval_s: float = 1.0,
                 timeout_s: float = 2.0, duration_s: float | None = None, stop: asyncio.Event | None = None,
                 progress: Callable[[int], None] | None = None) -> int:
    """Record until ``duration_s`` passes or ``stop`` is set; returns the events written."""
    recorder = Recorder(out, urls, kv)
    feed = ExternalFeed(urls, kv=kv, interval_s=interval_s, timeout_s=timeout_s, deliver=recorder)
    stop = stop or asyncio.Event()
    feed.start()
    started = time.monotonic()
    try:
        while not stop.is_set():
            left = None if duration_s is None else duration_s - (time.monotonic() - started)
            if left is not None and left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(1.0, left) if left is not None else 1.0)
            if progress is not None:
                progress(recorder.count)
    finally:
        await feed.stop()
        recorder.close()
    return recorder.count
