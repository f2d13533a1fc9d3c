"""Timeline: a recording the monitor can seek, indexed by step.

The state itself is :class:`engine.events.view.EngineView`, the event layer's fold of
engine events (its snapshot format is documented there); widgets only render
that view. This module holds what only the dashboard needs.

Replay seeks with :class:`Timeline`: it keeps a snapshot every
``checkpoint_every`` steps and re-folds from the nearest one at or before the
target, so a seek costs at most one restore plus ``checkpoint_every`` steps.
"""

from __future__ import annotations

import bisect
import gc
import itertools
from collections.abc import Sequence
from typing import Any

from engine.events import Event, RequestArrived, StepEvent
from engine.events.view import EngineView


class Timeline:
    """A recording indexed by step, with periodic checkpoints for fast seeking.

    Position ``k`` means: every event up to and including the ``k``-th step event
    (0-based position among step events, not its ``index`` field) has been folded.
    Events before the first step (config, startup) belong to position 0.
    """

    def __init__(
        self, events: Sequence[Event], checkpoint_every: int = 500, series_window: int = 4096
    ) -> None:
        self.events = list(events)
        self.checkpoint_every = max(1, checkpoint_every)
        self.series_window = series_window
        self.step_positions: list[int] = [i for i, e in enumerate(self.events) if isinstance(e, StepEvent)]
        # Data-parallel ranks count their steps apart, so interleaved indices go back and forth:
        # the running maximum keeps the list sorted for go-to-step's bisect.
        self.step_indices: list[int] = list(itertools.accumulate(
            (self.events[i].index for i in self.step_positions), max))  # type: ignore[attr-defined]
        self.preemption_steps: list[int] = [
            k for k, i in enumerate(self.step_positions) if self.events[i].preempted  # type: ignore[attr-defined]
        ]
        arrivals = (self._step_at_or_after(i) for i, e in enumerate(self.events) if isinstance(e, RequestArrived))
        self.arrival_steps: list[int] = sorted({k for k in arrivals if k is not None})
        self._checkpoints: dict[int, dict[str, Any]] = {}
        self._build_checkpoints()
        # A long recording is hundreds of thousands of long-lived objects; without
        # this, a full garbage collection sweeping them all lands inside a seek
        # every so often (measured: 4.3 s stalls on a 100,000-step recording).
        gc.freeze()
        self.position = 0
        self.view = self.seek(0)

    def __len__(self) -> int:
        return len(self.step_positions)

    def _step_at_or_after(self, event_pos: int) -> int | None:
        k = bisect.bisect_left(self.step_positions, event_pos)
        return k if k < len(self.step_positions) else None

    def _end_of(self, k: int) -> int:
        """Index one past the last event that belongs to position ``k``."""
        if not self.step_positions:
            return len(self.events)
        return self.step_positions[k] + 1

    def _build_checkpoints(self) -> None:
        view = EngineView(series_window=self.series_window)
        done = 0
        for k in range(0, len(self.step_positions), self.checkpoint_every):
            end = self._end_of(k)
            view.fold(self.events[done:end])
            done = end
            self._checkpoints[k] = view.snapshot()

    def seek(self, k: int) -> EngineView:
        """Move to step position ``k`` (clamped) and return the view there."""
        k = max(0, min(k, len(self.step_positions) - 1)) if self.step_positions else 0
        base = (k // self.checkpoint_every) * self.checkpoint_every
        state = self._checkpoints.get(base)
        if state is None:
            view, start = EngineView(series_window=self.series_window), 0
        else:
            view = EngineView.from_snapshot(state, series_window=self.series_window)
            start = self._end_of(base)
        view.fold(self.events[start : self._end_of(k)])
        self.position = k
        self.view = view
        return view

    def step_forward(self) -> EngineView:
        """Advance one step by folding only the new events (cheaper than a seek)."""
        if self.position + 1 >= len(self.step_positions):
            return self.view
        start, self.position = self._end_of(self.position), self.position + 1
        self.view.fold(self.events[start : self._end_of(self.position)])
        return self.view

    def position_of_index(self, index: int) -> int:
        """Position of the first step whose ``index`` is at least ``index``."""
        return min(bisect.bisect_left(self.step_indices, index), max(0, len(self.step_indices) - 1))

    def next_preemption(self) -> int | None:
        k = bisect.bisect_right(self.preemption_steps, self.position)
        return self.preemption_steps[k] if k < len(self.preemption_steps) else None

    def next_arrival(self) -> int | None:
        k = bisect.bisect_right(self.arrival_steps, self.position)
        return self.arrival_steps[k] if k < len(self.arrival_steps) else None
