"""The KV cache events sink: :class:`~engine.events.exporters.kv_events.KVEventFold`'s batches
published over ZMQ exactly as vLLM's ``ZmqEventPublisher`` does.

- PUB socket at ``endpoint``: every message is three frames, the topic (UTF-8), the
  batch's sequence number (8 bytes, big-endian, from 0, one per batch sent) and the
  msgpack payload. Bound when the address holds ``*`` or ``::`` or is ipc/inproc
  or asks for port 0, else connected, as vLLM decides. Port 0 (or ``*``) binds a port
  the OS picks, and :attr:`ZmqEventPublisher.endpoint` is the one bound, a wildcard host
  given as this node's address (``tcp://*:0`` publishes ``tcp://10.0.0.5:41873``), so
  ``GET /kv_event_sources`` tells subscribers where to dial, as vLLM 0.33 does.
- ROUTER socket at ``replay_endpoint`` (optional): a request ``[identity, b"",
  start_seq (8 B BE)]`` is answered with one ``[identity, b"", topic, seq, payload]``
  per buffered batch from ``start_seq`` on (the last ``buffer_steps`` batches), then the
  end marker ``[identity, b"", b"", seq -1, b""]``, as vLLM 0.32's ``_service_replay``
  sends them. A DEALER that sends ``[b"", start_seq]`` receives ``[b"", topic, seq,
  payload]`` frames: the live socket's three after the delimiter. The start sequence -2 asks for a
  snapshot instead: every cached block as ``BlockStored`` in chain order, in one message
  whose seq is the last batch it includes (engine/events/exporters/kv_snapshot.py).

The engine thread only folds and appends to a queue of at most ``max_queue_size``
batches; encoding, sending and replay run on the publisher's own thread, so no
subscriber (slow, absent or stuck) ever blocks a step. The thread sleeps in a poll on
a wake pipe and the replay socket: a batch queued while it sleeps writes one byte to
the pipe (about a microsecond on the engine thread), and an idle engine costs nothing
(a thread woken every 10 ms had cost the real engine's 2-thread decode 1.1 % of its
time, each wake taking a core from torch's pool). After a round that sent something
the thread sleeps :data:`POLL_S` and looks again, going idle only when a round finds
nothing: the step batches queued meanwhile go out as one message (their events
in order, the last one's ``ts``; at most :data:`MERGE_LIMIT`), because on a fast step
loop a ZMQ send and a thread wake per batch cost more than the fold and the encoding
together, and a subscriber reads the same events either way. A batch that
finds the queue full is dropped and counted: ``kvscope:kv_events_dropped_total``
(and ``kvscope:kv_events_published_total`` for those sent) on ``/metrics`` when the
server's registry is given. Like vLLM, sequence numbers count batches sent, so a
drop leaves no gap; beyond ``hwm`` queued messages ZMQ itself drops for a slow
subscriber (uncounted, as in vLLM; the replay socket serves what it missed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq
from prometheus_client import CollectorRegistry, Counter

from engine.config import KVEventsConfig
from engine.errors import UserError
from engine.events import Event
from engine.events.exporters.kv_events import EventBatch, KVEventFold
from engine.events.exporters.kv_events_config import FLAG, binds
from engine.events.exporters.kv_snapshot import SNAPSHOT_REQUEST, CachedBlockMirror
from engine.logs import get_logger

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
POLL_S = 0.01  # a busy publisher thread's sleep between rounds: the most a batch waits to be sent
IDLE_POLL_MS = 1000  # an idle thread's poll timeout: a safety net, every wake-up is signalled
MERGE_LIMIT = 64  # step batches sent as one message at most
SHUTDOWN_S = 2.0  # close() waits this long for queued batches to go out


class ZmqEventPublisher:
    """PUB (+ optional ROUTER replay) sockets and the thread that feeds them; see the module docstring."""

    def __init__(self, config: KVEventsConfig, on_sent: Callable[[int], None] | None = None) -> None:
        """``on_sent(n)``: called on the thread after a message of ``n`` step batches went out."""
        # one producer (the engine thread appends) and one consumer (this thread pops): a
        # deque's append and popleft are atomic, so neither side takes a lock
        self._pending: deque[EventBatch] = deque()
        self._max_pending = config.max_queue_size
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._mirror = CachedBlockMirror()  # what the batches sent so far leave cached (snapshots)
        self._rank: int | None = None
        self.topic = config.topic
        self._topic = config.topic.encode("utf-8")
        self._on_sent = on_sent
        self._stopping = False
        # the thread says it is about to sleep; the engine thread then wakes it through the pipe
        self._idle = False
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)  # a full pipe already means "wake up"
        self.sent = 0  # messages sent, which is the next sequence number
        self.batches_sent = 0  # step batches in them
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(config.hwm)
            self.endpoint = self._open(self._pub, config.endpoint, "endpoint")
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._open(self._replay, config.replay_endpoint, "replay_endpoint", bind=True)
        except BaseException:
            self._close_sockets()
            raise
        # Sockets made here are used only by the thread from now on (ZMQ allows a socket to
        # move between threads with a memory barrier, which Thread.start is).
        self._thread = threading.Thread(target=self._run, name="kvscope-kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(socket: zmq.Socket, address: str, name: str, bind: bool | None = None) -> str:
        """Bind or connect ``socket``; the address a subscriber dials: as bound (the port the
        OS picked for ``:0`` or ``:*``, a wildcard host as this node's address), or as given."""
        try:
            if bind if bind is not None else binds(address):
                socket.bind(address)
                return dialable(socket.getsockopt_string(zmq.LAST_ENDPOINT))
            socket.connect(address)
            return address
        except zmq.ZMQError as exc:
            raise UserError(f"{FLAG}: {name} {address!r}: {exc} (give a free port, or tcp://*:0 for any)") from None

    def publish(self, batch: EventBatch) -> bool:
        """Queue ``batch`` for the thread; False (nothing waits) when the queue is full."""
        if len(self._pending) >= self._max_pending:
            return False
        self._pending.append(batch)
        if self._idle:  # checked after the append; the thread sets it before its last look at the queue
            self._idle = False
            self._wake()
        return True

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed
            os.write(self._wake_write, b"\0")

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        pending = self._pending
        poller = zmq.Poller()
        poller.register(self._wake_read, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if pending:
                # Let the PUB socket take in subscriptions that arrived while it was quiet:
                # ZMQ reads them only when the socket is used, so the first message after a
                # quiet spell could otherwise miss a subscriber that joined during it.
                self._pub.getsockopt(zmq.EVENTS)
                while pending:
                    batch, merged = self._take(pending)
                    self._send(batch, encode(batch), merged)
                if self._replay is not None and self._replay.poll(0):  # a busy loop still answers replays
                    self._serve_replay()
                # Stay awake one round: a fast loop's next batches gather into one message
                # meanwhile, with no wake-up signalled; a round that finds nothing goes idle.
                time.sleep(POLL_S)
                continue
            if self._stopping:
                return
            self._idle = True
            if pending or self._stopping:  # queued between the look above and the flag
                self._idle = False
                continue
            ready = dict(poller.poll(IDLE_POLL_MS))
            self._idle = False
            if self._wake_read in ready:
                os.read(self._wake_read, 4096)
            if self._replay is not None and self._replay in ready:
                self._serve_replay()

    @staticmethod
    def _take(pending: deque[EventBatch]) -> tuple[EventBatch, int]:
        """The next message: the oldest queued batch, with those queued after it merged in."""
        first = pending.popleft()
        if not pending:
            return first, 1
        events = list(first.events)
        last, merged = first, 1
        while pending and merged < MERGE_LIMIT:
            last = pending.popleft()
            events.extend(last.events)
            merged += 1
        return EventBatch(ts=last.ts, events=events, data_parallel_rank=first.data_parallel_rank), merged

    def _send(self, batch: EventBatch, payload: bytes, merged: int) -> None:
        self._mirror.apply(batch)
        self._rank = batch.data_parallel_rank
        seq = self.sent
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
        self._buffer.append((seq, payload))
        self.sent = seq + 1
        self.batches_sent += merged
        if self._on_sent is not None:
            self._on_sent(merged)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            get_logger("kvscope.kv_events").warning(
                f"KV events replay: ignored a request of {len(frames)} frames; expected [identity, b'', start_seq "
                f"as 8 bytes big-endian]")
            return
        identity, _, start = frames
        send = self._replay.send_multipart
        if start == SNAPSHOT_REQUEST:  # the whole cache as of the last batch sent (engine/events/exporters/kv_snapshot.py)
            snapshot = msgspec.msgpack.encode(self._mirror.snapshot(self._rank))
            send((identity, b"", self._topic, (self.sent - 1).to_bytes(8, "big", signed=True), snapshot))
            send((identity, b"", b"", END_SEQ, b""))
            return
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                send((identity, b"", self._topic, seq.to_bytes(8, "big"), payload))
        send((identity, b"", b"", END_SEQ, b""))

    def wait_sent(self, count: int, timeout: float = 5.0) -> bool:
        """Wait until ``count`` step batches have gone out (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout
        while self.batches_sent < count:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.001)
        return True

    def close(self) -> None:
        """Send what is queued (at most :data:`SHUTDOWN_S`), stop the thread, close the sockets."""
        self._stopping = True  # the thread sends what is queued, then returns
        self._wake()
        self._thread.join(SHUTDOWN_S)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for zmq_socket in (self._pub, self._replay):
            if zmq_socket is not None:
                zmq_socket.close(linger=0)
        wake_fds, self._wake_read, self._wake_write = (self._wake_read, self._wake_write), -1, -1
        for fd in wake_fds:
            if fd >= 0:  # a second close() must not close a number the process has reused
                os.close(fd)


WILDCARD_HOSTS = ("0.0.0.0", "[::]", "*", "::")


def node_ip() -> str:
    """This node's address for others to dial, as vLLM's ``get_ip``: ``$VLLM_HOST_IP``, else
    the address of the interface that routes outwards (a UDP connect sends nothing), else
    loopback."""
    given = os.environ.get("VLLM_HOST_IP") or os.environ.get("KVSCOPE_HOST_IP")
    if given:
        return given
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("8.8.8.8", 80))
        return str(probe.getsockname()[0])
    return "127.0.0.1"


def dialable(bound: str) -> str:
    """A bound ``tcp://0.0.0.0:P`` (a wildcard bind listens on every interface) as
    ``tcp://<this node>:P``, which a subscriber on another host can dial too; any other
    address as it is (vLLM 0.33 publishes the node's address for ``tcp://*:0`` alike)."""
    if not bound.startswith("tcp://"):
        return bound
    host, _, port = bound[len("tcp://"):].rpartition(":")
    if host not in WILDCARD_HOSTS:
        return bound
    ip = node_ip()
    return f"tcp://{f'[{ip}]' if ':' in ip else ip}:{port}"


def expand_topic(topic: str, model_name: str) -> str:
    """``{pod}`` and ``{model}`` in a topic become this pod's name and the served model, so
    ``"kv@{pod}@{model}"`` is llm-d's convention (its indexer reads the pod and the model
    from the topic). The pod: ``$POD_IP``, ``$POD_NAME`` (Kubernetes' downward API), or
    the host name."""
    if "{pod}" not in topic and "{model}" not in topic:
        return topic
    pod = os.environ.get("POD_IP") or os.environ.get("POD_NAME") or socket.gethostname()
    return topic.replace("{pod}", pod).replace("{model}", model_name)


class KVEventsSink:
    """Bus subscriber: folds each event (:class:`KVEventFold`) and hands the step's batch
    to the publisher thread; counts what the full queue refused."""

    def __init__(self, config: KVEventsConfig, *, registry: CollectorRegistry | None = None,
                 model_name: str = "", data_parallel_rank: int = 0,
                 clock: Callable[[], float] = time.time) -> None:
        self.fold = KVEventFold(data_parallel_rank, clock)
        self.registry = registry or CollectorRegistry()
        labels = {"model_name": model_name, "engine": str(data_parallel_rank)}
        self._dropped = Counter("kvscope:kv_events_dropped", "KV cache event batches dropped because the "
                                "publisher's queue (max_queue_size) was full", list(labels),
                                registry=self.registry).labels(**labels)
        self._published = Counter("kvscope:kv_events_published", "KV cache event batches (one per step that "
                                  "changed the prefix cache) sent on the ZMQ PUB socket", list(labels),
                                  registry=self.registry).labels(**labels)
        self.dropped = 0
        self.batches = 0  # batches the fold made: sent + dropped + still queued
        config = dataclasses.replace(config, topic=expand_topic(config.topic, model_name))
        self.publisher = ZmqEventPublisher(config, on_sent=self._published.inc)
        # vLLM's /kv_event_sources entry: the config in force, its endpoints as bound
        self.resolved = dataclasses.replace(config, endpoint=self.publisher.endpoint,
                                            replay_endpoint=self.publisher.replay_endpoint)
        log = get_logger("kvscope.kv_events")
        replay = f", replay on {self.publisher.replay_endpoint}" if self.publisher.replay_endpoint else ""
        log.info(f"KV cache events: publishing on {self.publisher.endpoint} (topic {config.topic!r}){replay}")

    def __call__(self, event: Event) -> None:
        batch = self.fold.apply(event)
        if batch is None:
            return
        self.batches += 1
        if not self.publisher.publish(batch):
            self.dropped += 1
            self._dropped.inc()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every batch the queue took has been sent."""
        return self.publisher.wait_sent(self.batches - self.dropped, timeout)

    def close(self) -> None:
        self.publisher.close()
