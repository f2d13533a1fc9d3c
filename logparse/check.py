"""A check of a vLLM log: one figure or failure judged, with its formula, tolerance, line
and fixes, and the tolerance rule every derived check follows.

Tolerance rule for checks: a number printed with d decimals is known to one
unit of its last digit (10^-d). Rounding alone would allow half a unit, but the
figures people paste are not always rounded (the background notebook prints
53.97 GiB as "53.9"), and vLLM's ``format_gib`` drops trailing zeros, so "53.9"
may stand for anything from 53.85 to 53.99. A derived quantity carries the sum
of its inputs' tolerances.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.budget.fixes import Fix


@dataclass(slots=True)
class Check:
    id: str
    title: str
    ok: bool | None  # None: not judged (an input is missing)
    detail: str
    kind: str = "check"  # check | failure | warning
    formula: str | None = None
    expected: float | None = None
    actual: float | None = None
    tolerance: float | None = None
    line: int | None = None
    fix: list[Fix] = field(default_factory=list)  # structured (engine/budget/fixes.py); text only at the edge

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "title": self.title,
            "ok": self.ok,
            "formula": self.formula,
            "expected": self.expected,
            "actual": self.actual,
            "tolerance": self.tolerance,
            "detail": self.detail,
            "line": self.line,
            "fix": [f.text() for f in self.fix],
            "fixes": [f.to_json() for f in self.fix],
        }


def _decimals(printed: str | None) -> int:
    if not printed or "." not in printed:
        return 0
    return len(printed.split(".", 1)[1])


def unit(printed: str | None) -> float:
    """One unit of the last printed digit (see the module doc)."""
    return 10.0 ** -_decimals(printed) if printed and "." in printed else 0.0


def within(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol + 1e-9

