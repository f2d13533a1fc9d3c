"""``--monitor`` opens the dashboard through the ``kvscope.dashboard`` entry point
(engine/cli/dashboard.py), so the engine never imports monitor/."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

import engine.cli.dashboard as dashboard
import engine.cli.plugins as plugins
import monitor.launch
from engine.cli.commands import run_workload, serve
from engine.errors import UserError
from engine.events import EventBus, SnapshotEvent


def test_the_textual_dashboard_is_registered() -> None:
    assert dashboard.load_dashboard() is monitor.launch.run_dashboard


@pytest.fixture
def no_dashboard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugins, "entry_points", lambda group: [])


@pytest.mark.usefixtures("no_dashboard")
def test_no_dashboard_installed_is_a_user_error() -> None:
    with pytest.raises(UserError, match="--monitor needs the kvscope monitor package"):
        dashboard.run_dashboard(EventBus(), None, "t")


@pytest.mark.usefixtures("no_dashboard")
@pytest.mark.parametrize("start", [
    lambda args: serve._run_with_monitor(args, None),
    lambda args: run_workload.run_with_monitor(args, [], "run-workload"),
], ids=["serve", "run_workload"])
def test_commands_refuse_monitor_before_starting_anything(start: Any) -> None:
    # The namespace is empty: the check comes before any argument is read.
    with pytest.raises(UserError, match="--monitor needs"):
        start(argparse.Namespace())


def test_launch_feeds_the_bus_and_snapshot_to_the_app(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    class FakeApp:
        def __init__(self, *, feed: Any, source_name: str, exit_when_engine_stops: bool) -> None:
            seen.update(feed=feed, source_name=source_name, exit_when_engine_stops=exit_when_engine_stops)

        def run(self) -> None:
            seen["ran"] = True

    monkeypatch.setattr(monitor.launch, "MonitorApp", FakeApp)
    bus = EventBus()
    dashboard.run_dashboard(bus, lambda: {"version": 1, "last_seq": 0}, "serve http://x:1")
    feed = seen["feed"]
    assert seen["ran"] and seen["source_name"] == "serve http://x:1"
    assert seen["exit_when_engine_stops"]  # the in-process dashboard ends when the engine thread dies
    assert feed.bus is bus
    feed.start()  # subscribes, then queues the snapshot first
    try:
        assert isinstance(feed.drain()[0], SnapshotEvent)
    finally:
        feed.stop()
