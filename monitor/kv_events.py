"""vLLM's KV-cache events, read from the wire: the subscriber and the fold of cached prefixes.

The protocol (vLLM's ``KVEventsConfig`` publisher, issue 18 part 1; kvscope's own
publisher speaks the same): a ZMQ PUB socket sends three frames per message (topic,
an 8-byte big-endian sequence number, a msgpack payload); the payload is an
``EventBatch`` encoded positionally, ``[ts, events, data_parallel_rank]``; each event
is a map tagged ``"type"`` (``BlockStored`` {block_hashes, parent_block_hash,
token_ids, block_size, medium, ...}, ``BlockRemoved`` {block_hashes, medium},
``AllBlocksCleared`` {}), or, in older vLLM, an array with the tag first and the
fields in that order. An optional ROUTER replay socket answers
``[b"", start_seq (8 B BE)]`` with every buffered ``[b"", topic, seq, payload]`` from
``start_seq`` and then ``seq = -1`` with an empty payload (vLLM 0.32 and kvscope;
older vLLM and SGLang leave the topic out: ``[b"", seq, payload]``, read too).

Events carry block *hashes*, not physical block ids, so what they describe is the set
of cached prefixes (a forest: each stored block names its parent's hash), not a block
map. :class:`PrefixCache` folds them; :class:`KvEventSubscriber` reads them on a thread
and hands each batch on as a :class:`~engine.events.KvEventBatch`.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from engine.errors import UserError
from engine.events import KvEventBatch
from engine.events.exporters.kv_events_config import binds

END_OF_REPLAY = -1
# Batches ZMQ holds for us while the drawing has the GIL (vLLM's publisher hwm default); past it
# the publisher drops and the seq gap shows it.
RECEIVE_HWM = 100_000
# vLLM's positional field order for the array encoding (before events became maps).
POSITIONAL_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
KEPT_FIELDS = ("block_hashes", "parent_block_hash", "block_size", "medium", "group_idx")
BlockHash = int | str


WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


def check_endpoint(endpoint: str) -> str:
    """A ZMQ address (``tcp://HOST:PORT``, ``ipc://``, ``inproc://``), refused early otherwise."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise UserError(f"{endpoint!r} is not a ZMQ endpoint; pass --kv-events tcp://HOST:5557")
    return endpoint


def subscriber_side(endpoint: str, server_host: str) -> tuple[str, bool]:
    """Where a subscriber meets a publisher configured at ``endpoint`` (as vLLM's
    ``--kv-events-config`` names it, or as ``GET /kv_event_sources`` reports it), and
    whether it binds there: vLLM's rule in mirror. A publisher that binds (a wildcard
    host, ipc, inproc) is connected to, at ``server_host`` for a wildcard; one that
    connects (any other host) is waited for: the subscriber binds that address."""
    check_endpoint(endpoint)
    if not endpoint.startswith("tcp://"):
        return endpoint, False
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not port:
        raise UserError(f"{endpoint!r}: give a port, e.g. tcp://127.0.0.1:5557")
    if host in WILDCARD_HOSTS or binds(endpoint):
        return f"tcp://{server_host}:{port}", False
    return endpoint, True


def sources_listed(body: Any) -> list[dict[str, Any]]:
    """``GET /kv_event_sources``'s answer, by DP rank, as rows with ``data_parallel_rank``:
    vLLM 0.33's map of each rank (a string key) to its ``KVEventsConfig`` as resolved,
    vLLM 0.32's array of ``{data_parallel_rank, endpoint, replay_endpoint, topic}``, or
    ``{"sources": [...]}``."""
    if isinstance(body, dict) and "sources" not in body and all(str(k).isdigit() for k in body):
        rows: Any = [{**config, "data_parallel_rank": int(rank)} if isinstance(config, dict) else config
                     for rank, config in body.items()]
    else:
        rows = body.get("sources") if isinstance(body, dict) else body
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("endpoint"), str)
                                             for r in rows):
        raise UserError("GET /kv_event_sources answered something other than a map of DP rank to KVEventsConfig "
                        "or a list of {endpoint, replay_endpoint, topic, data_parallel_rank}; pass --kv-events "
                        "ENDPOINT")
    return sorted(rows, key=lambda r: r.get("data_parallel_rank") or 0)


