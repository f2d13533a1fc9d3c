"""Forward-pass metrics (engine/events/exporters/forward_pass.py) read by a subscriber written from
vLLM's open PR #52061 (its example subscriber's structs and checks, copied here as the
wire contract): three frames, an empty topic, the sequence number equal to counter_id,
version 1, timing scope execute_model_cuda; the counts folded from a scripted run's
events, and the idle heartbeat when the engine empties."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from bench.bench_server import free_port
from engine.errors import UserError
from engine.events import EventBus
from engine.events.exporters.forward_pass import ForwardPassPublisher
from engine.events.request_records import RequestArrived, RequestFinished, RequestScheduled
from engine.events.step_records import StepEvent

FPM_VERSION = 1
FPM_TIMING_SCOPE = "execute_model_cuda"


# ---- the PR's wire contract (examples/features/forward_pass_metrics/forward_pass_metrics_subscriber.py)
class ScheduledRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    sum_prefill_kv_tokens: int = 0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class QueuedRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class ForwardPassMetrics(msgspec.Struct, frozen=True, gc=False):
    version: int = FPM_VERSION
    worker_id: str = ""
    dp_rank: int = 0
    counter_id: int = 0
    timing_scope: str = FPM_TIMING_SCOPE
    wall_time: float = 0.0
    scheduled_requests: ScheduledRequestMetrics = ScheduledRequestMetrics()
    queued_requests: QueuedRequestMetrics = QueuedRequestMetrics()




def _scripted_run(bus: EventBus) -> None:
    """a (100 tokens, 32 cached) and b (40) arrive; c (300) waits; a is chunked, then decodes
    beside b; b is preempted, a finishes, b finishes: the engine is idle."""
    for rid, n in (("a", 100), ("b", 40), ("c", 300)):
        bus.publish(RequestArrived(request_id=rid, prompt_tokens=n, max_tokens=4))
    bus.publish(RequestScheduled(request_id="a", prefix_hit_tokens=32))
    bus.publish(RequestScheduled(request_id="b"))
    bus.publish(StepEvent(index=1, scheduled={"a": [50, "prefill"], "b": [40, "prefill"]}, num_running=2,
                          num_waiting=1, duration_s=0.25))
    bus.publish(StepEvent(index=2, scheduled={"a": [18, "prefill"], "b": [1, "decode"]}, num_running=2,
                          num_waiting=1, duration_s=0.125))
    bus.publish(StepEvent(index=3, scheduled={"a": [1, "decode"]}, preempted=["b"], num_running=1, num_waiting=2,
                          duration_s=0.0625))
    for rid in ("a", "b", "c"):
        bus.publish(RequestFinished(request_id=rid, reason="abort"))
    bus.publish(StepEvent(index=4, num_running=0, num_waiting=0, duration_s=0.001))


def test_a_subscriber_written_from_vllms_pr_decodes_every_step_and_the_heartbeat() -> None:
    port = free_port()
    publisher = ForwardPassPublisher(port, worker_id="w0")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")  # the PR's subscriber connects; the engine binds
    bus = EventBus()
    bus.subscribe(publisher)
    try:
        # a slow joiner: idle heartbeats until the subscription is in place
        deadline = time.monotonic() + 5
        while not sub.poll(20) and time.monotonic() < deadline:
            bus.publish(StepEvent(index=0))
        while sub.poll(100):
            sub.recv_multipart()
        _scripted_run(bus)
        decoder = msgspec.msgpack.Decoder(ForwardPassMetrics)
        messages = []
        while sub.poll(500):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"" and len(seq) == 8
            message = decoder.decode(payload)
            assert message.counter_id == int.from_bytes(seq, "big")
            assert message.version == FPM_VERSION and message.timing_scope == FPM_TIMING_SCOPE
            messages.append(message)
    finally:
        sub.close()
        publisher.close()
    assert [m.counter_id for m in messages] == list(range(messages[0].counter_id, messages[0].counter_id + 5))
    first, second, third, last, heartbeat = messages
    assert first.worker_id == "w0" and first.wall_time == 0.25
    assert first.scheduled_requests == ScheduledRequestMetrics(
        num_prefill_requests=2, sum_prefill_tokens=90, var_prefill_length=900.0, sum_prefill_kv_tokens=32)
    assert first.queued_requests == QueuedRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=300)
    # a's last chunk reads its 82 computed tokens; b decodes over its 40-token prompt and first token
    assert second.scheduled_requests == ScheduledRequestMetrics(
        num_prefill_requests=1, sum_prefill_tokens=18, var_prefill_length=0.0, sum_prefill_kv_tokens=82,
        num_decode_requests=1, sum_decode_kv_tokens=41)
    assert third.scheduled_requests.num_decode_requests == 1 and third.scheduled_requests.sum_decode_kv_tokens == 101
    assert third.queued_requests.num_decode_requests == 1 and third.queued_requests.sum_decode_kv_tokens == 42  # b
    assert last.scheduled_requests == ScheduledRequestMetrics() and last.wall_time == 0.001
    assert heartbeat.wall_time == 0.0 and heartbeat.scheduled_requests == ScheduledRequestMetrics()


def test_a_taken_port_is_refused_by_name() -> None:
    port = free_port()
    first = ForwardPassPublisher(port)
    try:
        with pytest.raises(UserError, match="--forward-pass-metrics-port"):
            ForwardPassPublisher(port)
    finally:
        first.close()


def test_a_request_finished_in_a_step_counts_in_its_decodes_and_a_shared_fold_reads_the_same() -> None:
    """request.finished comes before the step it finished in: that step still scheduled it (vLLM
    counts it). The server's request fold, shared with /debug/requests, gives the same messages as
    the exporter's own fold; a finished or rejected request is never counted as queued."""
    from engine.events.exporters.forward_pass import ForwardPassFold
    from engine.events.request_records import RequestFirstToken, RequestRejected
    from engine.serve.shared_folds import LockedLifecycle

    events = [RequestArrived(request_id="a", prompt_tokens=8, max_tokens=2),
              RequestArrived(request_id="b", prompt_tokens=6, max_tokens=2),
              RequestRejected(request_id="r", prompt_tokens=9000, max_tokens=2, reason="too long"),
              RequestScheduled(request_id="a"), RequestScheduled(request_id="b"),
              StepEvent(index=1, scheduled={"a": [8, "prefill"], "b": [6, "prefill"]}, new=["a", "b"],
                        num_running=2),
              RequestFirstToken(request_id="a"), RequestFirstToken(request_id="b"),
              RequestFinished(request_id="a", reason="length", output_tokens=2),
              StepEvent(index=2, scheduled={"a": [1, "decode"], "b": [1, "decode"]}, finished={"a": "length"},
                        num_running=1)]
    lifecycle = LockedLifecycle()
    own, shared = ForwardPassFold(), ForwardPassFold(shared_requests=lifecycle)
    mine = [m for e in events for m in own.apply(e)]
    theirs = []
    for event in events:
        lifecycle(event)  # /debug/requests folds first, as the server's readers race to
        theirs.extend(shared.apply(event))
    assert mine == theirs
    prefill, decode = mine
    assert prefill.scheduled_requests.num_prefill_requests == 2 and prefill.queued_requests.num_prefill_requests == 0
    assert decode.scheduled_requests.num_decode_requests == 2  # a's last decode counts
    assert decode.scheduled_requests.sum_decode_kv_tokens == 9 + 7
    assert (decode.queued_requests.num_prefill_requests, decode.queued_requests.num_decode_requests) == (0, 0)
