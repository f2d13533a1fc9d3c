"""Is the log whole? A log pasted into an issue is cut more often than not: it starts in the
middle (the version and engine config lines gone, or inside a traceback), it ends inside a
traceback (the exception line that names the failure gone), or it ends before the server is
ready. Each cut is named with what is missing and which of logparse's checks it limits, so
"no check failed" is never read as "healthy" when the lines that would fail are not there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from logparse.parser import Record
from logparse.patterns import PHASE_NAMES

STARTUP_PHASES = "ABCDEFG"
_FRAGMENT = re.compile(r"^(?:\[[\w.\-/]+\.py:\d+\]|[a-z_]\w*[,)\]]|[\^~]{3,}|\s)")  # a line's tail, not its start
# What the lines of each phase give the checks, for a log that never reaches it.
PHASE_GIVES = {
    "C": "the weights figure (non-KV = weights + activation + non-torch)",
    "D": "the activation peak and non-torch figures (non-KV, KV = requested - non-KV)",
    "E": "the KV pool, its tokens and concurrency (tokens x bytes, concurrency, KV below max-model-len)",
    "F": "the CUDA-graph pool",
    "G": "whether the server came up at all",
}
# Facts the start of a log prints, and the checks that need each.
HEAD_FACTS = (
    ("vllm_version", "the vLLM version", "which release's formats apply"),
    ("model", "the model", "kvscope's plan and bytes per token (pass --model)"),
    ("max_model_len", "max-model-len", "concurrency = tokens / max-model-len and KV below max-model-len"),
    ("gpu_memory_utilization", "--gpu-memory-utilization", "requested = total x utilization (pass "
     "--gpu-memory-utilization)"),
)


@dataclass(slots=True)
class Cut:
    """One way the log is not whole."""

    kind: str  # starts_mid_stream | ends_mid_traceback | ends_before_ready
    line: int
    missing: str
    limits: list[str] = field(default_factory=list)

    def sentence(self) -> str:
        words = {"starts_mid_stream": "starts mid-stream", "ends_mid_traceback": "ends mid-traceback",
                 "ends_before_ready": "ends before the server is ready"}[self.kind]
        limits = f"; this limits: {'; '.join(self.limits)}" if self.limits else ""
        return f"log cut: {words} (line {self.line}): missing {self.missing}{limits}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "line": self.line, "missing": self.missing, "limits": list(self.limits),
                "sentence": self.sentence()}


class CompletenessWatch:
    """Fed the fold's records (and counted runs) in order: how the log begins, the phases it reaches."""

    def __init__(self) -> None:
        self.first_line: int | None = None
        self.first_is_tail = False  # the first record is the rest of something: a frame, a code line, a fragment
        self.phases: set[str] = set()

    def add(self, record: Record) -> None:
        if self.first_line is None and record.text.strip():
            self.first_line = record.line
            self.first_is_tail = record.noise == "traceback" or (
                record.pattern is None and record.template is None and bool(_FRAGMENT.match(record.raw)))
        phase = record.pattern.phase if record.pattern is not None else None
        if phase is not None and phase != "X":
            self.phases.add(phase)

    def add_run(self, first_line: int) -> None:
        if self.first_line is None:
            self.first_line = first_line
        self.phases.add("R")

    def cuts(self, facts: dict[str, Any], ends_in_traceback: bool, ready: bool, failed: bool,
             last_line: int) -> list[Cut]:
        out: list[Cut] = []
        head = self._head_cut(facts)
        if head is not None:
            out.append(head)
        if ends_in_traceback:
            out.append(Cut("ends_mid_traceback", last_line, "the exception line that ends the traceback (the "
                           "failure's own words)", ["the cause is read from the lines before the traceback only"]))
        elif not ready and not failed and self.phases:
            tail = self._tail_cut(last_line)
            if tail is not None:
                out.append(tail)
        return out

    def _head_cut(self, facts: dict[str, Any]) -> Cut | None:
        # every whole log prints its version and engine config (phase A) or its budget (B) first
        late_start = not self.phases & {"A", "B"}
        if self.first_line is None or not (self.first_is_tail or late_start):
            return None
        absent = [(name, limit) for key, name, limit in HEAD_FACTS if key not in facts]
        missing = "the lines before it" + (f": {', '.join(n for n, _ in absent)}" if absent else "")
        if self.first_is_tail:
            missing += " (it begins inside a record: a traceback frame or a line's tail)"
        return Cut("starts_mid_stream", self.first_line, missing, [limit for _, limit in absent])

    def _tail_cut(self, last_line: int) -> Cut | None:
        reached = max((p for p in self.phases if p in STARTUP_PHASES), default="A")
        later = [p for p in STARTUP_PHASES if p > reached]
        if not later:
            return None
        missing = "the lines after phase " + f"{reached} ({PHASE_NAMES[reached]}): " + ", ".join(
            f"{p} ({PHASE_NAMES[p]})" for p in later)
        return Cut("ends_before_ready", last_line, missing, [PHASE_GIVES[p] for p in later if p in PHASE_GIVES])
