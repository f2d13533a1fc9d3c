"""Per-step charts: prefill vs decode tokens, running and waiting, KV usage %,
step time, with preemptions marked on a ruler under the charts."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Sparkline, Static

from engine.events.view import EngineView

CHARTS = (
    ("prefill", "prefill tokens"),
    ("decode", "decode tokens"),
    ("running", "running"),
    ("waiting", "waiting"),
    ("kv_pct", "KV usage %"),
    ("step_ms", "step time ms"),
)
LABEL_WIDTH = 24


class StepCharts(Vertical):
    """One sparkline per series over the last steps that fit the width (one column per step)."""

    def compose(self) -> ComposeResult:
        for key, _title in CHARTS:
            yield Label("", id=f"chart-label-{key}", classes="chart-label")
            yield Sparkline([], id=f"chart-{key}", classes="chart", summary_function=max)
        yield Static("", id="chart-preemptions")
        yield Static("", id="chart-axis")

    def update_view(self, view: EngineView) -> None:
        width = max(10, (self.size.width or 100) - 2)
        series = view.series
        for key, title in CHARTS:
            values = list(series[key])[-width:]
            latest = values[-1] if values else 0
            peak = max(values) if values else 0
            self.query_one(f"#chart-label-{key}", Label).update(f"{title}: {latest:.4g} (max {peak:.4g})")
            self.query_one(f"#chart-{key}", Sparkline).data = values or [0.0]
        preempted = list(series["preempted"])[-width:]
        ruler = Text()
        for count in preempted:
            ruler.append("▲" if count else "─", style="bold red" if count else "dim")
        ruler.append(f"  preemptions: {sum(1 for c in preempted if c)} steps shown")
        self.query_one("#chart-preemptions", Static).update(ruler)
        steps = list(series["step"])[-width:]
        axis = f"steps {int(steps[0])} … {int(steps[-1])}" if steps else "no steps yet"
        self.query_one("#chart-axis", Static).update(Text(axis, style="dim"))
