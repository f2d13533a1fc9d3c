"""The console face of ``startup.progress``: a bar that redraws in place on a
terminal, and a log line at most every few seconds (and at the end) on a pipe,
so a long phase never looks hung. A sink of events like the stats line."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

from engine.events.record import Event
from engine.events.startup_records import StartupPhase, StartupProgress

BAR_WIDTH = 24


def progress_text(e: StartupProgress) -> str:
    """``phase C weights: 112/272 tensors (41 %)``, or without a total ``... 112 tensors``."""
    done = f"{e.done:,.0f}"
    if e.total:
        return f"phase {e.phase} {e.what}: {done}/{e.total:,.0f} {e.unit} ({e.done / e.total:.0%})"
    return f"phase {e.phase} {e.what}: {done} {e.unit}"


class ProgressPrinter:
    """Subscribe to the bus. ``stream`` a terminal: one line rewritten with ``\\r``;
    otherwise ``log`` (a ``str -> None``) every ``interval_s`` per item, and when it ends."""

    def __init__(self, stream: TextIO, log: Callable[[str], Any], interval_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.log = log
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self._open = False  # a bar line waits for its end on the terminal

    def __call__(self, event: Event) -> None:
        if isinstance(event, StartupProgress):
            self._progress(event)
        elif isinstance(event, StartupPhase) and event.status != "begin" and self._open:
            self._end_line()

    def _progress(self, e: StartupProgress) -> None:
        finished = e.total is not None and e.done >= e.total
        if self.tty:
            filled = int(BAR_WIDTH * e.done / e.total) if e.total else 0
            bar = "█" * filled + "░" * (BAR_WIDTH - filled)
            self.stream.write(f"\r{bar} {progress_text(e)}\x1b[K")
            self.stream.flush()
            self._open = True
            if finished:
                self._end_line()
            return
        if e.total == 1:  # a begin/end marker: the phase's own log lines say as much on a pipe
            return
        key = (e.phase, e.what)
        now = self.clock()
        if key not in self._last or finished or now - self._last[key] >= self.interval_s:
            self._last[key] = now
            self.log(progress_text(e))

    def _end_line(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
        self._open = False
