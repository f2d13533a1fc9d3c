"""The replay's controls over a :class:`~monitor.state.Timeline`: play and pause at a speed
(by the playback clock's seconds, monitor/playback.py), steps, jumps to the start, the end,
the next preemption or arrival. The app routes the replay keys here; each view the timeline
lands on goes back to the app to show."""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.events.folds.view import EngineView
from monitor.playback import PlaybackClock
from monitor.state import Timeline

SPEEDS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
SHORT_HOP = 20  # steps folded forward one by one; a longer move restores a checkpoint


class ReplayControl:
    """``show`` takes each view the replay lands on; ``changed`` hears that play or speed
    changed; ``notify`` says why a key did nothing (no later preemption)."""

    def __init__(self, timeline: Timeline, show: Callable[[EngineView], None], changed: Callable[[], None],
                 notify: Callable[[str], None], wall_clock: Callable[[], float] = time.monotonic) -> None:
        self.timeline = timeline
        self._show = show
        self._changed = changed
        self._notify = notify
        self._playback = PlaybackClock(wall_clock)  # replay moves by the clock's seconds, not by ticks
        self._budget = 0.0  # fractional steps owed to the player
        self.playing = False
        self.speed = 10.0
        # The commands the replay keys name (``replay('step', 1)``), each a method here.
        self.commands: dict[str, Callable[..., None]] = {
            "toggle_play": self.toggle_play, "step": self.step, "home": self.home, "end": self.end,
            "next_preemption": self.next_preemption, "next_arrival": self.next_arrival,
            "faster": self.faster, "slower": self.slower}

    def set_playing(self, playing: bool) -> None:
        if playing == self.playing:
            return
        self.playing = playing
        if playing:
            self._playback.start()
        self._changed()

    def _set_speed(self, speed: float) -> None:
        if speed != self.speed:
            self.speed = speed
            self._changed()

    def tick(self) -> None:
        """While playing: the steps the speed owes since the last tick; paused at the end."""
        if not self.playing:
            return
        self._budget += self.speed * self._playback.elapsed()
        steps = int(self._budget)
        if steps:
            self._budget -= steps
            self.move(steps)
            if self.timeline.position >= len(self.timeline) - 1:
                self.set_playing(False)

    def seek(self, position: int) -> None:
        """Show the recording at step position ``position`` (clamped)."""
        self._show(self.timeline.seek(position))

    def seek_index(self, index: int) -> None:
        """Show the recording at the first step whose ``index`` is ≥ ``index``."""
        self.seek(self.timeline.position_of_index(index))

    def move(self, delta: int) -> None:
        if 0 < delta <= SHORT_HOP:  # short hops fold forward instead of restoring a checkpoint
            for _ in range(delta):
                self.timeline.step_forward()
            self._show(self.timeline.view)
        else:
            self.seek(self.timeline.position + delta)

    def toggle_play(self) -> None:
        self.set_playing(not self.playing)

    def step(self, delta: int) -> None:
        self.set_playing(False)
        self.move(delta)

    def home(self) -> None:
        self.seek(0)

    def end(self) -> None:
        self.seek(len(self.timeline) - 1)

    def next_preemption(self) -> None:
        self._jump(self.timeline.next_preemption(), "no later preemption")

    def next_arrival(self) -> None:
        self._jump(self.timeline.next_arrival(), "no later arrival")

    def _jump(self, target: int | None, none_left: str) -> None:
        if target is None:
            self._notify(none_left)
        else:
            self.seek(target)

    def faster(self) -> None:
        self._set_speed(next((s for s in SPEEDS if s > self.speed), SPEEDS[-1]))

    def slower(self) -> None:
        self._set_speed(next((s for s in reversed(SPEEDS) if s < self.speed), SPEEDS[0]))
