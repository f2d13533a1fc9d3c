"""Startup phases A–G: status, duration, memory delta and the phase's own numbers."""

from __future__ import annotations

import time
from typing import Any

from rich.text import Text
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey

from engine.events import PHASES
from engine.events.folds.startup_state import PhaseView
from engine.events.folds.view import EngineView
from engine.events.phase_data import ProfileRunData
from monitor.widgets.numbers import number

GiB = 1024**3
STATUS_STYLE = {"end": "green", "running": "yellow", "skipped": "dim", "failed": "bold red", "pending": "dim"}
STATUS_WORD = {"end": "done"}
MEASURE_SUFFIX = {"rss": " RSS", "used": " used"}  # allocated bytes (CUDA, simulated) need no word


def memory_delta_text(phase: PhaseView) -> str:
    """``+14.96`` (allocated), ``+0.28 RSS`` (CPU: the process's resident memory)."""
    if phase.memory_delta is None:
        return "-"
    return f"{phase.memory_delta / GiB:+.2f}{MEASURE_SUFFIX.get(phase.memory_measure or '', '')}"


BAR_CELLS = 12


def _amount(value: float, unit: str) -> str:
    return f"{value / GiB:.2f}" if unit == "bytes" else f"{value:,.0f}"


def progress_text(progress: dict[str, Any]) -> Text:
    """``weights 112/272 tensors (41%) ████░░░░░░░░``; without a total ``weights 112 tensors``."""
    done, total = float(progress.get("done") or 0), progress.get("total")
    unit = str(progress.get("unit") or "")
    shown_unit = " GiB" if unit == "bytes" else f" {unit}" if unit else ""
    text = Text(f"{progress.get('what') or 'progress'} ")
    if total:
        fraction = max(0.0, min(1.0, done / float(total)))
        text.append(f"{_amount(done, unit)}/{_amount(float(total), unit)}{shown_unit} ({fraction:.0%}) ")
        filled = int(BAR_CELLS * fraction)
        text.append("█" * filled, style="yellow")
        text.append("░" * (BAR_CELLS - filled), style="dim")
    else:
        text.append(f"{_amount(done, unit)}{shown_unit}")
    return text


def phase_detail(phase: PhaseView) -> str | Text:
    """A running (or failed) phase with progress shows how far it got; otherwise its numbers."""
    if phase.progress is not None and phase.status in ("running", "failed"):
        text = progress_text(phase.progress)
        if phase.reason:
            text.append(f"  {phase.reason}")
        return text
    if phase.reason:
        return phase.reason
    parts = []
    profile = ProfileRunData.from_dict(phase.data)  # phase D says when it reused a stored measurement
    for key, value in phase.data.items():
        if key == "measured_at":
            continue
        if key == "cached":  # phase D: a stored measurement was reused instead of a new profile run
            if profile.cached:
                when = profile.measured_at
                stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(when)) if isinstance(when, int | float) else "?"
                parts.append(f"reused measurement of {stamp}")
            continue
        if key.endswith("_bytes") and isinstance(value, int | float):
            parts.append(f"{key[:-6]} {value / GiB:.2f} GiB")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            parts.append(f"{key} {number(value)}")
        elif isinstance(value, str | bool):
            parts.append(f"{key} {value}")
    return ", ".join(parts)


def _short(seconds: float) -> str:
    return f"{seconds:.1f}" if seconds < 10 else f"{seconds:.0f}"


def duration_text(phase: PhaseView, now: float) -> str | Text:
    """``2.10``, or a running phase's ``12.3…``; with the startup's prediction (startup.eta)
    elapsed against predicted: ``12.3/~30`` running (red once past it), ``2.10/~2.5`` done."""
    predicted = phase.predicted_s
    if phase.duration_s is not None:
        return f"{phase.duration_s:.2f}" + (f"/~{_short(predicted)}" if predicted is not None else "")
    if phase.status == "running" and phase.started_t is not None:
        elapsed = max(0.0, now - phase.started_t)
        if predicted is None:
            return Text(f"{elapsed:.1f}…", style="yellow")
        return Text(f"{elapsed:.1f}/~{_short(predicted)}", style="red" if elapsed > predicted else "yellow")
    return f"~{_short(predicted)}" if predicted is not None and phase.status == "pending" else "-"


# Fixed widths for the short columns; details takes the rest and wraps, so a phase's
# numbers are all on screen at 120 columns.
FIXED_COLUMNS = (("phase", 5), ("name", 14), ("status", 7), ("duration s", 10), ("memory Δ GiB", 12))
MIN_DETAILS_WIDTH = 24


class StartupTable(DataTable[object]):
    _view: EngineView | None = None
    _now: float | None = None

    def on_mount(self) -> None:
        self.cursor_type = "row"
        for name, width in FIXED_COLUMNS:
            self.add_column(name, key=name, width=width)
        self.add_column("details", key="details", width=self._details_width())

    def _details_width(self) -> int:
        fixed = sum(width + 2 * self.cell_padding for _, width in FIXED_COLUMNS)
        available = (self.size.width or 120) - fixed - 2 * self.cell_padding - 1  # 1: the vertical scrollbar
        return max(MIN_DETAILS_WIDTH, available)

    def on_resize(self) -> None:
        details = self.columns.get(ColumnKey("details"))
        if details is not None and details.width != self._details_width():
            details.width = self._details_width()
            if self._view is not None:
                self.update_view(self._view, self._now)

    def update_view(self, view: EngineView, now: float | None = None) -> None:
        """``now``: the engine clock, for a running phase's elapsed time (default: the view's)."""
        self._view, self._now = view, now
        now = view.t if now is None else now
        self.clear()
        for letter, name in PHASES.items():
            phase = view.phases.get(letter, PhaseView(phase=letter, name=name))
            status = Text(STATUS_WORD.get(phase.status, phase.status), style=STATUS_STYLE.get(phase.status, ""))
            duration = duration_text(phase, now)
            self.add_row(letter, phase.name, status, duration, memory_delta_text(phase), phase_detail(phase),
                         key=letter, height=None)
        for rank, phases in sorted(view.rank_phases.items()):
            self.add_row(*rank_row(rank, phases, view), key=f"rank{rank}", height=None)


def rank_row(rank: int, phases: dict[str, PhaseView], view: EngineView) -> tuple[str | Text, ...]:
    """Tensor parallelism: one row per other rank (rank 0's are the rows above): its
    phases' durations, and which rank is the slowest, whose startup is the replica's."""
    latest = next((phases[letter] for letter in reversed(PHASES) if letter in phases), None)
    status_word = latest.status if latest is not None else "pending"
    status = Text(STATUS_WORD.get(status_word, status_word), style=STATUS_STYLE.get(status_word, ""))
    total = sum(p.duration_s or 0.0 for p in phases.values())
    totals = {0: sum(p.duration_s or 0.0 for p in view.phases.values())} | {
        r: sum(p.duration_s or 0.0 for p in ps.values()) for r, ps in view.rank_phases.items()}
    slowest = max(totals, key=lambda r: totals[r])
    detail = " ".join(f"{letter} {phases[letter].duration_s:.2f}" for letter in PHASES
                      if letter in phases and phases[letter].duration_s is not None)
    if latest is not None and latest.status == "failed" and latest.reason:
        detail += f"; {latest.phase} failed: {latest.reason}"
    elif rank == max(view.rank_phases):
        detail += f"; slowest: rank {slowest} ({totals[slowest]:.2f} s, the replica's startup)"
    return f"r{rank}", f"rank {rank}", status, f"{total:.2f}", "", detail
