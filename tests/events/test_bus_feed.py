"""The in-process live feed (engine/events/feed.py BusFeed) leaves the bus as it found it: the bus
removes a subscriber by identity, and each ``feed.push`` is a new bound method."""

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
