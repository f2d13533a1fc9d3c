"""Live: the feed drained into the dashboard on each tick, and the engine's clock between
events. Events fold into the view and the panels that keep their own history (Diagnosis, the
request panel), then everything redraws; without events the connection, a retry's countdown
and the queue ages still move (at most every :data:`CLOCK_REFRESH_S`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from textual.css.query import NoMatches

from engine.events import EngineStopped
from engine.events.feed import LIVE, LiveFeed
from monitor.widgets.diagnosis import Diagnosis
from monitor.widgets.queues import Queues
from monitor.widgets.request_panel import RequestPanel
from monitor.widgets.startup_table import StartupTable

if TYPE_CHECKING:
    from monitor.app import MonitorApp

CLOCK_REFRESH_S = 0.5  # how often queue ages move between events


class LiveUpdates:
    """``exit_when_engine_stops``: in-process (``engine serve --monitor``) the engine thread's
    death ends the dashboard, so the command can exit non-zero and a supervisor restart it."""

    def __init__(self, app: MonitorApp, feed: LiveFeed, wall_clock: Callable[[], float] = time.monotonic,
                 exit_when_engine_stops: bool = False) -> None:
        self.app = app
        self.feed = feed
        self.exit_when_engine_stops = exit_when_engine_stops
        self._wall_clock = wall_clock
        self._anchor: tuple[float, float] | None = None  # (view.t, wall clock when it arrived)
        self.rendered = 0.0  # wall clock of the last render of clock-driven cells

    def engine_now(self, view_t: float) -> float:
        """The latest folded event's ``t`` plus the wall time since it arrived, so ages keep
        moving through a long step; frozen while the feed is not live (the engine's time is
        unknown then)."""
        anchor = self._anchor
        if self.feed.connection.state != LIVE or anchor is None or anchor[0] != view_t:
            return view_t
        return view_t + max(0.0, self._wall_clock() - anchor[1])

    def mark_rendered(self) -> None:
        self.rendered = self._wall_clock()

    def tick(self) -> None:
        app = self.app
        events = self.feed.drain()
        if self.exit_when_engine_stops and any(isinstance(e, EngineStopped) for e in events):
            app.exit(return_code=1)
            return
        try:
            if events:
                app.view.fold(events)
                app.ranks.answered(events)
                app.query_one(Diagnosis).fold(events)
                app.query_one(RequestPanel).fold(events)
                if self._anchor is None or self._anchor[0] != app.view.t:
                    self._anchor = (app.view.t, self._wall_clock())
                app.refresh_view()
            else:
                app.update_bars()
                if self._wall_clock() - self.rendered >= CLOCK_REFRESH_S:
                    self.rendered = self._wall_clock()
                    now = app.engine_now()
                    app.query_one(Queues).update_view(app.view, now)
                    app.query_one(StartupTable).update_view(app.view, now)
        except NoMatches:  # a tick that lands while the screen is torn down
            return
