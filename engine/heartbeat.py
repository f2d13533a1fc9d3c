"""A step heartbeat: each engine core's last step, what the step under way is doing, and the
requests waiting and running, as a few numbers another thread or process can read.

The engine writes it (``LLMEngine.step`` and the loops that call it: the server's engine
thread, a data-parallel core's loop); the stall detector (engine/serve/stall.py) reads it.
One engine core in the server's process keeps it in a list; under ``--data-parallel-size``
the API server makes each core's in shared memory (a ``multiprocessing`` ``RawArray``) and
hands it to the core, so a core that stopped (SIGSTOP, a hung kernel or collective) still
shows the server the step it was in, since when, and in which phase.

One thread writes; a reader may see a beat half written. Fields are written in an order
that never shows a finished step as still under way, so a judgement moves by one step at
most. The clock is injected (``time.monotonic`` by default: one clock for every process of
the host), so the tests drive it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass
from typing import Any

# What a step is doing, in the order it does it; "idle" between steps.
PHASES = ("idle", "schedule", "forward", "detokenize", "update")
IDLE, SCHEDULE, FORWARD, DETOKENIZE, UPDATE = PHASES

# Slots of the buffer (doubles).
(_STEPS, _LAST_BEAT, _STEP_STARTED, _PHASE, _WAITING, _RUNNING, _SCHEDULED, _LAST_STEP_S, _LONGEST_S,
 _EXPECTED_S, _CAP_S, _PID) = range(12)
SLOTS = 12
NOT_IN_STEP = -1.0


@dataclass(frozen=True, slots=True)
class Beat:
    """One reading of a heartbeat. Times are on the heartbeat's clock."""

    steps: int  # steps completed
    last_beat: float  # the last sign of progress: a step's end, or a turn of an idle loop
    step_started: float | None  # when the step under way began; None between steps
    phase: str  # one of PHASES
    waiting: int  # the scheduler's queue at the last step's start or end
    running: int
    scheduled: int  # sequences in the step under way (or the last one)
    last_step_s: float  # the last completed step's duration
    longest_step_s: float  # the longest completed step shorter than the cap in force
    expected_step_s: float  # the profile run's worst-case step (phase D's forward + sampler), 0 if unknown
    pid: int

    @property
    def in_step(self) -> bool:
        return self.step_started is not None

    def since(self) -> float:
        """When the engine last showed progress: the start of the step under way, else the last beat."""
        return self.step_started if self.step_started is not None else self.last_beat

    def to_dict(self, now: float) -> dict[str, Any]:
        return {"steps": self.steps, "phase": self.phase, "in_step_s": round(now - self.step_started, 3)
                if self.step_started is not None else None, "last_step_age_s": round(now - self.last_beat, 3),
                "last_step_s": round(self.last_step_s, 4), "longest_step_s": round(self.longest_step_s, 4),
                "expected_step_s": round(self.expected_step_s, 4), "num_waiting": self.waiting,
                "num_running": self.running, "scheduled": self.scheduled, "pid": self.pid}


class Heartbeat:
    """The writer's and the reader's side of one engine core's beat (module docstring)."""

    def __init__(self, buffer: MutableSequence[float] | None = None, clock: Callable[[], float] = time.monotonic,
                 *, fresh: bool = True) -> None:
        """``buffer``: SLOTS doubles (a shared ``RawArray``), or None for a private list.
        ``fresh``: start it now (the writer); a reader of another process's buffer passes False."""
        self.buffer: MutableSequence[float] = buffer if buffer is not None else [0.0] * SLOTS
        self.clock = clock
        if fresh:
            b = self.buffer
            b[_STEP_STARTED] = NOT_IN_STEP
            b[_LAST_BEAT] = clock()
            b[_PID] = float(os.getpid())

    @staticmethod
    def shared_buffer() -> Any:
        """SLOTS doubles in shared memory, for a process started with spawn (pass it as an argument)."""
        from multiprocessing.sharedctypes import RawArray

        return RawArray("d", SLOTS)

    # ------------------------------------------------------------ the writer
    def begin_step(self, waiting: int, running: int) -> None:
        b = self.buffer
        b[_WAITING], b[_RUNNING] = float(waiting), float(running)
        b[_PHASE] = float(PHASES.index(SCHEDULE))
        b[_STEP_STARTED] = self.clock()

    def phase(self, name: str) -> None:
        self.buffer[_PHASE] = float(PHASES.index(name))

    def end_step(self, waiting: int, running: int, scheduled: int) -> None:
        b = self.buffer
        now = self.clock()
        started = b[_STEP_STARTED]
        duration = now - started if started >= 0 else 0.0
        b[_WAITING], b[_RUNNING], b[_SCHEDULED] = float(waiting), float(running), float(scheduled)
        b[_LAST_STEP_S] = duration
        cap = b[_CAP_S]
        if duration > b[_LONGEST_S] and (cap <= 0 or duration < cap):  # a step the detector called stalled is no yardstick
            b[_LONGEST_S] = duration
        b[_LAST_BEAT] = now
        b[_STEPS] += 1
        b[_STEP_STARTED] = NOT_IN_STEP  # last: until here a reader sees the step under way
        b[_PHASE] = 0.0

    def scheduled(self, count: int) -> None:
        self.buffer[_SCHEDULED] = float(count)

    def idle(self) -> None:
        """A turn of the engine's loop outside any step: it is alive and takes commands."""
        if self.buffer[_STEP_STARTED] < 0:
            self.buffer[_LAST_BEAT] = self.clock()

    def set_expected_step(self, seconds: float) -> None:
        self.buffer[_EXPECTED_S] = max(0.0, float(seconds))

    def on_event(self, event: Any) -> None:
        """Bus subscriber during startup: phase D's profile run times the worst-case step (a
        whole token budget of prefill, then the sampler), the yardstick of the stall limit."""
        if getattr(event, "type", None) == "startup.phase" and event.phase == "D" and event.status == "end":
            data = event.data or {}
            self.set_expected_step(float(data.get("forward_s") or 0.0) + float(data.get("sample_s") or 0.0))

    # ------------------------------------------------------------ the reader
    def set_cap(self, seconds: float) -> None:
        """The stall limit in force: a step as long is not counted as the longest step seen."""
        self.buffer[_CAP_S] = float(seconds)

    def read(self) -> Beat:
        b = list(self.buffer)
        phase = int(b[_PHASE])
        return Beat(steps=int(b[_STEPS]), last_beat=b[_LAST_BEAT],
                    step_started=b[_STEP_STARTED] if b[_STEP_STARTED] >= 0 else None,
                    phase=PHASES[phase] if 0 <= phase < len(PHASES) else IDLE, waiting=int(b[_WAITING]),
                    running=int(b[_RUNNING]), scheduled=int(b[_SCHEDULED]), last_step_s=b[_LAST_STEP_S],
                    longest_step_s=b[_LONGEST_S], expected_step_s=b[_EXPECTED_S], pid=int(b[_PID]))
