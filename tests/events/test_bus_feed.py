"""Unsubscribing from the event bus (engine/events/bus.py) with a bound method taken again: each
``feed.push`` or ``events.append`` is a new object, so matching by identity alone left the in-process
live feed (engine/events/feed.py BusFeed) subscribed after it stopped."""

from __future__ import annotations

from engine.events import EventBus, LogEvent
from engine.events.feed import BusFeed


def test_a_stopped_feed_is_no_longer_subscribed() -> None:
    bus = EventBus()
    feed = BusFeed(bus)
    feed.start()
    assert bus.has_subscribers
    feed.stop()
    assert not bus.has_subscribers
    bus.publish(LogEvent(level="info", message="after stop"))
    assert feed.drain() == []
    feed.stop()  # a second stop is harmless


def test_the_bus_unsubscribes_a_bound_method_taken_again() -> None:
    """Each ``obj.method`` is a new object; unsubscribing with a fresh one still removes it, and a
    plain callable is still matched by identity."""
    bus = EventBus()
    seen: list[object] = []
    bus.subscribe(seen.append)
    bus.unsubscribe(seen.append)
    assert not bus.has_subscribers

    def sink(event: object) -> None:
        seen.append(event)

    bus.subscribe(sink)
    bus.unsubscribe(lambda event: None)  # another callable: sink stays
    assert bus.has_subscribers
    bus.unsubscribe(sink)
    assert not bus.has_subscribers
