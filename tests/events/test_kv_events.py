"""KV cache events, wire-compatible with vLLM (engine/events/exporters/kv_events*.py, kv_publisher.py).

The subscriber here is written from the protocol, not from kvscope's classes: a plain
ZMQ SUB socket, frames [topic, 8-byte big-endian seq, msgpack payload], payloads decoded
by msgspec into lists and dicts; replay through a DEALER socket. The events come from a
model-free driver run with shared prefixes under memory pressure (evictions, preemptions)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from zmq.utils.monitor import recv_monitor_message

from engine.cli.main import main
from engine.config import EngineConfig, KVEventsConfig
from engine.core.block_pool import BlockPool
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.errors import UserError
from engine.events import Event, EventBus, StepEvent, dumps, event_from_dict, read_events
from engine.events.exporters.kv_events import KVEventFold
from engine.events.exporters.kv_events_config import parse_kv_events_config
from engine.events.exporters.kv_publisher import KVEventsSink, dialable, expand_topic, node_ip
from engine.sim.driver import DriverRequest, run_driver

TOPIC = "kv-events"
BLOCK_SIZE = 16
STORED_FIELDS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
REMOVED_FIELDS = {"type", "block_hashes", "medium", "group_idx"}
SHARED_PREFIX = list(range(100, 164))  # 4 full blocks every request starts with


def _workload() -> list[DriverRequest]:
    return [DriverRequest(f"r{i:02d}", SHARED_PREFIX + [1000 + i] * (10 + 7 * (i % 5)),
                          output_tokens=40 + 9 * (i % 4), arrival_step=i) for i in range(24)]


def _run(record_contents: bool) -> tuple[list[Event], Scheduler]:
    config = SchedulerConfig(num_blocks=36, block_size=BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=96,
                             enable_kv_cache_events=record_contents)
    bus = EventBus()
    events: list[Event] = []
    bus.subscribe(events.append)
    scheduler = Scheduler(config, bus)
    run_driver(_workload(), config, scheduler=scheduler, step_time_s=0.01)
    return events, scheduler


@pytest.fixture(scope="module")
def recorded() -> tuple[list[Event], Scheduler]:
    return _run(record_contents=True)


def _config(**fields: Any) -> KVEventsConfig:
    return parse_kv_events_config(json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                                              "topic": TOPIC, **fields}))


def _feed(sink: KVEventsSink, events: list[Event]) -> None:
    for event in events:
        sink(event)


def _subscriber(endpoint: str) -> zmq.Socket:
    """A SUB socket connected to ``endpoint`` once its handshake is done (so what is
    published next reaches it)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(endpoint)
    assert monitor.poll(5000), "the subscriber never connected"
    recv_monitor_message(monitor)
    sub.disable_monitor()
    monitor.close(linger=0)
    time.sleep(0.05)  # the subscription message follows the handshake
    return sub


def _receive(sub: zmq.Socket, count: int) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    while len(out) < count and sub.poll(2000):
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode() and len(seq) == 8
        out.append((int.from_bytes(seq, "big"), payload))
    return out


