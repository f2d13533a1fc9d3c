"""The replay's pace: how far a replay moves at each tick of the app's timer, from the
time an injected clock says has passed since the last tick, not from the number of ticks.

A loaded machine skips timer ticks; counting ticks played slower the busier the machine
was. Measured on the clock, a skipped tick is caught up by the next, and a test that sets
the clock by hand (``tests/monitor_fixtures.ManualClock``) decides exactly how far a replay
plays. Both dashboards play through it: kvscope's (steps per second) and the fleet's
(recorded seconds per second)."""

from __future__ import annotations

import time
from collections.abc import Callable


class PlaybackClock:
    """Seconds of ``clock`` passed while playing, handed out tick by tick."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._last: float | None = None

    def start(self) -> None:
        """Play from now: what passed while paused is not owed."""
        self._last = self.clock()

    def elapsed(self) -> float:
        """Seconds since :meth:`start` or the previous call (never negative)."""
        now = self.clock()
        last, self._last = self._last, now
        return 0.0 if last is None else max(0.0, now - last)
