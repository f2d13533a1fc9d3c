"""The engine step, once: schedule -> execute -> update -> step event, over an executor.

Every producer of steps (the real engine, the model-free driver, the simulator, the
replayer) runs this same function and differs only in its :class:`Executor`: what
"running" a :class:`~engine.core.scheduler.SchedulerOutput` means and when its tokens
exist.

* :class:`FixedTokenExecutor`: every sampling sequence answers one fixed token at
  the scheduling time (the driver, tests, ``engine bench-scheduler``);
* :class:`CostModelExecutor` (engine/sim/simulate.py): the same, but the step takes the
  cost model's seconds, so time advances by them;
* :class:`~engine.sim.replay.Replayer` is its own executor: it answers the recorded
  stop token where the recording stopped a request;
* :class:`~engine.llm_engine.LLMEngine` is its own executor too (its ``execute``): the
  model runner samples, the detokenisers find stop strings, and the step carries
  measured timings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.step_events import build_step_event, publish_step_event
from engine.events import EventBus, StepEvent


@dataclass(slots=True)
class ExecutedStep:
    """What an executor made of one scheduled step."""

    sampled: dict[str, list[int]]  # request id -> tokens sampled this step
    now: float  # when the tokens exist: the time update_from_output records
    stopped: set[str] = field(default_factory=set)  # finished by a stop string
    text: dict[str, str] = field(default_factory=dict)  # request id -> new text (model executors)
    timings: Mapping[str, float] | None = None  # forward_s, sample_s, ... for the step event
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its own sampling/detokenising raised


class Executor(Protocol):
    def execute(self, output: SchedulerOutput, now: float) -> ExecutedStep: ...


@dataclass(slots=True)
class StepResult:
    output: SchedulerOutput
    executed: ExecutedStep
    finished: list[Request]
    event: StepEvent | None  # None when nobody listens and no event was asked for


def run_step(scheduler: Scheduler, executor: Executor, bus: EventBus | None, now: float, *,
             host_clock: Callable[[], float] | None = None, build_event: bool = False) -> StepResult:
    """One step at time ``now``. ``host_clock`` (the real engine passes ``time.perf_counter``;
    the core reads no clock itself) adds the wall-clock schedule, update and total seconds to
    the executor's timings; model-free runs leave it out so their events stay deterministic.
    ``build_event`` returns the step event even when ``bus`` has no subscribers (the
    replayer compares it)."""
    t0 = host_clock() if host_clock else 0.0
    output = scheduler.schedule(now)
    t1 = host_clock() if host_clock else 0.0
    executed = executor.execute(output, now)
    t2 = host_clock() if host_clock else 0.0
    finished = scheduler.update_from_output(output, executed.sampled, executed.now, stopped=executed.stopped,
                                           failed=executed.failed)
    timings = executed.timings
    if host_clock is not None:
        t3 = host_clock()
        timings = {**(timings or {}), "schedule_s": t1 - t0, "update_s": t3 - t2, "duration_s": t3 - t0}
    event = publish_step_event(bus, output, timings)
    if event is None and build_event:
        event = build_step_event(output, timings)
    return StepResult(output, executed, finished, event)


class FixedTokenExecutor:
    """Model-free: every sequence that completes its prompt (or decodes) samples ``token``."""

    def __init__(self, token: int) -> None:
        self._tokens = [token]

    def execute(self, output: SchedulerOutput, now: float) -> ExecutedStep:
        return ExecutedStep({s.request.request_id: self._tokens for s in output.scheduled if s.samples}, now)
