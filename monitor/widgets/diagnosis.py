"""Diagnosis: the doctor's rules (doctor/rules/, the ones ``engine doctor`` runs)
over the events seen so far, each finding with the step it started at, its
evidence, cause and fix (the budget formula's numbers; the simulator's what-if is
``engine doctor``'s, too slow to run on every event).

The widget keeps its own :class:`~doctor.facts.RunFacts`: live, the app hands it the
events it drains; in replay, the recording's events up to the shown step (folded
forward as the player moves, from the start after a backward seek). Rules run
only while the panel is on screen, at most every :data:`RECHECK_S` seconds of wall
time while events flow.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from rich.text import Text
from textual.widgets import Static

from doctor.facts import RunFacts
from doctor.rules.finding import CRITICAL, Finding
from doctor.rules.registry import diagnose
from engine.events import Event

STYLE = {CRITICAL: "bold red", "warning": "bold yellow"}
RECHECK_S = 0.5


def finding_text(finding: Finding) -> Text:
    text = Text()
    text.append(f"{finding.severity.upper():<8} ", style=STYLE.get(finding.severity, "bold"))
    text.append(finding.title, style="bold")
    text.append(f"  started at step {finding.first_step}" if finding.first_step is not None else "  at startup",
                style="cyan")
    if finding.last_step is not None and finding.last_step != finding.first_step:
        text.append(f" (to {finding.last_step})", style="cyan")
    text.append("\n")
    for line in finding.evidence:
        text.append(f"  • {line}\n")
    text.append("  cause: ", style="dim")
    text.append(f"{finding.cause}\n")
    for fix in finding.fixes:
        text.append("  fix: ", style="green")
        text.append(f"{fix.text()}\n")
    return text


class Diagnosis(Static):
    """Findings of the doctor's rules over the events folded so far."""

    def __init__(self, *, id: str | None = None, wall_clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("", id=id)
        self.facts = RunFacts()
        self.findings: list[Finding] = []
        self._folded = 0  # replay: how many of the recording's events are in self.facts
        self._dirty = True
        self._checked_at = float("-inf")
        self._clock = wall_clock
        self._timer_set = False

    # ------------------------------------------------------------------ input
    def fold(self, events: Sequence[Event]) -> None:
        """Live: the events the app just drained."""
        for event in events:
            self.facts(event)
        self._dirty = self._dirty or bool(events)
        self._recheck()

    def show_until(self, events: Sequence[Event], end: int) -> None:
        """Replay: the recording's ``events[:end]`` (the shown step's end)."""
        if end < self._folded:
            self.facts, self._folded = RunFacts(), 0
        for event in events[self._folded:end]:
            self.facts(event)
        self._dirty = self._dirty or end != self._folded
        self._folded = end
        self._recheck(force=True)

    # ----------------------------------------------------------------- render
    def on_show(self) -> None:
        self._recheck(force=True)

    def _recheck(self, force: bool = False) -> None:
        if not self._dirty or not self.is_mounted or self.size.width == 0:
            return  # hidden (another tab): judged when shown
        now = self._clock()
        if not force and now - self._checked_at < RECHECK_S:
            if not self._timer_set:  # events stopped arriving: judge the last of them anyway
                self._timer_set = True
                self.set_timer(RECHECK_S, self._timed_recheck)
            return
        self._checked_at, self._dirty = now, False
        self.findings = diagnose(self.facts)
        self.update(self.render_findings())

    def _timed_recheck(self) -> None:
        self._timer_set = False
        self._recheck(force=True)

    def render_findings(self) -> Text:
        if not self.findings:
            steps = len(self.facts.steps)
            return Text(f"healthy: no rule fired over {steps:,} step{'' if steps == 1 else 's'}", style="green")
        text = Text()
        for i, finding in enumerate(self.findings):
            if i:
                text.append("\n")
            text.append_text(finding_text(finding))
        return text
