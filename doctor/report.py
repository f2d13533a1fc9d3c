"""The doctor's answer, as text (rich on a terminal, plain in a pipe) or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from doctor.rules.finding import CRITICAL, Finding, exit_status

STYLE = {CRITICAL: "bold red", "warning": "yellow"}
STATUS_WORDS = {0: "healthy", 1: "warnings", 2: "critical"}
CUT_NOTE = "log cut:"  # logparse/completeness.py's notes: the verdict covers only the lines the log has


def to_json(source: str, kind: str, findings: Sequence[Finding], notes: Sequence[str] = ()) -> dict[str, Any]:
    status = exit_status(findings)
    return {"source": source, "kind": kind, "status": STATUS_WORDS[status], "exit_status": status,
            "log_cut": any(n.startswith(CUT_NOTE) for n in notes),
            "findings": [f.to_json() for f in findings], "notes": list(notes)}


def render_json(source: str, kind: str, findings: Sequence[Finding], notes: Sequence[str] = ()) -> str:
    return json.dumps(to_json(source, kind, findings, notes), indent=2)


def finding_lines(finding: Finding, markup: bool = True) -> list[str]:
    """One finding as lines; ``markup`` adds rich styles (escaped text otherwise plain)."""
    from rich.markup import escape

    def txt(text: str) -> str:
        return escape(text) if markup else text

    head = f"{finding.severity.upper()} {finding.title} ({finding.where})"
    style = STYLE.get(finding.severity, "")
    lines = [f"[{style}]{txt(head)}[/]" if markup and style else txt(head)]
    lines += [f"  evidence: {txt(e)}" for e in finding.evidence]
    lines.append(f"  cause: {txt(finding.cause)}")
    lines += [f"  fix: {txt(fix.text())}" for fix in finding.fixes]
    return lines


def render_text(source: str, kind: str, findings: Sequence[Finding], notes: Sequence[str] = (),
                markup: bool = True) -> str:
    status = exit_status(findings)
    cut = " (as far as the log goes: it is cut, see the notes)" if any(n.startswith(CUT_NOTE) for n in notes) else ""
    lines = [f"kvscope doctor: {source} ({kind}): {STATUS_WORDS[status]}{cut}, "
             f"{len(findings)} finding{'' if len(findings) == 1 else 's'}"]
    for finding in findings:
        lines.append("")
        lines += finding_lines(finding, markup)
    if notes:
        lines.append("")
        lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)
