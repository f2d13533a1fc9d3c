"""The fold of a log's records as they stream past: the first value of each startup figure,
each phase's span of lines and times, the failures with the phase before each, preemptions,
coverage, tracebacks, and the watches of a failed start, a cut log and the phases' seconds."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from engine.events.phase_names import PHASE_SPANS, vllm_group
from logparse.completeness import CompletenessWatch
from logparse.coverage import Coverage
from logparse.failed_start import StartupWatch
from logparse.fastscan import BulkRun
from logparse.parser import Record
from logparse.patterns import PHASE_NAMES
from logparse.reconcile import hybrid_hint
from logparse.startup_phases import PhaseClock
from logparse.tracebacks import TracebackTracker

STARTUP_PHASES = "ABCDEFG"
MAX_KEPT_RECORDS = 10_000  # records explain keeps to show (each up to ~18 kB); the fold sees every one


@dataclass(slots=True)
class PhaseSpan:
    phase: str
    first_line: int
    last_line: int
    first_time: str | None = None
    last_time: str | None = None
    records: int = 0
    durations: dict[str, float] = field(default_factory=dict)

    @property
    def span_s(self) -> float | None:
        if not self.first_time or not self.last_time:
            return None
        try:
            a = datetime.strptime("2000-" + self.first_time, "%Y-%m-%d %H:%M:%S")
            b = datetime.strptime("2000-" + self.last_time, "%Y-%m-%d %H:%M:%S")
        except ValueError:
            return None
        return (b - a).total_seconds()

    @property
    def span_name(self) -> str:
        """The phase under vLLM's startup span name (engine/events/phase_names.py), so a
        timeline read from a log and a trace of the same start use the same words; R and X,
        which no span covers, keep logparse's own names."""
        span = PHASE_SPANS.get(self.phase)
        return span.span_name if span else PHASE_NAMES.get(self.phase, self.phase)

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "name": self.span_name,
            "vllm_span": vllm_group(self.phase) if self.phase in PHASE_SPANS else None,
            "first_line": self.first_line,
            "last_line": self.last_line,
            "first_time": self.first_time,
            "last_time": self.last_time,
            "span_s": self.span_s,
            "records": self.records,
            "durations": dict(self.durations),
        }


class RecordFold:
    """What explain keeps of the records as they stream past: the first value of each
    startup figure (runtime readings, phase R, are series and stay with their records),
    the phase spans, the failures with the startup phase before each, preemptions, the
    coverage and the tracebacks' frames."""

    def __init__(self, keep_records: bool) -> None:
        self.keep_records = keep_records
        self.records: list[Record] = []
        self.facts: dict[str, Any] = {}
        self.printed: dict[str, str] = {}
        self.fact_lines: dict[str, int] = {}
        self.spans: dict[str, PhaseSpan] = {}
        self.failures: list[tuple[Record, str]] = []  # (record, last startup phase before it)
        self.preemptions_v0 = self.preemptions_v1 = 0
        self.preemption_line: int | None = None
        self.last_phase = "A"
        self.coverage = Coverage()
        self.tracebacks = TracebackTracker()
        self.watch = StartupWatch()
        self.complete = CompletenessWatch()
        self.clock = PhaseClock()
        self.last_line = 0

    def add(self, record: Record) -> None:
        if self.keep_records and len(self.records) < MAX_KEPT_RECORDS:
            self.records.append(record)  # past the cap the log is folded, not kept: memory stays bounded
        self.coverage.add(record)
        if "hybrid_hint_line" not in self.facts and hybrid_hint(record.text):
            self.facts["hybrid_hint_line"] = record.line  # a hybrid KV layout: concurrency counts per group
        self.tracebacks.add(record)
        self.watch.add(record, self.last_phase)
        self.complete.add(record)
        self.last_line = record.end_line
        pattern = record.pattern
        if pattern is None:
            return
        self.clock.add(pattern.phase if record.duplicate_of is None else None, record.line, record.time)
        if pattern.phase != "R":
            for name, value in record.fields.items():
                if name not in self.facts:
                    self.facts[name] = value
                    self.fact_lines[name] = record.line
                    if name in record.printed:
                        self.printed[name] = record.printed[name]
        span = self._span(pattern.phase, record.line, record.time)
        span.last_line = record.line
        span.records += 1
        if record.time:
            span.first_time = span.first_time or record.time
            span.last_time = record.time
        for name, value in record.fields.items():
            if name.endswith("_s") and isinstance(value, int | float) and name not in span.durations:
                span.durations[name] = float(value)
        if pattern.failure == "preemption":
            self.preemptions_v0 = max(self.preemptions_v0, int(record.fields.get("preemptions_total", 1)))
            self.preemption_line = self.preemption_line or record.line
        elif pattern.failure and record.duplicate_of is None:
            self.failures.append((record, self.last_phase))
        if "preemptions" in record.fields:
            self.preemptions_v1 += int(record.fields["preemptions"])
            self.preemption_line = self.preemption_line or record.line
        if pattern.phase in STARTUP_PHASES:
            self.last_phase = pattern.phase

    def add_run(self, run: BulkRun) -> None:
        """A run of stats/access lines (phase R, no durations, no failures), counted."""
        self.coverage.add_bulk(run)
        self.tracebacks.interrupt()
        self.watch.add_run(run.first_line)
        self.complete.add_run(run.first_line)
        self.clock.add("R", run.first_line, run.first_time)
        self.last_line = run.last_line
        for pattern in run.patterns:
            span = self._span(pattern.phase, run.first_line, run.first_time)
            span.last_line = max(span.last_line, run.last_line)
            span.records += run.counts[pattern.id]
            if run.first_time:
                span.first_time = span.first_time or run.first_time
            if run.last_time:
                span.last_time = run.last_time
        if run.preemption_line is not None:
            self.preemptions_v1 += run.preemptions
            self.preemption_line = self.preemption_line or run.preemption_line

    def _span(self, phase: str, line: int, time: str | None) -> PhaseSpan:
        span = self.spans.get(phase)
        if span is None:
            span = self.spans[phase] = PhaseSpan(phase, line, line, time, time)
        return span
