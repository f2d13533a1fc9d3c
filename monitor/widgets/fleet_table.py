"""The fleet: one row per replica (and one per DP rank under it), and the imbalance
across them.

Rows read :class:`monitor.replica.ReplicaState` only. A DP rank (vLLM's ``engine``
label) is a row of its own under its replica, so an unbalanced data-parallel
deployment shows as unequal rows rather than one averaged line."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rich.text import Text
from textual.widgets import DataTable, Static

from monitor.replica import CONNECTING, DISCONNECTED, LIVE, REFUSED, EngineState, ReplicaState
from monitor.widgets.numbers import number
from monitor.widgets.spark import spark
from monitor.widgets.title_bar import middle_cut

COLUMNS = ("replica", "status", "run", "wait", "KV %", "tok/s", "TTFT p50", "p99", "pre/min", "hit %", "tok/s trend")
STATUS = {LIVE: ("● live", "green"), CONNECTING: ("◌ connecting", "yellow"),
          DISCONNECTED: ("○ down", "bold red"), REFUSED: ("✕ refused", "bold red")}


def seconds(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}"


class FleetTable(DataTable[Text | str]):
    """The replicas' rows; the row key is the replica's source URL (Enter opens it)."""

    name_width = 28
    trend_width = 16

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        for column in COLUMNS:
            self.add_column(column, key=column)

    def update_states(self, states: Sequence[ReplicaState]) -> None:
        # The fixed columns take about 100 cells; the name and the trend share the rest.
        spare = max(0, (self.size.width or 120) - 100)
        self.name_width = 14 + min(26, spare // 2)
        self.trend_width = 8 + min(32, spare - min(26, spare // 2))
        rows: list[tuple[str, list[Text | str]]] = []
        for state in states:
            rows.append((state.source, self._replica_row(state)))
            if len(state.engines) > 1:
                for label, engine in state.engines.items():
                    rows.append((f"{state.source}#engine={label}", self._engine_row(label, engine)))
        keep = {key for key, _ in rows}
        for row_key in [k for k in list(self.rows) if k.value not in keep]:
            self.remove_row(row_key)
        existing = {k.value for k in self.rows}
        for key, cells in rows:
            if key in existing:
                for column, cell in zip(COLUMNS, cells, strict=True):
                    self.update_cell(key, column, cell)
            else:
                self.add_row(*cells, key=key)

    def _status(self, state: ReplicaState) -> Text:
        word, style = STATUS.get(state.status, (state.status, "bold"))
        text = Text(word, style=style)
        if state.status != LIVE and state.reason:
            text.append(f" {middle_cut(state.reason, 12)}", style="dim")
        return text

    def _replica_row(self, state: ReplicaState) -> list[Text | str]:
        live = state.status == LIVE and state.engines
        name = f"{state.kind[0].upper()} {middle_cut(state.source.removeprefix('http://'), self.name_width)}"
        if not state.engines:
            return [name, self._status(state), *["–"] * (len(COLUMNS) - 3), ""]
        style = "" if live else "dim"
        return [
            Text(name, style=style), self._status(state),
            Text(number(state.total("running")), style=style), Text(number(state.total("waiting")), style=style),
            Text(f"{100 * state.kv_usage():.0f}", style=style), Text(number(round(state.total("gen_tps"), 1)), style=style),
            Text(seconds(state.quantile("ttft", 0.5)), style=style), Text(seconds(state.quantile("ttft", 0.99)), style=style),
            Text(number(round(state.total("preempt_per_min"), 1)), style=style), Text(percent(state.hit_rate()), style=style),
            Text(spark(state.series("gen_tps"), self.trend_width), style="cyan" if live else "dim"),
        ]

    def _engine_row(self, label: str, engine: EngineState) -> list[Text | str]:
        latest = engine.latest
        if latest is None:
            return [f"  └ engine {label}", "", *["–"] * (len(COLUMNS) - 3), ""]
        return [
            Text(f"  └ engine {label}", style="dim"), "", number(latest.running), number(latest.waiting),
            f"{100 * latest.kv_usage:.0f}", number(round(engine.gen_tps, 1)), seconds(engine.quantile("ttft", 0.5)),
            seconds(engine.quantile("ttft", 0.99)), number(round(engine.preempt_per_min, 1)), percent(engine.hit_rate),
            Text(spark(engine.series["gen_tps"], self.trend_width), style="dim cyan"),
        ]


def imbalance(states: Sequence[ReplicaState]) -> Text:
    """How unequal the live engines are (every DP rank of every replica): the spread
    of running requests, waiting requests and KV usage, and the busiest engine."""
    engines = [(s.source, label, e.latest) for s in states if s.status == LIVE
               for label, e in s.engines.items() if e.latest is not None]
    down = sum(1 for s in states if s.status in (DISCONNECTED, REFUSED))
    text = Text("imbalance  ", style="bold")
    if len(engines) < 2:
        text.append("needs two live engines" + (f" · {down} replica(s) down" if down else ""), style="dim")
        return text
    for title, values, unit in (
        ("running", [m.running for _, _, m in engines], ""),
        ("waiting", [m.waiting for _, _, m in engines], ""),
        ("KV", [100 * m.kv_usage for _, _, m in engines], "%"),
    ):
        low, high = min(values), max(values)
        mean = statistics.fmean(values)
        spread = (statistics.pstdev(values) / mean) if mean > 0 else 0.0
        text.append(f"{title} {number(round(low))}{unit}–{number(round(high))}{unit} ")
        text.append(f"(cv {spread:.2f})  ", style="bold red" if spread > 0.5 else "dim")
    busiest = max(engines, key=lambda e: (e[2].running + e[2].waiting, e[2].kv_usage))
    text.append(f"busiest {middle_cut(busiest[0].removeprefix('http://'), 24)} engine {busiest[1]}", style="dim")
    if down:
        text.append(f" · {down} down", style="bold red")
    return text


class FleetSummary(Static):
    def update_states(self, states: Sequence[ReplicaState]) -> None:
        self.update(imbalance(states))