def discovered_side(endpoint: str, server_host: str) -> tuple[str, bool]:
    """:func:`subscriber_side` for an endpoint a server reported as in use: a TCP address
    with a host of its own is either one the publisher bound (vLLM 0.33 reports
    ``tcp://*:0`` as the node's address and the port it got) or one it connects to (this
    side binds it); a probe bind tells them apart: taken (or not this host's) is bound there."""
    address, bind = subscriber_side(endpoint, server_host)
    if not bind:
        return address, False
    host, _, port = address[len("tcp://"):].rpartition(":")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host.strip("[]"), int(port)))
        except (OSError, ValueError):
            return address, False
    return address, True


def replay_side(endpoint: str, server_host: str) -> str:
    """The replay ROUTER always binds (vLLM too): connect to it, at ``server_host`` for a wildcard."""
    address, _ = subscriber_side(endpoint, server_host)
    return address if endpoint.startswith("tcp://") else endpoint


def _hash(value: Any) -> BlockHash | None:
    """A block hash as JSON can carry it: ints stay ints, bytes become hex."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    return int(value) if isinstance(value, int) else str(value)


def normalise_event(raw: Any) -> dict[str, Any] | None:
    """One wire event (map or tagged array) -> a JSON-able dict with ``type`` and the
    fields the fold reads (token ids are dropped: only their count matters here)."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        fields = dict(zip(POSITIONAL_FIELDS.get(raw[0], ()), raw[1:], strict=False))
    else:
        return None
    if kind not in POSITIONAL_FIELDS:
        return None
    out: dict[str, Any] = {"type": kind}
    for name in KEPT_FIELDS:
        if name not in fields:
            continue
        value = fields[name]
        if name == "block_hashes":
            out[name] = [_hash(h) for h in value or ()]
        elif name == "parent_block_hash":
            out[name] = _hash(value)
        elif isinstance(value, bytes):
            out[name] = value.decode(errors="replace")
        else:
            out[name] = value
    if kind == "BlockStored":
        out["num_tokens"] = len(fields.get("token_ids") or ())
    return out


# The map encoding, decoded by msgspec in C (2.5x the generic decode plus normalise_event);
# anything else (the older tagged arrays, an event type this monitor does not know) takes
# the generic path.
WireHash = int | bytes


class _Stored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    medium: str | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[WireHash]
    medium: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_BATCH_DECODER = msgspec.msgpack.Decoder(_Batch)


def _hashes(values: list[WireHash]) -> list[BlockHash]:
    """Int hashes as they are (the common case, no copy); bytes as hex."""
    if not values or isinstance(values[0], int):
        return values  # type: ignore[return-value]  # every element is an int: one encoder wrote them all
    return [h.hex() if isinstance(h, bytes) else h for h in values]


def _from_struct(event: _Stored | _Removed | _Cleared) -> dict[str, Any]:
    if isinstance(event, _Stored):
        return {"type": "BlockStored", "block_hashes": _hashes(event.block_hashes),
                "parent_block_hash": _hash(event.parent_block_hash), "block_size": event.block_size,
                "medium": event.medium or "GPU", "num_tokens": len(event.token_ids)}
    if isinstance(event, _Removed):
        return {"type": "BlockRemoved", "block_hashes": _hashes(event.block_hashes), "medium": event.medium or "GPU"}
    return {"type": "AllBlocksCleared"}


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """An ``EventBatch`` payload -> (ts, normalised events, data_parallel_rank).
    Raises ``ValueError`` on a payload that is not one."""
    try:
        typed = _BATCH_DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    else:
        return typed.ts, [_from_struct(e) for e in typed.events], typed.data_parallel_rank
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a msgpack EventBatch: {exc}") from exc
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list | tuple):
        raise ValueError("an EventBatch is [ts, events, data_parallel_rank]")
    rank = batch[2] if len(batch) > 2 and isinstance(batch[2], int) else None
    events = [e for e in (normalise_event(raw) for raw in batch[1]) if e is not None]
    return float(batch[0]), events, rank