def _replay(endpoint: str, start_seq: int) -> list[tuple[int, bytes]]:
    """Ask the ROUTER for everything from ``start_seq``, framed byte for byte as vLLM 0.32's
    ZmqEventPublisher answers; the answer ends with seq -1 and b""."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start_seq.to_bytes(8, "big", signed=True)])
    out: list[tuple[int, bytes]] = []
    try:
        while True:
            assert dealer.poll(5000), "no end marker from the replay socket"
            # vLLM 0.32's _service_replay: (identity, b"", topic, seq, payload), the end marker
            # (identity, b"", b"", -1, b""); the DEALER sees them without the identity
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b"" and len(seq) == 8
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                assert topic == b"" and payload == b""
                return out
            assert topic == TOPIC.encode()
            out.append((number, payload))
    finally:
        dealer.close(linger=0)


class CacheMirror:
    """What a KV-cache indexer keeps: the hashes present, and every hash ever stored."""

    def __init__(self) -> None:
        self.present: set[int] = set()
        self.ever_stored: set[int] = set()
        self.stored_events = 0
        self.removed_events = 0
        self.chained_stores = 0

    def apply(self, payload: bytes) -> None:
        ts, events, rank = msgspec.msgpack.decode(payload)  # positional EventBatch
        assert isinstance(ts, float) and ts > 1.7e9 and rank == 0
        for event in events:
            assert isinstance(event, dict), "each event is a msgpack map"
            if event["type"] == "BlockStored":
                assert set(event) == STORED_FIELDS
                hashes = event["block_hashes"]
                assert event["block_size"] == BLOCK_SIZE and len(event["token_ids"]) == BLOCK_SIZE * len(hashes)
                assert event["medium"] == "GPU" and event["group_idx"] == 0 and event["extra_keys"] == [None] * len(hashes)
                assert event["kv_cache_spec_kind"] == "full_attention"
                parent = event["parent_block_hash"]
                assert parent is None or parent in self.ever_stored, "a parent hash that was never stored"
                self.chained_stores += parent is not None
                for h in hashes:
                    assert 0 <= h < 2**64
                    assert h not in self.present, "a hash stored twice without a removal between"
                    self.present.add(h)
                    self.ever_stored.add(h)
                self.stored_events += 1
            elif event["type"] == "BlockRemoved":
                assert set(event) == REMOVED_FIELDS
                for h in event["block_hashes"]:
                    assert h in self.present, "a removed hash that was not stored"
                    self.present.discard(h)
                self.removed_events += 1
            else:
                raise AssertionError(f"unexpected event type {event['type']!r}")


def test_step_events_carry_block_contents_only_when_asked(recorded: tuple[list[Event], Scheduler]) -> None:
    with_contents, _ = recorded
    without, _ = _run(record_contents=False)
    steps_on = [e for e in with_contents if isinstance(e, StepEvent)]
    steps_off = [e for e in without if isinstance(e, StepEvent)]
    # off: the recording is what it always was (no new keys); on: the same decisions plus the contents
    assert all("cached_runs" not in e.to_dict() and "evicted_hashes" not in e.to_dict() for e in steps_off)
    def decisions(event: StepEvent, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
        return {k: v for k, v in event.to_dict().items() if k not in ("t", *leave_out)}  # t: the wall clock

    assert [decisions(e, ("cached_runs", "evicted_hashes")) for e in steps_on] == [decisions(e) for e in steps_off]
    assert sum(len(e.evicted) for e in steps_on) > 0 and sum(len(e.preempted) for e in steps_on) > 0
    for event in steps_on:
        assert [b for run in event.cached_runs for b in run["block_ids"]] == event.cached
        assert all(len(run["token_ids"]) == BLOCK_SIZE * len(run["hashes"]) == BLOCK_SIZE * len(run["block_ids"])
                   for run in event.cached_runs)
        assert len(event.evicted_hashes) == len(event.evicted)
        again = event_from_dict(json.loads(dumps(event.to_dict())))
        assert again == event  # the JSONL form reads back whole
    (first_run,) = steps_on[0].cached_runs  # r00's four full prompt blocks
    assert first_run["parent_hash"] is None and first_run["token_ids"] == SHARED_PREFIX
    later = [run for e in steps_on[1:] for run in e.cached_runs]
    assert any(run["parent_hash"] == first_run["hashes"][-1] for run in later), "r01 chains onto the shared prefix"


def test_a_protocol_subscriber_mirrors_the_cache_and_replay_fills_what_it_missed(
    recorded: tuple[list[Event], Scheduler],
) -> None:
    events, scheduler = recorded
    sink = KVEventsSink(_config(replay_endpoint="tcp://127.0.0.1:*"), model_name="m")
    try:
        third = len(events) // 3
        _feed(sink, events[:third])  # nobody listens yet: these are missed
        assert sink.flush()
        missed_count = sink.publisher.sent  # messages (step batches queued together share one)
        sub = _subscriber(sink.publisher.endpoint)
        _feed(sink, events[third:])
        assert sink.flush() and sink.dropped == 0
        messages = sink.publisher.sent
        live = _receive(sub, messages - missed_count)
        sub.close(linger=0)
        assert [seq for seq, _ in live] == list(range(missed_count, messages)), "live seqs continue the missed ones"

        replay_endpoint = sink.publisher.replay_endpoint
        assert replay_endpoint is not None
        missed = _replay(replay_endpoint, 0)[:missed_count]
        assert [seq for seq, _ in missed] == list(range(missed_count))
        whole = _replay(replay_endpoint, 0)
        assert whole == missed + live  # replayed payloads are the live bytes
        assert _replay(replay_endpoint, missed_count + 5) == live[5:]
        assert _replay(replay_endpoint, messages) == []  # nothing newer: only the end marker
        # a cold-started router asks for the whole cache instead (start seq -2): one message
        # as of the last batch sent, every cached block a BlockStored, parents first
        snapshot = _replay(replay_endpoint, -2)
    finally:
        sink.close()
    assert [seq for seq, _ in snapshot] == [messages - 1]
    cold = CacheMirror()
    cold.apply(snapshot[0][1])
    assert cold.removed_events == 0 and cold.stored_events == len(cold.present)  # one block per event
    assert cold.present == {h & (2**64 - 1) for h in scheduler.kv.pool.cached_block_map}

    mirror = CacheMirror()
    for _, payload in whole:
        mirror.apply(payload)
    assert mirror.stored_events > 0 and mirror.removed_events > 0 and mirror.chained_stores > 0
    # the mirror holds exactly what the scheduler's prefix cache holds at the end
    assert mirror.present == {h & (2**64 - 1) for h in scheduler.kv.pool.cached_block_map}


def test_a_stuck_subscriber_never_blocks_a_step_and_drops_are_counted(
    recorded: tuple[list[Event], Scheduler],
) -> None:
    events, _ = recorded
    steps = [e for e in events if isinstance(e, StepEvent) and (e.cached_runs or e.evicted_hashes)]
    sink = KVEventsSink(_config(max_queue_size=2, hwm=1), model_name="m")
    stuck = zmq.Context.instance().socket(zmq.SUB)  # connected, subscribed, never reads
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(sink.publisher.endpoint)
    try:
        flood = steps * 10
        start = time.perf_counter()
        slowest = 0.0
        for step in flood:
            t0 = time.perf_counter()
            sink(step)
            slowest = max(slowest, time.perf_counter() - t0)
        elapsed = time.perf_counter() - start
        assert sink.batches == len(flood) and sink.dropped > 0
        assert elapsed < 2.0 and slowest < 0.25, (elapsed, slowest)  # no call waits for the subscriber
        assert sink.flush(), "the publisher thread stalled"
        families = {f.name: f for f in text_string_to_metric_families(generate_latest(sink.registry).decode())}
        (dropped,) = families["kvscope:kv_events_dropped"].samples
        (published,) = families["kvscope:kv_events_published"].samples
        assert dropped.value == sink.dropped and dropped.labels == {"model_name": "m", "engine": "0"}
        assert published.value == sink.batches - sink.dropped
    finally:
        stuck.close(linger=0)
        sink.close()


def test_an_idle_publisher_is_woken_by_the_next_batch_and_answers_replays(
    recorded: tuple[list[Event], Scheduler],
) -> None:
    """An idle publisher thread sleeps in its poll (no periodic wake-ups); the next batch
    wakes it through the pipe, long before its idle timeout would, and a replay request
    that arrives while it sleeps is answered."""
    from engine.events.exporters.kv_publisher import IDLE_POLL_MS

    events, _ = recorded
    steps = [e for e in events if isinstance(e, StepEvent) and e.cached_runs]
    sink = KVEventsSink(_config(replay_endpoint="tcp://127.0.0.1:*"), model_name="m")
    try:
        sink(steps[0])
        assert sink.flush()
        time.sleep(0.2)  # idle now: without the wake, the next batch would wait for the timeout
        start = time.perf_counter()
        sink(steps[1])
        assert sink.publisher.wait_sent(2, timeout=IDLE_POLL_MS / 1000 * 0.6), "the idle thread was not woken"
        assert time.perf_counter() - start < IDLE_POLL_MS / 1000 * 0.6
        replay_endpoint = sink.publisher.replay_endpoint
        assert replay_endpoint is not None
        assert [seq for seq, _ in _replay(replay_endpoint, 0)] == [0, 1]
    finally:
        sink.close()
    assert not sink.publisher._thread.is_alive(), "close() stops a sleeping thread"


def test_kv_events_config_takes_vllm_names_and_defaults() -> None:
    default = KVEventsConfig()
    assert (default.enable_kv_cache_events, default.publisher, default.endpoint, default.replay_endpoint,
            default.buffer_steps, default.hwm, default.max_queue_size, default.topic) == (
        False, "null", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    issue = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                                   '"replay_endpoint": "tcp://*:5558", "topic": "kv-events", "buffer_steps": 10000, '
                                   '"hwm": 100000}')
    assert issue.publishes and issue.replay_endpoint == "tcp://*:5558"
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    for text, words in [("{nope", "not valid JSON"), ("[1]", "must be a JSON object"),
                        ('{"enable_kv_cache_event": true}', "unknown field 'enable_kv_cache_event'"),
                        ('{"hwm": "big"}', "hwm must be a whole number"), ('{"buffer_steps": true}', "whole number"),
                        ('{"publisher": "kafka"}', "use one of null, zmq"), ('{"buffer_steps": 0}', "positive"),
                        ('{"endpoint": "localhost:5557"}', "a ZMQ address")]:
        with pytest.raises(UserError, match=words):
            parse_kv_events_config(text)
    # the recording's config names it only when given; the scheduler reads the switch from it
    assert "kv_events_config" not in EngineConfig().to_dict()
    flags = EngineConfig(kv_events_config=issue).to_dict()
    assert flags["kv_events_config"]["topic"] == "kv-events"
    assert SchedulerConfig.from_flags(flags, num_blocks=8).enable_kv_cache_events
    assert not SchedulerConfig.from_flags(EngineConfig().to_dict(), num_blocks=8).enable_kv_cache_events


@pytest.mark.parametrize("command", ["serve", "run-workload", "generate"])
def test_a_bad_kv_events_config_stops_the_command_before_anything_loads(
    command: str, capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [command, "--kv-events-config", '{"enable_kv_cache_events": true, "topik": "x"}']
    if command == "generate":
        argv += ["--prompt", "hi"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "unknown field 'topik'" in capsys.readouterr().err


def test_an_endpoint_in_use_is_a_clear_error() -> None:
    first = KVEventsSink(_config(endpoint="tcp://*:*"))  # "*": bound, as vLLM decides
    port = first.publisher.endpoint.rsplit(":", 1)[1]
    try:
        with pytest.raises(UserError, match=f"endpoint 'tcp://\\*:{port}': .*free port"):
            KVEventsSink(_config(endpoint=f"tcp://*:{port}"))
    finally:
        first.close()


def test_port_0_binds_a_port_the_os_picks_and_the_sink_reports_it_as_dialable(
        recorded: tuple[list[Event], Scheduler], monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33's ``tcp://*:0``: each publisher binds a port of its own and reports the
    address bound, a wildcard host as this node's address (``$VLLM_HOST_IP`` first), so
    a subscriber dials what ``/kv_event_sources`` says; the resolved config keeps every
    other field as given."""
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    sinks = [KVEventsSink(_config(endpoint="tcp://*:0", replay_endpoint="tcp://*:0", hwm=77)) for _ in range(2)]
    try:
        ports = set()
        for sink in sinks:
            resolved = sink.resolved.to_dict()
            host, port = resolved["endpoint"][len("tcp://"):].rsplit(":", 1)
            assert host == "127.0.0.1" and int(port) > 0
            assert resolved["replay_endpoint"].startswith("tcp://127.0.0.1:")
            assert {k: v for k, v in resolved.items() if "endpoint" not in k} == {
                "enable_kv_cache_events": True, "publisher": "zmq", "buffer_steps": 10_000, "hwm": 77,
                "max_queue_size": 100_000, "topic": TOPIC}
            ports |= {port, resolved["replay_endpoint"].rsplit(":", 1)[1]}
        assert len(ports) == 4  # two publishers, two sockets each: four ports
        sub = _subscriber(sinks[1].resolved.endpoint)
        _feed(sinks[1], recorded[0][:40])
        assert sinks[1].flush() and _receive(sub, 1)
        sub.close(linger=0)
    finally:
        for sink in sinks:
            sink.close()
    assert dialable("tcp://0.0.0.0:5557") == "tcp://127.0.0.1:5557"
    assert dialable("tcp://10.1.2.3:5557") == "tcp://10.1.2.3:5557"  # bound to one address: that one
    assert dialable("ipc:///tmp/kv") == "ipc:///tmp/kv"
    monkeypatch.delenv("VLLM_HOST_IP")
    assert node_ip()  # the outward interface's address, or loopback on a machine with no route


