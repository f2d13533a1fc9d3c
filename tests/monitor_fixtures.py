"""Recordings for the monitor tests: the bundled simulated sample and a run of
the real scheduler's deterministic driver, plus an independent block-table fold.

``SAMPLE`` (samples/monitor_sim.jsonl: 442 steps, 384 blocks, 55 requests, 13
preemptions, shared-prefix hits) is ``engine simulate``'s recording, made from the
repository root with::

    engine simulate --model llama-3.1-8b --num-gpu-blocks-override 384 --max-model-len 4096
    --max-num-seqs 32 --max-num-batched-tokens 1024 --num-prompts 55 --random-input-len 100:900
    --random-output-len 20:160 --arrival poisson --request-rate 0.25 --arrival-unit step
    --shared-prefix-fraction 0.5 --shared-prefix-len 256 --workload-seed 7 --stats-interval 1
    --events samples/monitor_sim.jsonl

The simulated clock makes it byte-for-byte reproducible (the header records the
``--events`` path, so keep that argument as written)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from engine.core.scheduler import SchedulerConfig
from engine.events import Event, EventBus, JsonlSink, StepEvent
from engine.sim.driver import DriverRequest, run_driver
from tests.paths import SAMPLES

SAMPLE = SAMPLES / "monitor_sim.jsonl"
# The docstring's command, which tests/sim/test_replay.py re-runs and compares; kept as the
# command line a person types, hence a split string rather than a list literal.
SAMPLE_COMMAND = (  # noqa: SIM905
    "simulate --model llama-3.1-8b --num-gpu-blocks-override 384 --max-model-len 4096 --max-num-seqs 32 "
    "--max-num-batched-tokens 1024 --num-prompts 55 --random-input-len 100:900 --random-output-len 20:160 "
    "--arrival poisson --request-rate 0.25 --arrival-unit step --shared-prefix-fraction 0.5 "
    "--shared-prefix-len 256 --workload-seed 7 --stats-interval 1"
).split()


def record_driver_run(path: Path, num_blocks: int = 36) -> Path:
    """A real scheduler run under memory pressure: shared prefixes, preemptions."""
    shared = list(range(100, 164))  # 4 full blocks every request starts with
    requests = [
        DriverRequest(f"r{i:02d}", shared + [i] * (10 + 7 * (i % 5)), output_tokens=40 + 9 * (i % 4),
                      arrival_step=i)
        for i in range(24)
    ]
    bus = EventBus()
    sink = JsonlSink(path, config={"source": "engine.sim.driver", "num_blocks": num_blocks})
    bus.subscribe(sink)
    run_driver(requests, SchedulerConfig(num_blocks=num_blocks, max_num_seqs=8, max_num_batched_tokens=96),
               bus=bus, step_time_s=0.01)
    sink.close()
    return path


def owners_at(events: Iterable[Event], step_index: int) -> dict[int, frozenset[str]]:
    """Block -> owners after step ``step_index``, by the plainest possible fold."""
    tables: dict[str, list[int]] = {}
    for event in events:
        if not isinstance(event, StepEvent):
            continue
        for rid, blocks in event.allocated.items():
            tables.setdefault(rid, []).extend(blocks)
        for rid, blocks in event.freed.items():
            for b in blocks:
                tables[rid].remove(b)
        if event.index == step_index:
            break
    owners: dict[int, set[str]] = {}
    for rid, blocks in tables.items():
        for b in blocks:
            owners.setdefault(b, set()).add(rid)
    return {b: frozenset(o) for b, o in owners.items()}


class ManualClock:
    """A clock a test sets by hand (``clock.now = 12.5``)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# Only a bound on a hung app, never a pace: a condition is met by the state it names.
LIVENESS_S = 60.0


async def until(pilot, condition, timeout_s: float = LIVENESS_S) -> None:  # type: ignore[no-untyped-def]
    """Wait until ``condition()`` holds. ``Pilot.press`` returns once the process looks idle
    by its CPU time (textual's ``wait_for_idle``), which on a loaded machine can come before
    a key's action has run: a test waits for the state the key brings, not for a while."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await pilot.pause(0.05)
