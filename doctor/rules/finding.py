"""A finding (one diagnosis: evidence, cause, fixes, where), its severities and the
exit status they give ``engine doctor``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from doctor.facts import RunFacts
from engine.budget.fixes import Fix

WARNING = "warning"
CRITICAL = "critical"
SEVERITY_ORDER = {WARNING: 1, CRITICAL: 2}


@dataclass(slots=True)
class Finding:
    """One diagnosis. ``first_step``/``last_step`` are ``StepEvent.index`` values
    (None for startup findings); ``numbers`` holds the figures the evidence quotes."""

    rule: str
    severity: str
    title: str
    evidence: list[str]
    cause: str
    fixes: list[Fix] = field(default_factory=list)
    first_step: int | None = None
    last_step: int | None = None
    numbers: dict[str, Any] = field(default_factory=dict)
    place: str | None = None  # where, for a finding read from no steps (a vLLM log's lines, its /metrics)

    @property
    def where(self) -> str:
        if self.place is not None:
            return self.place
        if self.first_step is None:
            return "startup"
        if self.last_step is None or self.last_step == self.first_step:
            return f"step {self.first_step}"
        return f"steps {self.first_step}–{self.last_step}"

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "severity": self.severity, "title": self.title, "where": self.where,
                "first_step": self.first_step, "last_step": self.last_step, "evidence": list(self.evidence),
                "cause": self.cause, "fixes": [f.to_json() for f in self.fixes], "numbers": dict(self.numbers)}


Rule = Callable[[RunFacts], Iterable[Finding]]


def exit_status(findings: Iterable[Finding]) -> int:
    """0 healthy, 1 warnings, 2 critical (``engine doctor``'s exit status)."""
    return max((SEVERITY_ORDER[f.severity] for f in findings), default=0)
