"""The steps a finding quotes: the maximal runs of steps a limit holds, how long a run
must be to count, and step ranges and durations as the evidence words them.
"""

from __future__ import annotations

from collections.abc import Callable

from doctor.facts import StepRow

MIN_BINDING_STEPS = 5  # a limit must hold the queue back this many steps in a row to count


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms"


def step_range(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}–{last}"


def consecutive_runs(steps: list[StepRow], holds: Callable[[StepRow], bool]) -> list[list[StepRow]]:
    """Maximal runs of consecutive steps for which ``holds`` is true."""
    runs: list[list[StepRow]] = []
    current: list[StepRow] = []
    for step in steps:
        if holds(step):
            current.append(step)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs
