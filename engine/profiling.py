"""``POST /start_profile`` / ``/stop_profile``: the torch profiler around the engine's
steps, as vLLM's routes run it in its workers. Both calls run on the engine thread
(:meth:`~engine.serve.async_engine.AsyncEngine.call`), so the profile holds whole steps
and the thread that runs them. The trace is Chrome trace JSON (ui.perfetto.dev opens
it) written into ``trace_dir``: where kvscope's own Perfetto trace goes (``--trace-out``'s
folder), else vLLM's ``VLLM_TORCH_PROFILER_DIR``, else beside ``--events``, else the
working directory; the answer to ``/stop_profile`` names the file. Under
``--data-parallel-size D`` every rank's engine core runs its own profiler (the steps run
there, not in the API server's process) and writes its own file into the same folder,
``...-dp<rank>-<pid>-<n>.json``; the answer lists them all.

A profile is bounded (:class:`ProfileLimits`): ``max_steps`` (vLLM's profiler
``max_iterations``) and ``max_seconds``, counted on the engine's ``step`` events, stop it
by themselves and write the trace; with neither given the default caps apply, so a
profile nobody stops cannot fill memory and disk. Every trace's name is unique (the start
time, the process and a counter), so profiles started within one second keep their files."""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.events import Event, StepEvent
from engine.logs import get_logger

PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"
# A forgotten profile grew ~0.4 MB of memory and ~0.2 MB of trace a second under load:
# these caps keep one to tens of MB.
DEFAULT_MAX_STEPS = 1000
DEFAULT_MAX_SECONDS = 120.0


def profile_dir(trace_out: str | None, events: str | None) -> str:
    """Where the profiler's traces go (see the module docstring)."""
    if trace_out:
        return str(Path(trace_out).resolve().parent)
    if os.environ.get(PROFILER_DIR_ENV):
        return os.environ[PROFILER_DIR_ENV]
    if events:
        return str(Path(events).resolve().parent)
    return os.getcwd()


@dataclass(frozen=True, slots=True)
class ProfileLimits:
    """When a profile stops itself: after ``max_steps`` engine steps or ``max_seconds``
    (whichever comes first, checked at each step). ``default``: neither was asked for and
    the caps for a forgotten profile apply."""

    max_steps: int | None = None
    max_seconds: float | None = None
    default: bool = False

    @classmethod
    def capped(cls, max_steps: int | None = None, max_seconds: float | None = None) -> ProfileLimits:
        """The limits asked for, or the default caps when none was."""
        if max_steps is None and max_seconds is None:
            return cls(DEFAULT_MAX_STEPS, DEFAULT_MAX_SECONDS, default=True)
        return cls(max_steps, max_seconds)

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> ProfileLimits:
        """From ``/start_profile``'s query parameters or JSON body; a bad value is a
        :class:`UserError` that says what to send instead."""
        steps, seconds = values.get("max_steps"), values.get("max_seconds")
        return cls.capped(None if steps is None else int(_positive(steps, "max_steps", int)),
                          None if seconds is None else _positive(seconds, "max_seconds", float))

    def to_dict(self) -> dict[str, Any]:
        return {"max_steps": self.max_steps, "max_seconds": self.max_seconds, "default": self.default}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ProfileLimits:
        return cls.capped() if not data else cls(data.get("max_steps"), data.get("max_seconds"),
                                                 bool(data.get("default")))


def _positive(value: Any, name: str, kind: type[int] | type[float]) -> int | float:
    try:
        number = kind(value)
        # 2.5 steps is refused, not cut to 2; true (a JSON boolean) is not 1
        whole = kind is float or not isinstance(value, float) or value.is_integer()
        ok = whole and not isinstance(value, bool) and number > 0 and math.isfinite(number)
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        what = "a whole number of steps" if kind is int else "a number of seconds"
        raise UserError(f"{name}={value!r}: give {what} above 0, e.g. {name}={'50' if kind is int else '30'}")
    return number


_trace_numbers = itertools.count(1)  # the process's traces, in the file name: unique within one second


