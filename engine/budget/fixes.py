"""A fix as data: the flag to change, from what to what, why (with the budget's numbers) and,
once something predicted it, its effect. ``engine doctor``'s rules, logparse's failures and
the monitor's Diagnosis panel all build these; text is made only where one is shown
(:meth:`Fix.text`), so no reader ever parses a fix back out of a sentence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
