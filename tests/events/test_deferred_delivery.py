"""Deferred delivery (engine/events/deferred_delivery.py): a deferred subscriber sees every event
a synchronous one sees, in the same order, only later; readers flush; the publisher delivers a
batch once it is old, the flusher thread once the publisher is quiet; a failing deferred sink is
stopped like any other; and a real engine run writes the same recording either way."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from engine.events import Event, EventBus, JsonlSink, LogEvent, SinkFailed
from engine.events.deferred_delivery import DeferredDelivery
from engine.serve.shared_folds import LockedLifecycle, subscribe_observers

NEVER_S = 3600.0  # a period no test waits out: only a flush or a publish delivers


def test_a_deferred_subscriber_gets_every_event_in_order_only_when_flushed() -> None:
    bus = EventBus(defer_s=NEVER_S)
    now: list[Event] = []
    later: list[Event] = []
    bus.subscribe(later.append, deferred=True)
    bus.subscribe(now.append)
    for i in range(5):
        bus.publish(LogEvent(message=f"event {i}"))
    assert len(now) == 5 and later == []
    bus.flush()
    assert later == now and [e.seq for e in later] == [1, 2, 3, 4, 5]
    bus.flush()  # nothing left: no event twice
    assert len(later) == 5


def test_unsubscribing_a_deferred_subscriber_hands_it_what_waits_first() -> None:
    bus = EventBus(defer_s=NEVER_S)
    got: list[Event] = []
    bus.subscribe(got.append, deferred=True)
    bus.publish(LogEvent(message="last words"))
    bus.unsubscribe(got.append)
    assert [e.message for e in got if isinstance(e, LogEvent)] == ["last words"]
    bus.publish(LogEvent(message="after"))
    bus.flush()
    assert len(got) == 1


def test_the_publisher_delivers_a_batch_once_its_oldest_event_is_a_period_old() -> None:
    """The batch's age is read on the delivery's clock, driven here: no wall-clock pace."""
    clock = [0.0]
    batches: list[tuple[list[str], int]] = []
    delivery = DeferredDelivery(lambda events: batches.append(
        ([e.message for e in events if isinstance(e, LogEvent)], threading.get_ident())), period_s=0.1,
        clock=lambda: clock[0])
    delivery.add(LogEvent(message="a"))
    clock[0] = 0.05
    delivery.add(LogEvent(message="b"))
    assert batches == []  # 50 ms old: the batch waits
    clock[0] = 0.1
    delivery.add(LogEvent(message="c"))
    assert batches == [(["a", "b", "c"], threading.get_ident())]  # on the publisher's thread
    delivery.stop()


def test_the_flusher_thread_delivers_what_a_quiet_publisher_left() -> None:
    """The publisher stops after one event: the flusher thread delivers it (eventually; the
    test waits on the delivery, not on a pace)."""
    bus = EventBus(defer_s=0.01)
    delivered = threading.Event()
    threads: list[int] = []

    def sink(event: Event) -> None:
        threads.append(threading.get_ident())
        delivered.set()

    bus.subscribe(sink, deferred=True)
    bus.publish(LogEvent(message="then silence"))
    assert delivered.wait(60), "the flusher thread never delivered the quiet publisher's event"
    assert threads and threads[0] != threading.get_ident()
    bus.unsubscribe(sink)


@pytest.mark.sink_failures_expected
def test_a_failing_deferred_subscriber_is_stopped_and_the_others_hear_of_it() -> None:
    bus = EventBus(defer_s=NEVER_S)
    calls: list[Event] = []
    now: list[Event] = []
    later: list[Event] = []

    def fails(event: Event) -> None:
        calls.append(event)
        raise OSError(28, "No space left on device")

    bus.subscribe(fails, deferred=True)
    bus.subscribe(later.append, deferred=True)
    bus.subscribe(now.append)
    for i in range(3):
        bus.publish(LogEvent(message=f"event {i}"))
    bus.flush()
    assert len(calls) == 1 and "fails" in next(iter(bus.failed_sinks))
    for seen in (now, later):
        assert [e.type for e in seen] == ["log", "log", "log", "sink.failed"], [e.type for e in seen]
        assert isinstance(seen[-1], SinkFailed) and seen[-1].at_event == "log"
    assert [e.seq for e in later] == [1, 2, 3, 4]


def test_a_subscriber_that_publishes_flushes_or_unsubscribes_while_delivered_to_keeps_the_order() -> None:
    """No deadlock and no event out of order: what it publishes joins the batch under way."""
    bus = EventBus(defer_s=NEVER_S)
    first: list[int] = []
    second: list[int] = []

    def chatty(event: Event) -> None:
        first.append(event.seq)
        if isinstance(event, LogEvent) and event.message == "ask":
            bus.publish(LogEvent(message="answer"))
            bus.flush()

    bus.subscribe(chatty, deferred=True)
    bus.subscribe(lambda e: second.append(e.seq), deferred=True)
    bus.publish(LogEvent(message="ask"))
    bus.publish(LogEvent(message="then"))
    bus.flush()
    assert first == second == [1, 2, 3]
    bus.unsubscribe(chatty)
    bus.publish(LogEvent(message="without it"))
    bus.flush()
    assert first == [1, 2, 3] and second == [1, 2, 3, 4]  # the other stays


def test_a_served_fold_reads_through_the_bus() -> None:
    """The server's folds are deferred; a read delivers what waits first, so a route never
    answers from behind the engine (here: a finished request's per-request metrics)."""
    from engine.events import RequestArrived, RequestFinished

    bus = EventBus(defer_s=NEVER_S)
    lives = LockedLifecycle()
    subscribe_observers(bus, [lives])
    bus.publish(RequestArrived(request_id="r1", prompt_tokens=4, max_tokens=2))
    bus.publish(RequestFinished(request_id="r1", reason="length", prompt_tokens=4, output_tokens=2))
    assert lives.fold.get("r1") is None  # not delivered yet: only a read delivers it
    assert lives.metrics("r1") is not None


def test_a_real_run_records_the_same_bytes_deferred_or_not(tmp_path: Path) -> None:
    """The events a deferred sink gets are the ones published, untouched by the engine after
    publishing: two recordings of one real run, one written as published and one deferred,
    are byte for byte the same."""
    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    bus = EventBus(defer_s=0.05)
    now_path, later_path = tmp_path / "now.jsonl", tmp_path / "later.jsonl"
    now_sink, later_sink = JsonlSink(now_path), JsonlSink(later_path)
    bus.subscribe(now_sink)
    bus.subscribe(later_sink, deferred=True)
    llm = LLM(bus=bus, threads=1, kv_cache_memory_bytes=1 << 24, max_model_len=256, stats_interval=0.0)
    try:
        llm.generate([[1000 + i, 2000 + i, 3000] * 6 for i in range(6)],
                     SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    finally:
        llm.close()
    bus.unsubscribe(later_sink)
    bus.unsubscribe(now_sink)
    now_sink.close()
    later_sink.close()
    recorded = now_path.read_bytes()
    assert recorded.count(b'"type":"step"') >= 12
    assert later_path.read_bytes() == recorded
