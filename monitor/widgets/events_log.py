"""Recent events, newest last, filtered by a substring of their JSON form."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Input, Static

from engine.events import Event, dumps
from engine.events.view import EngineView

TYPE_STYLE = {"request.preempted": "bold red", "request.rejected": "red", "request.finished": "green",
              "request.arrived": "cyan", "startup.phase": "magenta", "log": "yellow"}


def event_line(event: Event) -> str:
    fields = {k: v for k, v in event.to_dict().items() if k not in ("type", "seq", "t") and v not in (None, [], {}, 0, 0.0, "")}
    return f"#{event.seq:<6} {event.t:9.3f}s {event.type:<20} {dumps(fields)}"


class EventsLog(Vertical):
    """An input to filter by, and the last matching events."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
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

    def matching(self) -> list[str]:
        if self._view is None:
            return []
        needle = self.filter_text
        lines = (event_line(e) for e in self._view.recent)
        return [line for line in lines if needle in line.lower()] if needle else list(lines)

    def _render_lines(self) -> None:
        from rich.text import Text

        text = Text(no_wrap=True, overflow="ellipsis")
        height = max(1, (self.size.height or 30) - 3)
        for line in self.matching()[-height:]:
            kind = line.split()[2] if len(line.split()) > 2 else ""
            text.append(line + "\n", style=TYPE_STYLE.get(kind, ""))
        self.query_one("#events-lines", Static).update(text)

    @on(Input.Changed, "#events-filter")
    def _filter_changed(self) -> None:
        self._render_lines()