def test_a_block_stored_and_evicted_within_one_step_is_reported_as_neither() -> None:
    pool = BlockPool(num_blocks=4, block_size=2, record_contents=True)
    blocks = pool.get_new_blocks(3)
    run = pool.deltas.start_run(None)
    for i, (block, block_hash) in enumerate(zip(blocks, (11, 12, 13), strict=True)):
        assert pool.cache_block(block, block_hash, run)
        run.token_ids.extend([2 * i, 2 * i + 1])
    pool.free_blocks(blocks[1:2])  # the middle block alone goes free, still cached ...
    pool.get_new_blocks(2)  # ... and the truly free block, then it, are taken: evicted again
    assert pool.deltas.evicted == [] and list(pool.deltas.cached) == [blocks[0], blocks[2]]
    pieces = [(p.block_ids, p.hashes, p.parent_hash, p.token_ids) for p in run.pieces()]
    assert pieces == [([blocks[0]], [11], None, [0, 1]), ([blocks[2]], [13], 12, [4, 5])]


def test_a_simulated_recording_carries_the_facts_and_folds_offline(tmp_path: Path) -> None:
    """``publisher: "null"`` records without publishing; the recording's step events fold
    into the same stream a subscriber would have seen (medium GPU: a simulated GPU)."""
    out = tmp_path / "sim.jsonl"
    assert main(["simulate", "--model", "llama-3.1-8b", "--num-gpu-blocks-override", "64", "--max-model-len", "2048",
                 "--num-prompts", "12", "--random-input-len", "100:400", "--random-output-len", "20:60",
                 "--shared-prefix-fraction", "0.5", "--shared-prefix-len", "64", "--events", str(out),
                 "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null"}']) == 0
    recording = read_events(out)
    assert recording.header["config"]["kv_events_config"]["publisher"] == "null"
    fold = KVEventFold(clock=lambda: 1.8e9)
    mirror = CacheMirror()
    for event in recording.events:
        batch = fold.apply(event)
        if batch is not None:
            mirror.apply(msgspec.msgpack.encode(batch))
    assert mirror.stored_events > 0 and mirror.removed_events > 0 and mirror.chained_stores > 0


def test_llm_d_topic_convention_names_the_pod_and_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """llm-d's indexer reads the pod and the model from the topic ``kv@<pod>@<model>``."""
    monkeypatch.setenv("POD_IP", "10.2.3.4")
    sink = KVEventsSink(_config(topic="kv@{pod}@{model}"), model_name="smollm2-135m")
    try:
        assert sink.publisher.topic == "kv@10.2.3.4@smollm2-135m"
        sub = _subscriber(sink.publisher.endpoint)  # subscribed to the test's TOPIC: hears nothing here
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        time.sleep(0.05)
        events, _ = _run(record_contents=True)
        _feed(sink, events)
        assert sink.flush()
        topic, _, _ = sub.recv_multipart()
        assert topic == b"kv@10.2.3.4@smollm2-135m"
        sub.close(linger=0)
    finally:
        sink.close()
    assert expand_topic("plain", "m") == "plain"