class TorchProfiler:
    """One torch.profiler session at a time; start and stop on the engine thread. While it
    runs it counts the engine's ``step`` events and stops itself at its limits."""

    def __init__(self, trace_dir: str, label: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        """``label``: in the file's name (a data-parallel core's ``dp<rank>``); ``clock``:
        what ``max_seconds`` is measured on."""
        self.trace_dir = trace_dir
        self.label = label
        self.clock = clock
        self.stopped_itself: str | None = None  # why the last profile ended by itself, until /stop_profile
        self._profile: Any = None
        self._bus: Any = None
        self._limits = ProfileLimits.capped()
        self._steps = 0
        self._started = (0.0, 0.0)  # (wall time, clock) at the start
        self._last_trace: str | None = None
        self._subscriber = self._on_event  # one bound method: the bus unsubscribes by identity

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, engine: Any = None, limits: ProfileLimits | None = None) -> str:
        """Start profiling; ``engine``'s bus tells the steps (without one the limits cannot
        count them, and only ``stop`` ends the profile)."""
        import torch.profiler

        if self._profile is not None:
            raise UserError("the profiler is already running; POST /stop_profile first")
        Path(self.trace_dir).mkdir(parents=True, exist_ok=True)
        profile = torch.profiler.profile(activities=_activities(), record_shapes=False, with_stack=False)
        profile.start()
        self._profile, self._started, self._steps = profile, (time.time(), self.clock()), 0
        self._limits, self.stopped_itself, self._last_trace = limits or ProfileLimits.capped(), None, None
        self._bus = getattr(engine, "bus", None)
        if self._bus is not None:
            self._bus.subscribe(self._subscriber)
        get_logger("kvscope.serve").info(f"torch profiler started ({self._describe_limits()}); the trace goes to "
                                         f"{self.trace_dir}")
        return self.trace_dir

    def stop(self, engine: Any = None) -> str:
        """Stop and write the trace; after a profile stopped itself, the trace it wrote."""
        if self._profile is None:
            if self._last_trace is not None:  # it stopped at its limit: the answer is its trace, once
                trace, self._last_trace, self.stopped_itself = self._last_trace, None, None
                return trace
            raise UserError("the profiler is not running; POST /start_profile first")
        path = self._finish()
        get_logger("kvscope.serve").info(f"torch profiler stopped after {self._steps} step(s); trace written to {path}")
        return path

    def _on_event(self, event: Event) -> None:
        if not isinstance(event, StepEvent) or self._profile is None:
            return
        self._steps += 1
        why = self._limit_reached()
        if why is not None:
            self.stopped_itself = why
            self._last_trace = self._finish()
            get_logger("kvscope.serve").warning(f"torch profiler stopped itself: {why}; trace written to "
                                                f"{self._last_trace}")

    def _limit_reached(self) -> str | None:
        limits, cap = self._limits, "the default cap for a profile nobody stops" if self._limits.default else "its limit"
        if limits.max_steps is not None and self._steps >= limits.max_steps:
            return f"{self._steps} steps reached {cap} (max_steps={limits.max_steps})"
        elapsed = self.clock() - self._started[1]
        if limits.max_seconds is not None and elapsed >= limits.max_seconds:
            return f"{elapsed:.1f} s reached {cap} (max_seconds={limits.max_seconds:g})"
        return None

    def _finish(self) -> str:
        profile, self._profile = self._profile, None
        if self._bus is not None:
            self._bus.unsubscribe(self._subscriber)
            self._bus = None
        profile.stop()
        path = self._trace_path()
        profile.export_chrome_trace(str(path))
        return str(path)

    def _trace_path(self) -> Path:
        label = f"{self.label}-" if self.label else ""
        while True:  # the counter makes it unique in this process; another process has another pid
            path = Path(self.trace_dir) / (f"kvscope-torch-profile-{int(self._started[0])}-{label}{os.getpid()}-"
                                           f"{next(_trace_numbers)}.json")
            if not path.exists():
                return path

    def _describe_limits(self) -> str:
        limits = self._limits
        parts = [f"max_steps={limits.max_steps}" if limits.max_steps is not None else "",
                 f"max_seconds={limits.max_seconds:g}" if limits.max_seconds is not None else ""]
        text = ", ".join(p for p in parts if p)
        return f"stops itself at {text}" + (" (the default caps)" if limits.default else "")


def _activities() -> list[Any]:
    import torch
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
