"""Recent events, newest last, as ``key=value`` lines with readable numbers,
filtered by a substring of the line."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Input, Static

from engine.events import Event
from engine.events.folds.view import EngineView
from monitor.widgets.numbers import number

TYPE_STYLE = {"request.preempted": "bold red", "request.rejected": "red", "request.finished": "green",
              "request.arrived": "cyan", "startup.phase": "magenta", "log": "yellow",
              "sink.failed": "bold red"}


LIST_SHOWN = 8  # longer lists of numbers (inter-token latencies) are summarised


def value_text(value: Any) -> str:
    """A field's value: numbers through :func:`number`, nested records compact."""
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, int | float):
        return number(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        numbers = [v for v in value if isinstance(v, int | float) and not isinstance(v, bool)]
        if len(value) > LIST_SHOWN and len(numbers) == len(value):  # a series: its shape, not every value
            ordered = sorted(numbers)
            return (f"[{len(ordered)} values: min {number(ordered[0])}, median {number(ordered[len(ordered) // 2])},"
                    f" max {number(ordered[-1])}]")
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    return str(value)


def event_parts(event: Event) -> tuple[str, list[str]]:
    """The line's head (``#340   1.758s request.scheduled   ``) and its ``key=value`` fields."""
    fields = {k: v for k, v in event.to_dict().items() if k not in ("type", "seq", "t") and v not in (None, [], {}, 0, 0.0, "")}
    return f"#{event.seq:<5} {event.t:8.3f}s {event.type:<19} ", [f"{k}={value_text(v)}" for k, v in fields.items()]


def event_line(event: Event) -> str:
    """``#340   1.758s request.scheduled   request_id=r31 queue_time_s=0.704 prefix_hit_tokens=256``"""
    head, fields = event_parts(event)
    return head + " ".join(fields)


def wrap_fields(head: str, fields: list[str], width: int) -> list[str]:
    """Rows of at most ``width``, cut between fields; continuation rows start under
    the first field (a field longer than a row is cut where it must be)."""
    indent = " " * (len(head) if len(head) <= width // 2 else 4)
    rows: list[str] = []
    row = head
    for field in fields:
        if row.strip() and row != head and len(row) + 1 + len(field) > width:
            rows.append(row)
            row = indent + field
        else:
            row = row + field if row == head else row + " " + field
        while len(row) > width:
            rows.append(row[:width])
            row = indent + row[width:]
    rows.append(row)
    return rows


class EventsLog(Vertical):
    """An input to filter by, and the last matching events."""

    def __init__(self, **kwargs: Any) -> None:  # Textual's name, id, classes, disabled
        super().__init__(**kwargs)
        self._view: EngineView | None = None

    def compose(self) -> ComposeResult:
        yield Input(placeholder="filter events (type, request id, any text)", id="events-filter")
        yield Static("", id="events-lines")

    def update_view(self, view: EngineView) -> None:
        self._view = view
        self._render_lines()

    @property
    def filter_text(self) -> str:
        return self.query_one("#events-filter", Input).value.strip().lower()

    def matching_events(self) -> list[Event]:
        if self._view is None:
            return []
        needle = self.filter_text
        events = list(self._view.recent)
        return [e for e in events if needle in event_line(e).lower()] if needle else events

    def matching(self) -> list[str]:
        return [event_line(e) for e in self.matching_events()]

    def _render_lines(self) -> None:
        """The newest matching events that fit, each whole: a long one continues on
        the next lines, indented under its fields."""
        height = max(1, (self.size.height or 30) - 3)
        width = max(40, (self.size.width or 120) - 1)
        shown: list[Text] = []
        used = 0
        for event in reversed(self.matching_events()):
            wrapped = wrap_fields(*event_parts(event), width)
            if used + len(wrapped) > height:
                break
            used += len(wrapped)
            shown.append(Text("\n".join(wrapped), style=TYPE_STYLE.get(event.type, "")))
        self.query_one("#events-lines", Static).update(Text("\n").join(reversed(shown)))

    def on_resize(self) -> None:
        if self._view is not None:
            self._render_lines()

    @on(Input.Changed, "#events-filter")
    def _filter_changed(self) -> None:
        self._render_lines()
