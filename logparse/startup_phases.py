"""A vLLM start's phase durations, from its log: what each phase A–G took, and the whole start.

vLLM prints some phases' own seconds, after each ends: loading the model ("Model loading took …
seconds", else "Initializing model took" + "Loading weights took"), the profiling run ("Memory
profiling takes", "Initial profiling/warmup run took"), compilation and CUDA graphs
("torch.compile takes … in total", "Graph capturing finished in"; else "init engine (profile,
create kv cache, warmup model) took" less the profiling run). Those figures are used as printed
(source ``printed``). The other phases are timed from the log's own timestamps (source ``log
times``, to the second): a phase begins at its first line after the previous phase began, in the
order A–G (vLLM's processes log some lines of a later phase early: the order keeps them out), and
lasts until the next phase begins. The whole start runs from the first timestamped line to the
last line of phase G before the first runtime line.

:class:`PhaseClock` is fed by logparse/fold.py's RecordFold, one record at a time, with bounded
memory; ``logparse explain`` prints the table, ``logparse diff`` and ``engine diff a.log b.log``
set two starts side by side phase by phase.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from engine.events.phase_names import PHASE_SPANS

STARTUP = "ABCDEFG"
MAX_POINTS = 4096  # timestamped lines kept per phase (a startup has a few dozen)
# vLLM's printed seconds per phase, in order of preference: each entry's figures are summed
PRINTED: dict[str, tuple[tuple[str, ...], ...]] = {
    "C": (("load_model_s",), ("init_model_s", "load_weights_s"), ("load_weights_s",)),
    "D": (("profile_s",), ("profile_warmup_s",)),
    "F": (("torch_compile_s", "graph_capture_s"), ("torch_compile_s",), ("graph_capture_s",)),
}


def log_seconds(a: str | None, b: str | None) -> float | None:
    """Seconds from vLLM's ``MM-DD HH:MM:SS`` stamp ``a`` to ``b`` (no year printed: a start
    across New Year reads as negative and gives None)."""
    if not a or not b:
        return None
    try:
        first = datetime.strptime("2000-" + a, "%Y-%m-%d %H:%M:%S")
        second = datetime.strptime("2000-" + b, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None
    seconds = (second - first).total_seconds()
    return seconds if seconds >= 0 else None


@dataclass(frozen=True, slots=True)
class PhaseTime:
    """One phase of a vLLM start: its first line and time, its seconds and where they came from
    (``printed``: vLLM's own figures, named in ``figures``; ``log times``; ``printed − D``: the
    init-engine line less the profiling run)."""

    phase: str
    line: int | None
    start: str | None
    seconds: float | None
    source: str
    figures: Mapping[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The phase under vLLM's startup span name (engine/events/phase_names.py)."""
        return PHASE_SPANS[self.phase].span_name

    def to_json(self) -> dict[str, Any]:
        return {"phase": self.phase, "name": self.name, "line": self.line, "start": self.start,
                "seconds": self.seconds, "source": self.source, "figures": dict(self.figures)}


@dataclass(slots=True)
class StartupTimes:
    """A vLLM start's phases in order, and the whole start's seconds (None without timestamps)."""

    phases: list[PhaseTime]
    total_s: float | None

    def get(self, phase: str) -> PhaseTime | None:
        return next((p for p in self.phases if p.phase == phase), None)

    def to_json(self) -> dict[str, Any]:
        return {"total_s": self.total_s, "phases": [p.to_json() for p in self.phases]}


class PhaseClock:
    """Fed each record's phase, line and time; :meth:`times` reads the phases off."""

    def __init__(self) -> None:
        self.points: dict[str, list[tuple[int, str]]] = {}
        self.first_time: str | None = None
        self.ready_end: str | None = None  # the last phase-G time before any runtime line
        self.runtime = False

    def add(self, phase: str | None, line: int, time: str | None) -> None:
        if time is None or phase is None:
            return
        self.first_time = self.first_time or time
        if phase == "R":
            self.runtime = True
        elif phase in STARTUP:
            points = self.points.setdefault(phase, [])
            if len(points) < MAX_POINTS:
                points.append((line, time))
            if phase == "G" and not self.runtime:
                self.ready_end = time

    def times(self, durations: Mapping[str, Mapping[str, float]]) -> StartupTimes:
        """The phases found, in order A–G; ``durations``: each phase's printed seconds
        (logparse/fold.py's spans)."""
        starts: list[tuple[str, int, str]] = []
        after = 0
        for phase in STARTUP:
            first = next(((line, t) for line, t in self.points.get(phase, ()) if line >= after), None)
            if first is not None:
                starts.append((phase, *first))
                after = first[0]
        out: list[PhaseTime] = []
        for i, (phase, line, start) in enumerate(starts):
            end = starts[i + 1][2] if i + 1 < len(starts) else self.ready_end if phase == "G" else None
            printed = printed_seconds(phase, durations)
            if printed is not None:
                out.append(PhaseTime(phase, line, start, *printed))
            else:
                out.append(PhaseTime(phase, line, start, log_seconds(start, end), "log times"))
        ready = self.ready_end if "G" in self.points else None
        return StartupTimes(_with_init_engine(out, durations), log_seconds(self.first_time, ready))


