"""Pipeline stages' idle time folded from step events (issue 37).

A pipeline-parallel step event carries, per stage, ``pipeline_bubble_s`` (seconds the
stage waited on the stage before it; stage 0 on the results) and ``pipeline_bytes``
(activations it sent). Over a run, a stage's **bubble fraction** is its bubble seconds
over the steps' seconds: the share of the time its GPU (or CPU rank) sat idle. The
doctor's ``pipeline_bubble`` rule, ``engine simulate``'s summary and ``make bench`` read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.events.record import Event
from engine.events.step_records import StepEvent


@dataclass(slots=True)
class PipelineIdle:
    """Subscribe it to a bus or call it with each event (one data-parallel rank's, or ``add``)."""

    bubble_s: list[float] = field(default_factory=list)  # per stage, summed over the steps
    bytes_sent: list[int] = field(default_factory=list)
    step_s: float = 0.0  # the same steps' durations, summed
    steps: int = 0

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepEvent) and event.pipeline_bubble_s:
            self.add(event.pipeline_bubble_s, event.pipeline_bytes, event.duration_s or event.forward_s)

    def add(self, bubble_s: list[float], bytes_sent: list[int], duration_s: float) -> None:
        if len(self.bubble_s) < len(bubble_s):
            self.bubble_s += [0.0] * (len(bubble_s) - len(self.bubble_s))
            self.bytes_sent += [0] * (len(bubble_s) - len(self.bytes_sent))
        for stage, seconds in enumerate(bubble_s):
            self.bubble_s[stage] += seconds
        for stage, nbytes in enumerate(bytes_sent):
            self.bytes_sent[stage] += nbytes
        self.step_s += duration_s
        self.steps += 1

    @property
    def stages(self) -> int:
        return len(self.bubble_s)

    @property
    def fractions(self) -> list[float]:
        """Each stage's bubble seconds over the steps' seconds (0.0 with no time)."""
        return [b / self.step_s if self.step_s > 0 else 0.0 for b in self.bubble_s]

    def bytes_per_step(self) -> list[float]:
        return [b / self.steps if self.steps else 0.0 for b in self.bytes_sent]
