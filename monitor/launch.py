"""The dashboard's entry point for the engine's ``--monitor`` flags.

The engine never imports the monitor: ``engine.cli.dashboard`` finds this function
through the ``kvscope.dashboard`` entry point group (pyproject.toml) and calls
it in the main thread, which it then owns until the user quits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.events import EventBus
from engine.events.feed import BusFeed
from monitor.app import MonitorApp


def run_dashboard(bus: EventBus, snapshot_fn: Callable[[], dict[str, Any]] | None, title: str) -> None:
    """Show the live dashboard for ``bus`` until the user quits or the engine thread dies
    (an ``engine.stopped`` event).

    ``snapshot_fn`` (optional) returns the current ``EngineView.snapshot()``, so a
    dashboard opened after events were published starts from the present state;
    without it the dashboard folds only what the bus publishes from now on.
    """
    MonitorApp(feed=BusFeed(bus, snapshot_fn=snapshot_fn), source_name=title, exit_when_engine_stops=True).run()