def printed_seconds(phase: str, durations: Mapping[str, Mapping[str, float]]) -> tuple[float, str, dict[str, float]] | None:
    """vLLM's own seconds for ``phase`` (the first of :data:`PRINTED`'s choices it printed)."""
    figures = {k: v for spans in durations.values() for k, v in spans.items()}
    for names in PRINTED.get(phase, ()):
        if all(n in figures for n in names):
            chosen = {n: figures[n] for n in names}
            return sum(chosen.values()), "printed", chosen
    return None


def _with_init_engine(phases: list[PhaseTime], durations: Mapping[str, Mapping[str, float]]) -> list[PhaseTime]:
    """Phase F from "init engine … took" less the profiling run, when vLLM printed no compile or
    graph figure: init engine covers D, E and F, and E (sizing the pool) takes no time."""
    figures = {k: v for spans in durations.values() for k, v in spans.items()}
    f = next((p for p in phases if p.phase == "F"), None)
    if "init_engine_s" not in figures or (f is not None and f.source == "printed"):
        return phases
    d = next((p for p in phases if p.phase == "D" and p.source == "printed"), None)
    seconds = max(0.0, figures["init_engine_s"] - (d.seconds or 0.0 if d else 0.0))
    chosen = {"init_engine_s": figures["init_engine_s"], **(dict(d.figures) if d else {})}
    replaced = PhaseTime("F", f.line if f else None, f.start if f else None, seconds,
                         "printed − D" if d else "printed", chosen)
    if f is None:
        return sorted([*phases, replaced], key=lambda p: p.phase)
    return [replaced if p is f else p for p in phases]


# ------------------------------------------------------------------ two starts
@dataclass(frozen=True, slots=True)
class PhaseDiffRow:
    phase: str
    name: str
    a: float | None
    b: float | None

    @property
    def difference(self) -> float | None:
        return self.b - self.a if self.a is not None and self.b is not None else None

    def to_json(self) -> dict[str, Any]:
        return {"phase": self.phase, "name": self.name, "a": self.a, "b": self.b, "difference": self.difference}


def diff_startups(a: StartupTimes, b: StartupTimes) -> list[PhaseDiffRow]:
    """Each phase either start has, in order A–G, then the whole start."""
    rows = []
    for phase in STARTUP:
        pa, pb = a.get(phase), b.get(phase)
        if pa is None and pb is None:
            continue
        rows.append(PhaseDiffRow(phase, PHASE_SPANS[phase].span_name, pa.seconds if pa else None, pb.seconds if pb else None))
    rows.append(PhaseDiffRow("total", "startup", a.total_s, b.total_s))
    return rows


def render_times(times: StartupTimes) -> list[str]:
    """The table ``logparse explain`` prints: phase, seconds, where they came from."""
    if not times.phases:
        return ["no startup phase has a timestamp in this log"]
    lines = [f"{'phase':<22} {'seconds':>9}  source"]
    for p in times.phases:
        seconds = f"{p.seconds:,.2f}" if p.seconds is not None else "-"
        figures = f" ({', '.join(f'{k} {v:g}' for k, v in p.figures.items())})" if p.figures else ""
        lines.append(f"{p.phase} {p.name:<20} {seconds:>9}  {p.source}{figures}")
    total = f"{times.total_s:,.0f}" if times.total_s is not None else "-"
    lines.append(f"{'whole start':<22} {total:>9}  log times (first line to ready)")
    return lines


def render_diff(rows: Sequence[PhaseDiffRow], name_a: str, name_b: str) -> list[str]:
    """``engine diff a.log b.log``'s table."""
    width = max(12, len(name_a), len(name_b))
    lines = [f"{'phase':<22} {name_a:>{width}} {name_b:>{width}} {'Δ s':>9}"]
    for r in rows:
        head = f"{r.phase} {r.name}" if r.phase != "total" else "whole start"
        cells = [f"{v:,.2f}" if v is not None else "-" for v in (r.a, r.b)]
        delta = f"{r.difference:+,.2f}" if r.difference is not None else ""
        lines.append(f"{head:<22} {cells[0]:>{width}} {cells[1]:>{width}} {delta:>9}")
    return lines


def run_engine_diff(a: str, b: str, as_json: bool = False) -> int:
    """``engine diff a.log b.log`` (the ``kvscope.logdiff`` entry point): two vLLM starts phase
    by phase. Exit 0 (vLLM logs are compared, not judged); a file that is not a readable log is
    a UserError."""
    import json

    from engine.errors import UserError
    from logparse.explain import explain
    from logparse.render import short_names

    times = []
    for path in (a, b):
        try:
            times.append(explain(path, keep_records=False).startup_times)
        except OSError as exc:
            raise UserError(f"{path}: cannot be read ({exc.strerror or exc}); give a vLLM log") from None
    rows = diff_startups(times[0], times[1])
    name_a, name_b = short_names(a, b)
    if as_json:
        print(json.dumps({"a": a, "b": b, "rows": [r.to_json() for r in rows],
                          "a_phases": times[0].to_json(), "b_phases": times[1].to_json()}, indent=2))
        return 0
    if not times[0].phases and not times[1].phases:
        raise UserError(f"{a} and {b}: neither log has a timestamped startup line; give vLLM server logs "
                        "(engine diff compares kvscope recordings too)")
    print(f"two vLLM startups, phase by phase (seconds; {name_a} = A, {name_b} = B)")
    print("\n".join(render_diff(rows, name_a, name_b)))
    for name, t in ((name_a, times[0]), (name_b, times[1])):
        sources = ", ".join(f"{p.phase} {p.source}" for p in t.phases)
        print(f"{name}: {sources or 'no phase found'}")
    return 0
