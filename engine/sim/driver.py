"""The deterministic driver: the scheduler with no model.

Requests arrive at given steps with a fixed prompt and a fixed number of output
tokens; every sampled token is the same deterministic id; time is the step index
(or ``step * step_time_s``). It runs scheduler steps until every request is done
and publishes the step events, so tests, ``engine bench-scheduler`` and later
``engine simulate`` share one loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.core.step_loop import FixedTokenExecutor, run_step
from engine.events import EventBus
from engine.events.folds.tally import RunTally

SAMPLED_TOKEN_ID = 7  # what the "model" always answers; never a stop token here


@dataclass(slots=True)
class DriverRequest:
    """A scripted request: arrives at ``arrival_step``, produces exactly
    ``output_tokens`` tokens (ignore_eos), then finishes with reason ``length``."""

    request_id: str
    prompt_token_ids: list[int]
    output_tokens: int
    arrival_step: int = 0
    priority: int = 0


@dataclass(slots=True)
class DriverResult(RunTally):
    """The run's tally (folded from its events), with the driver's own time axis:
    ``finish_step`` and ``first_token_step`` count driver steps (idle steps
    between arrivals included), which is also ``now / step_time_s``."""

    completed: bool = True  # False when max_steps ran out first


def background_workload(
    n: int, prompt_range: tuple[int, int], answer_range: tuple[int, int], seed: int = 0, vocab_size: int = 49152
) -> list[DriverRequest]:
    """The background's Part 5 draws: ``default_rng(seed)``, ``integers(*prompt_range, n)``
    prompt lengths then ``integers(*answer_range, n)`` answer lengths, all arriving
    at step 0. Token ids come from a separate ``default_rng(123)`` so prompts share
    no prefix."""
    import numpy as np  # only this helper needs it; the scheduler core stays dependency-free

    rng = np.random.default_rng(seed)
    prompts = rng.integers(*prompt_range, n)
    answers = rng.integers(*answer_range, n)
    tokens = np.random.default_rng(123)
    return [
        DriverRequest(f"r{i}", tokens.integers(0, vocab_size, int(p)).tolist(), int(a))
        for i, (p, a) in enumerate(zip(prompts, answers, strict=True))
    ]


StepHook = Callable[[Scheduler, SchedulerOutput], None]
_EXECUTOR = FixedTokenExecutor(SAMPLED_TOKEN_ID)


def driver_step(sched: Scheduler, bus: EventBus | None, now: float) -> tuple[SchedulerOutput, list[Request]]:
    """One model-free step (engine/core/step_loop.py with the fixed-token executor)."""
    result = run_step(sched, _EXECUTOR, bus, now)
    return result.output, result.finished


def run_driver(
    requests: Sequence[DriverRequest],
    config: SchedulerConfig,
    bus: EventBus | None = None,
    max_steps: int = 1_000_000,
    step_time_s: float = 1.0,
    on_step: StepHook | None = None,
    scheduler: Scheduler | None = None,
) -> DriverResult:
    """Run ``requests`` through a fresh scheduler until all finish.

    ``now`` for step k is ``k * step_time_s``. ``on_step`` is called after each
    step's ``update_from_output`` (tests use it to check invariants). When a bus
    is given and its clock is not set by the caller, events carry the same time.
    """
    if scheduler is not None and scheduler.bus is not None:
        bus = scheduler.bus
    elif bus is None:
        bus = EventBus()  # private: the tally folds events even when nobody else listens
    sched = scheduler if scheduler is not None else Scheduler(config, bus)
    sched.bus = bus
    result = DriverResult()
    bus.subscribe(result)
    by_step: dict[int, list[DriverRequest]] = {}
    for spec in requests:
        by_step.setdefault(spec.arrival_step, []).append(spec)
    last_arrival = max(by_step) if by_step else 0
    driver_step_of: dict[int, int] = {}  # scheduler step index -> driver step
    step = 0
    try:
        while step < max_steps:
            now = step * step_time_s
            for spec in by_step.get(step, ()):
                sched.add_request(Request(spec.request_id, spec.prompt_token_ids, spec.output_tokens,
                                          ignore_eos=True, arrival_time=now, priority=spec.priority), now)
            if not sched.has_unfinished():
                if step >= last_arrival:
                    break
                step += 1
                continue
            out, _ = driver_step(sched, bus, now)
            driver_step_of[out.step_index] = step
            if on_step is not None:
                on_step(sched, out)
            step += 1
        else:
            result.completed = not sched.has_unfinished()
    finally:
        bus.unsubscribe(result)
    for times in (result.finish_step, result.first_token_step):
        for request_id, index in times.items():
            times[request_id] = driver_step_of[index]
    return result
