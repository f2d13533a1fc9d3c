"""Each phase's ``begin`` and ``end`` (or ``skipped`` / ``failed``) events with the device memory
around it, and ``startup.progress`` events for a phase's long parts."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from engine.budget.fixes import recorded_fixes
from engine.errors import UserError
from engine.events import PHASES, EventBus, StartupPhase, StartupProgress
from engine.events.phase_data import PhaseData
from engine.model.memory.device import MemoryReading, read_memory


@dataclass(slots=True)
class PhaseHandle:
    """What a phase body fills in: its numbers (engine/events/phase_data.py), or a skip reason.
    A phase that fails publishes the record it had set by then."""

    record: PhaseData | None = None
    skipped: str | None = None

    def data(self) -> dict[str, Any]:
        return self.record.to_dict() if self.record is not None else {}


class PhaseRecorder:
    """Emits the begin/end events of each phase with memory readings around it."""

    def __init__(self, bus: EventBus, device: torch.device, device_memory_gib: float | None, log: Any,
                 rank: int | None = None, pp_rank: int | None = None, tp_rank: int | None = None) -> None:
        self.bus = bus
        # under tensor or pipeline parallelism every event says whose phase it is (every rank runs A-G);
        # a pipeline stage's also say which stage and which rank within it; None: one rank
        self.rank = rank
        self.pp_rank = pp_rank
        self.tp_rank = tp_rank
        self.device = device
        self.device_memory_gib = device_memory_gib
        self.log = log
        self.seconds: dict[str, float] = {}

    def reading(self) -> MemoryReading:
        return read_memory(self.device, self.device_memory_gib)

    @contextmanager
    def phase(self, letter: str) -> Iterator[PhaseHandle]:
        name = PHASES[letter]
        before = self.reading().to_dict()
        self.bus.publish(StartupPhase(phase=letter, name=name, status="begin", memory_before=before, rank=self.rank,
                                      pp_rank=self.pp_rank, tp_rank=self.tp_rank))
        handle = PhaseHandle()
        start = time.perf_counter()
        try:
            yield handle
        except Exception as exc:
            duration = time.perf_counter() - start
            self.seconds[letter] = duration
            reason = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
            self.bus.publish(StartupPhase(phase=letter, name=name, status="failed", duration_s=duration,
                                          memory_before=before, memory_after=self.reading().to_dict(),
                                          data=handle.data(), reason=reason, fixes=recorded_fixes(exc),
                                          rank=self.rank, pp_rank=self.pp_rank, tp_rank=self.tp_rank))
            self.log.error(f"phase {letter} ({name}) failed", reason=reason)
            raise
        duration = time.perf_counter() - start
        self.seconds[letter] = duration
        status = "skipped" if handle.skipped else "end"
        self.bus.publish(StartupPhase(phase=letter, name=name, status=status, duration_s=duration,
                                      memory_before=before, memory_after=self.reading().to_dict(),
                                      data=handle.data(), reason=handle.skipped, rank=self.rank,
                                      pp_rank=self.pp_rank, tp_rank=self.tp_rank))
        self.log.info(f"phase {letter} {name} {'skipped' if handle.skipped else 'done'} in {duration:.2f} s",
                      **({"reason": handle.skipped} if handle.skipped else {}))


def progress_events(bus: EventBus, phase: str, what: str, unit: str,
                    chained: Callable[[int, int], None] | None = None) -> Callable[[int, int], None]:
    """A (done, total) callback that publishes ``startup.progress`` at most every 2 % (and
    at the end), and calls ``chained`` too."""
    last = [-1.0]

    def report(done: int, total: int) -> None:
        if chained is not None:
            chained(done, total)
        if done >= total or total <= 0 or (done - last[0]) / total >= 0.02:
            last[0] = done
            bus.publish(StartupProgress(phase=phase, what=what, done=done, total=total or None, unit=unit))

    return report
