"""Per-step charts: prefill vs decode tokens, running and waiting, KV usage %,
step time, with preemptions marked on a ruler under the charts.

Every chart has a y axis (its lowest and highest value shown, which are what the
sparkline spans) and one column per step, so the preemption ruler and the step
axis under the charts line up with the bars."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline, Static

from engine.events.folds.view import EngineView
from monitor.widgets.numbers import number

CHARTS = (
    ("prefill", "prefill tokens"),
    ("decode", "decode tokens"),
    ("running", "running"),
    ("waiting", "waiting"),
    ("kv_pct", "KV usage %"),
    ("step_ms", "step time ms"),
)
AXIS_WIDTH = 9  # "  1,013 ┤"


def y_axis(low: float, high: float) -> Text:
    """Two lines: the chart's top value, then its bottom value, right-aligned before a tick."""
    width = AXIS_WIDTH - 2
    return Text(f"{number(high):>{width}} ┤\n{number(low):>{width}} ┤", style="dim", no_wrap=True)


class StepCharts(Vertical):
    """One sparkline per series over the last steps that fit the width (one column per step)."""

    def compose(self) -> ComposeResult:
        for key, _title in CHARTS:
            yield Label("", id=f"chart-label-{key}", classes="chart-label")
            with Horizontal(classes="chart-row"):
                yield Static("", id=f"chart-axis-{key}", classes="chart-y")
                yield Sparkline([], id=f"chart-{key}", classes="chart", summary_function=max)
        yield Static("", id="chart-preemptions")
        yield Static("", id="chart-axis")

    _view: EngineView | None = None

    def on_resize(self) -> None:
        if self._view is not None:
            self.update_view(self._view)

    def update_view(self, view: EngineView) -> None:
        self._view = view
        width = max(10, (self.size.width or 100) - AXIS_WIDTH - 1)
        series = view.series
        for key, title in CHARTS:
            values = list(series[key])[-width:]
            latest = values[-1] if values else 0
            low, high = (min(values), max(values)) if values else (0, 0)
            label = Text(f"{title}  ", style="bold")
            label.append(f"now {number(latest)}")
            self.query_one(f"#chart-label-{key}", Label).update(label)
            self.query_one(f"#chart-axis-{key}", Static).update(y_axis(low, high))
            spark = self.query_one(f"#chart-{key}", Sparkline)
            spark.styles.width = max(1, len(values))  # one column per step, also while there are few
            spark.data = values or [0.0]
        pad = " " * AXIS_WIDTH
        preempted = list(series["preempted"])[-width:]
        ruler = Text(pad)
        for count in preempted:
            ruler.append("▲" if count else "─", style="bold red" if count else "dim")
        ruler.append(f"  preemptions in {sum(1 for c in preempted if c)} of these steps")
        self.query_one("#chart-preemptions", Static).update(ruler)
        steps = list(series["step"])[-width:]
        if steps:
            first, last = f"step {int(steps[0])}", f"{int(steps[-1])}"
            axis = pad + first + " " * max(1, len(steps) - len(first) - len(last)) + last
        else:
            axis = pad + "no steps yet"
        self.query_one("#chart-axis", Static).update(Text(axis, style="dim", no_wrap=True))
