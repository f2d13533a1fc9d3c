"""A fix as data: the flag to change, from what to what, why (with the budget's numbers) and,
once something predicted it, its effect. The budget check refuses with them
(:class:`BudgetRefused`, its sentence rendered by :func:`advice`) and the failed startup
phase records them; ``engine doctor``'s rules, logparse's failures and the monitor's
Diagnosis panel all build or read these; text is made only where one is shown
(:meth:`Fix.text`), so no reader parses a fix back out of a sentence (one named fallback in
doctor/rules/startup.py reads recordings made before the phase recorded them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import BudgetError


@dataclass(slots=True)
class Fix:
    """A flag change with the numbers that justify it. ``flag`` is "" for advice that is no
    single flag (free memory held by another process; the size of one request). ``effect``
    is a prediction (the doctor's simulated what-if), ``None`` until one is made."""

    flag: str
    current: Any
    proposed: Any
    why: str
    effect: str | None = None
    numbers: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        """'--flag current -> proposed: why; effect', the parts that are known."""
        if not self.flag:
            head = ""
        elif self.proposed is None:
            head = self.flag
        elif self.current is None:
            head = f"{self.flag} {self.proposed}"
        else:
            head = f"{self.flag} {self.current} -> {self.proposed}"
        body = f"{head}: {self.why}" if head and self.why else head or self.why
        return body + (f"; {self.effect}" if self.effect else "")

    def to_json(self) -> dict[str, Any]:
        return {"flag": self.flag, "current": self.current, "proposed": self.proposed, "why": self.why,
                "effect": self.effect, "numbers": dict(self.numbers)}

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Fix:
        """The fix :meth:`to_json` wrote (a recording's ``startup.phase`` ``fixes``)."""
        return cls(str(row.get("flag") or ""), row.get("current"), row.get("proposed"), str(row.get("why") or ""),
                   row.get("effect"), dict(row.get("numbers") or {}))


def _value(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:.2f}"


def advice(fix: Fix) -> str:
    """A fix as a refusal sentence words it: "raise --flag to at least X (why)" or "lower
    --flag to X or less (why)" when both values are numbers (the proposed one is the bound
    that works), otherwise its ``why``, which then says what to do."""
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (fix.current, fix.proposed))
    if not fix.flag or not numeric:
        return fix.why
    if fix.proposed > fix.current:
        head = f"raise {fix.flag} to at least {_value(fix.proposed)}"
    else:
        head = f"lower {fix.flag} to {_value(fix.proposed)} or less"
    return f"{head} ({fix.why})" if fix.why else head


class BudgetRefused(BudgetError):
    """The budget check's refusal as data: ``problem`` (what does not fit, with its numbers)
    and ``fixes``, any one of which makes it fit. The message is rendered from them; the
    failed phase's event records the fixes (:func:`recorded_fixes`), so a reader takes the
    flags and values from there, never from the sentence."""

    def __init__(self, problem: str, fixes: Sequence[Fix]) -> None:
        self.problem = problem
        self.fixes = tuple(fixes)
        super().__init__(f"{problem}; try " + " or ".join(advice(f) for f in self.fixes))


def recorded_fixes(exc: BaseException) -> list[dict[str, Any]]:
    """What a failed phase records of ``exc``: its fixes as JSON, [] when it carries none."""
    return [f.to_json() for f in exc.fixes] if isinstance(exc, BudgetRefused) else []