# ------------------------------------------------------------------------ the fold
@dataclass(slots=True)
class CachedBlock:
    parent: BlockHash | None
    root: BlockHash  # the first block of its prefix chain (itself for a root)
    depth: int  # blocks from the root, 1-based
    stored_t: float
    medium: str


@dataclass(slots=True)
class PrefixSummary:
    """One cached prefix tree: its root, how many blocks it holds, its deepest chain
    and how many chains branch off it."""

    root: BlockHash
    blocks: int
    depth: int
    leaves: int


@dataclass
class PrefixCache:
    """The set of cached blocks vLLM reported, by hash chain."""

    residency_window: int = 4096
    blocks: dict[BlockHash, CachedBlock] = field(default_factory=dict)
    children: dict[BlockHash, int] = field(default_factory=dict)  # hash -> cached children
    stored_total: int = 0
    removed_total: int = 0
    cleared_total: int = 0
    unknown_removed: int = 0  # BlockRemoved for a hash never stored (missed events)
    block_size: int = 0
    residency_s: deque[float] = field(default_factory=deque)  # store -> remove, recent blocks

    def __post_init__(self) -> None:
        self.residency_s = deque(self.residency_s, maxlen=self.residency_window)

    def apply(self, events: Iterable[dict[str, Any]], t: float) -> None:
        for event in events:
            kind = event.get("type")
            if kind == "BlockStored":
                self._stored(event, t)
            elif kind == "BlockRemoved":
                for h in event.get("block_hashes", ()):
                    self._removed(h, t)
            elif kind == "AllBlocksCleared":
                self.cleared_total += 1
                self.blocks.clear()
                self.children.clear()

    def _stored(self, event: dict[str, Any], t: float) -> None:
        parent = event.get("parent_block_hash")
        medium = str(event.get("medium") or "GPU")
        if event.get("block_size"):
            self.block_size = int(event["block_size"])
        for h in event.get("block_hashes", ()):
            above = self.blocks.get(parent) if parent is not None else None
            root, depth = (above.root, above.depth + 1) if above is not None else (h, 1)
            if h not in self.blocks:
                if parent is not None and above is not None:
                    self.children[parent] = self.children.get(parent, 0) + 1
                self.stored_total += 1
            self.blocks[h] = CachedBlock(parent=parent, root=root, depth=depth, stored_t=t, medium=medium)
            parent = h

    def _removed(self, h: BlockHash, t: float) -> None:
        block = self.blocks.pop(h, None)
        if block is None:
            self.unknown_removed += 1
            return
        self.removed_total += 1
        self.residency_s.append(max(0.0, t - block.stored_t))
        if block.parent is not None and block.parent in self.children:
            self.children[block.parent] -= 1
            if self.children[block.parent] <= 0:
                del self.children[block.parent]
        self.children.pop(h, None)

    # ------------------------------------------------------------------- reading
    def by_medium(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for block in self.blocks.values():
            out[block.medium] = out.get(block.medium, 0) + 1
        return out

    def prefixes(self) -> list[PrefixSummary]:
        """Cached prefix trees, largest first."""
        trees: dict[BlockHash, PrefixSummary] = {}
        for h, block in self.blocks.items():
            tree = trees.get(block.root)
            if tree is None:
                tree = trees[block.root] = PrefixSummary(root=block.root, blocks=0, depth=0, leaves=0)
            tree.blocks += 1
            tree.depth = max(tree.depth, block.depth)
            if h not in self.children:
                tree.leaves += 1
        return sorted(trees.values(), key=lambda s: (-s.blocks, -s.depth, str(s.root)))

    def residency_quantile(self, q: float) -> float | None:
        if not self.residency_s:
            return None
        ordered = sorted(self.residency_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def copy(self) -> PrefixCache:
        """An independent copy (replay checkpoints)."""
        clone = PrefixCache(residency_window=self.residency_window)
        clone.blocks = {h: CachedBlock(b.parent, b.root, b.depth, b.stored_t, b.medium) for h, b in self.blocks.items()}
        clone.children = dict(self.children)
        clone.stored_total, clone.removed_total = self.stored_total, self.removed_total
        clone.cleared_total, clone.unknown_removed = self.cleared_total, self.unknown_removed
        clone.block_size = self.block_size
        clone.residency_s = deque(self.residency_s, maxlen=self.residency_window)
        return clone


# ------------------------------------------------------------------ the subscriber
class KvEventSubscriber:
    """A ZMQ SUB on ``endpoint`` read on its own thread; each batch becomes a
    :class:`~engine.events.KvEventBatch` handed to ``deliver``. With ``replay``
    (the ROUTER endpoint), a gap in sequence numbers is filled by asking for the
    missed batches from the first one missing; without it, ``missed`` counts them."""

    def __init__(self, endpoint: str, deliver: Callable[[KvEventBatch], None], *, replay: str | None = None,
                 topic: str = "", source: str = "", replay_timeout_s: float = 2.0, bind: bool = False) -> None:
        """``bind``: the publisher connects to ``endpoint`` (vLLM's rule for a non-wildcard
        address), so the SUB binds it; when the address is taken or not this machine's
        (the publisher bound it after all), the SUB connects instead (``mode`` says which)."""
        self.endpoint = check_endpoint(endpoint)
        self.bind = bind
        self.mode = "binding" if bind else "connecting"
        self.replay = check_endpoint(replay) if replay else None
        self.topic = topic
        self.source = source or endpoint
        self.deliver = deliver
        self.replay_timeout_s = replay_timeout_s
        self.last_seq: int | None = None
        self.received = 0
        self.replayed = 0
        self.missed = 0
        self.bad = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="monitor-kv-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _batch(self, seq: int, payload: bytes) -> None:
        try:
            ts, events, rank = decode_batch(payload)
        except ValueError:
            self.bad += 1
            return
        self.last_seq = seq
        self.deliver(KvEventBatch(source=self.source, batch_seq=seq, ts=ts, events=events,
                                  data_parallel_rank=rank, t=time.time()))

    def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._attach(sub)
        if self.replay is not None:
            # Joining a running server: what is cached now was stored before we subscribed.
            self._fill_gap(0, None, count_missed=False)
        try:
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.bad += 1
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if self.last_seq is None and self.replay is not None and seq > 0:
                    self._fill_gap(0, seq, count_missed=False)  # published before our subscription took
                elif self.last_seq is not None and seq > self.last_seq + 1:
                    self._fill_gap(self.last_seq + 1, seq)
                if self.last_seq is not None and seq <= self.last_seq:
                    continue  # already delivered by a replay
                self.received += 1
                self._batch(seq, frames[2])
        finally:
            sub.close()

    def _attach(self, sub: zmq.Socket) -> None:
        if self.bind:
            try:
                sub.bind(self.endpoint)
                self.mode = "bound"
                return
            except zmq.ZMQError as exc:
                if exc.errno not in (zmq.EADDRINUSE, zmq.EADDRNOTAVAIL):
                    raise
        sub.connect(self.endpoint)
        self.mode = "connected"

    def _fill_gap(self, first: int, upto: int | None, count_missed: bool = True) -> None:
        """Ask the replay socket for batches ``first`` .. ``upto - 1`` (all it has: None)."""
        if self.replay is None:
            self.missed += (upto or first) - first
            return
        got = 0
        for seq, payload in self.request_replay(first):
            if upto is not None and seq >= upto:
                continue  # the live socket delivers it
            if self.last_seq is None or seq > self.last_seq:
                self._batch(seq, payload)
                got += 1
        self.replayed += got
        if count_missed and upto is not None:
            self.missed += max(0, (upto - first) - got)

    def request_replay(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Every buffered (seq, payload) from ``start_seq``, as the ROUTER sends them
        (an empty list when it does not answer within ``replay_timeout_s``)."""
        assert self.replay is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.send_multipart([b"", start_seq.to_bytes(8, "big", signed=True)])
            deadline = time.monotonic() + self.replay_timeout_s
            while (left := deadline - time.monotonic()) > 0 and dealer.poll(int(left * 1000)):
                frames = dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:  # [topic, seq, payload]; [seq, payload] before the topic was added
                    frames = frames[1:]
                if len(frames) != 2 or len(frames[0]) != 8:
                    self.bad += 1
                    continue
                seq = int.from_bytes(frames[0], "big", signed=True)
                if seq == END_OF_REPLAY:
                    break
                out.append((seq, frames[1]))
        finally:
            dealer.close()
        return out
