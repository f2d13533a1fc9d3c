"""Startup phases A–G: status, duration, memory delta and the phase's own numbers."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import DataTable

from engine.events import PHASES
from engine.events.phase_data import ProfileRunData
from engine.events.view import EngineView, PhaseView

GiB = 1024**3
STATUS_STYLE = {"end": "green", "running": "yellow", "skipped": "dim", "failed": "bold red", "pending": "dim"}
STATUS_WORD = {"end": "done"}
MEASURE_SUFFIX = {"rss": " RSS", "used": " used"}  # allocated bytes (CUDA, simulated) need no word


def memory_delta_text(phase: PhaseView) -> str:
    """``+14.96`` (allocated), ``+0.28 RSS`` (CPU: the process's resident memory)."""
    if phase.memory_delta is None:
        return "-"
    return f"{phase.memory_delta / GiB:+.2f}{MEASURE_SUFFIX.get(phase.memory_measure or '', '')}"


def phase_detail(phase: PhaseView) -> str:
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
        elif isinstance(value, float):
            parts.append(f"{key} {value:.4g}")
        elif isinstance(value, int | str | bool):
            parts.append(f"{key} {value}")
    return ", ".join(parts)


class StartupTable(DataTable[object]):
    def on_mount(self) -> None:
        self.cursor_type = "row"
        for name in ("phase", "name", "status", "duration s", "memory Δ GiB", "details"):
            self.add_column(name, key=name)

    def update_view(self, view: EngineView) -> None:
        self.clear()
        for letter, name in PHASES.items():
            phase = view.phases.get(letter, PhaseView(phase=letter, name=name))
            status = Text(STATUS_WORD.get(phase.status, phase.status), style=STATUS_STYLE.get(phase.status, ""))
            duration = f"{phase.duration_s:.2f}" if phase.duration_s is not None else "-"
            self.add_row(letter, phase.name, status, duration, memory_delta_text(phase), phase_detail(phase), key=letter)
