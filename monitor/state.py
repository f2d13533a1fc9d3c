"""Timeline: a recording the monitor can seek, indexed by step.

The state itself is :class:`engine.events.folds.view.EngineView`, the event layer's fold of
engine events (its snapshot format is documented there); widgets only render
that view. This module holds what only the dashboard needs.

Replay seeks with :class:`Timeline`: it keeps a snapshot every
``checkpoint_every`` steps and re-folds from the nearest one at or before the
target, so a seek costs at most one restore plus ``checkpoint_every`` steps.

A recording of several data-parallel ranks (``engine simulate -dp``, a DP server's) is
shown one rank at a time, as the view follows one (``EngineView.dp_rank``):
:meth:`Timeline.follow` switches to another rank by the same checkpoints, built for that
rank when it is first followed (one fold of the recording), and the next-preemption /
next-arrival positions are the followed rank's.
"""

from __future__ import annotations

import bisect
import gc
import itertools
from collections.abc import Sequence
from typing import Any

from engine.events import Event, RequestArrived, StepEvent
from engine.events.folds.view import EngineView, event_dp_rank


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
        steps = [e for e in self.events if isinstance(e, StepEvent)]  # step position k is steps[k]
        # Data-parallel ranks count their steps apart, so interleaved indices go back and forth:
        # the running maximum keeps the list sorted for go-to-step's bisect.
        self.step_indices: list[int] = list(itertools.accumulate((step.index for step in steps), max))
        # The DP ranks that stepped; the one followed first is the view's own choice (the first
        # stamped event's rank), so a one-rank recording folds as it always did.
        self.ranks: list[int] = sorted({step.dp_rank for step in steps})
        self.dp_rank: int | None = next((r for e in self.events if (r := event_dp_rank(e)) is not None), None)
        self._preemptions: dict[int, list[int]] = {}
        for k, step in enumerate(steps):
            if step.preempted:
                self._preemptions.setdefault(step.dp_rank, []).append(k)
        # An arrival shows in its rank's queue once folded: at the first step of any rank after it.
        self._arrivals: dict[int, list[int]] = {}
        for i, e in enumerate(self.events):
            if not isinstance(e, RequestArrived):
                continue
            at = self._step_at_or_after(i)
            if at is not None:
                self._arrivals.setdefault(e.dp_rank, []).append(at)
        self._arrivals = {rank: sorted(set(ks)) for rank, ks in self._arrivals.items()}
        self._checkpoints: dict[int | None, dict[int, dict[str, Any]]] = {}  # per followed rank
        self._build_checkpoints()
        # A long recording is hundreds of thousands of long-lived objects; without
        # this, a full garbage collection sweeping them all lands inside a seek
        # every so often (measured: 4.3 s stalls on a 100,000-step recording).
        gc.freeze()
        self.position = 0
        self.view = self.seek(0)

    def __len__(self) -> int:
        return len(self.step_positions)

    @property
    def preemption_steps(self) -> list[int]:
        """Positions of the followed rank's steps that preempted."""
        return self._preemptions.get(self.dp_rank or 0, [])

    @property
    def arrival_steps(self) -> list[int]:
        """Positions at which a request of the followed rank arrived."""
        return self._arrivals.get(self.dp_rank or 0, [])

    def follow(self, rank: int) -> EngineView:
        """Show DP rank ``rank``'s pool, requests and series from here on, at the same position."""
        if rank not in self.ranks:
            raise ValueError(f"DP rank {rank}: this recording's steps are rank {', '.join(map(str, self.ranks))}'s")
        self.dp_rank = rank
        if rank not in self._checkpoints:
            self._build_checkpoints()
            gc.freeze()
        return self.seek(self.position)

    def _step_at_or_after(self, event_pos: int) -> int | None:
        k = bisect.bisect_left(self.step_positions, event_pos)
        return k if k < len(self.step_positions) else None

    def _end_of(self, k: int) -> int:
        """Index one past the last event that belongs to position ``k``."""
        if not self.step_positions:
            return len(self.events)
        return self.step_positions[k] + 1

    def _build_checkpoints(self) -> None:
        """The followed rank's checkpoints."""
        view = EngineView(series_window=self.series_window, dp_rank=self.dp_rank)
        checkpoints = self._checkpoints[self.dp_rank] = {}
        done = 0
        for k in range(0, len(self.step_positions), self.checkpoint_every):
            end = self._end_of(k)
            view.fold(self.events[done:end])
            done = end
            checkpoints[k] = view.snapshot()

    def seek(self, k: int) -> EngineView:
        """Move to step position ``k`` (clamped) and return the view there."""
        k = max(0, min(k, len(self.step_positions) - 1)) if self.step_positions else 0
        base = (k // self.checkpoint_every) * self.checkpoint_every
        state = self._checkpoints[self.dp_rank].get(base)
        if state is None:
            view, start = EngineView(series_window=self.series_window, dp_rank=self.dp_rank), 0
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
