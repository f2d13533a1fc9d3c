"""Which data-parallel rank the dashboard follows, with several (``r`` / ``R``): in replay
the timeline re-folds the recording for the rank from its checkpoints; live the feed fetches
the rank's snapshot from the server (``/debug/state?dp_rank=R``) and its events fold on from
there, the rank asked for named in the header until the snapshot arrives."""

from __future__ import annotations

from collections.abc import Callable

from engine.events import Event, LogEvent
from engine.events.feed import LiveFeed
from engine.events.folds.view import EngineView
from monitor.state import Timeline


class RankFollower:
    """``view`` reads the view shown now; ``show`` takes the view of the rank followed in
    replay; ``asked`` is the rank live asked for and not yet shown."""

    def __init__(self, timeline: Timeline | None, feed: LiveFeed | None, view: Callable[[], EngineView],
                 show: Callable[[EngineView], None], changed: Callable[[], None],
                 warn: Callable[[str], None]) -> None:
        self.timeline = timeline
        self.feed = feed
        self._view = view
        self._show = show
        self._changed = changed
        self._warn = warn
        self.asked: int | None = None  # live: the DP rank whose snapshot the feed is fetching
        self._ranks_shown = 0  # the DP ranks the footer's r / R were last shown for

    def ranks(self) -> list[int]:
        """The data-parallel ranks there are to follow: the recording's, or live those the
        view's Parallel fold has seen (a DP server's snapshot seeds every rank)."""
        if self.timeline is not None:
            return self.timeline.ranks
        view = self._view()
        return sorted(set(view.parallel.ranks) | ({view.dp_rank} if view.dp_rank is not None else set()))

    def text(self) -> str:
        """``DP rank 1 of 2`` (live, while another rank's state is on its way: ``→ 0``); "" with one rank."""
        ranks = self.ranks()
        if len(ranks) < 2:
            return ""
        text = f"DP rank {self._view().dp_rank or 0} of {len(ranks)}"
        return text + (f" → {self.asked}" if self.asked is not None else "")

    def ranks_changed(self) -> bool:
        """Whether the count of ranks moved since last asked (live ranks appear: r / R join the footer)."""
        count = len(self.ranks())
        changed, self._ranks_shown = count != self._ranks_shown, count
        return changed

    def follow(self, delta: int) -> None:
        """Follow the next (``delta`` 1) or previous (-1) DP rank."""
        ranks = self.ranks()
        if len(ranks) < 2:
            return
        current = self.asked if self.asked is not None else self._view().dp_rank
        rank = ranks[(ranks.index(current) + delta) % len(ranks)] if current in ranks else ranks[0]
        if self.timeline is not None:
            self._show(self.timeline.follow(rank))
            return
        assert self.feed is not None
        why_not = self.feed.follow_rank(rank)
        if why_not is not None:
            self._warn(f"cannot follow DP rank {rank}: {why_not}")
            return
        self.asked = rank
        self._changed()

    def answered(self, events: list[Event]) -> None:
        """Live: the asked rank's snapshot arrived (the view follows it), or the feed said why not."""
        if self.asked is None:
            return
        for event in events:
            if isinstance(event, LogEvent) and event.data.get("follow_dp_rank") == self.asked:
                self._warn(event.message)
                self.asked = None
                return
        if self._view().dp_rank == self.asked:
            self.asked = None
