"""The request panel: the life of the request picked in the queues (Enter or a click on
its row), step by step, from the event layer's fold (engine/events/folds/request_record.py):
when it arrived, each run of steps it waited and why, where its prefix-cache match
stopped, its prefill chunks, preemptions (for whom, what it held), decode runs and gaps,
blocks held and its finish. A request of a session adds the session's turns
(engine/events/folds/sessions.py): the previous turn's blocks still resident at each, and the
request whose allocation evicted each lost one, at which step. Its blocks light up in the
block map meanwhile (the app sets the map's selection).

Like the Diagnosis panel it keeps its own fold: live, the app hands it the events it
drains; in replay, the recording's events up to the shown step (folded forward as the
player moves, from the start after a backward seek). Hidden until a request is picked,
so the layout is the queues' own until then.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import Static

from engine.events import Event
from engine.events.folds.request_record import RequestFold
from engine.events.folds.sessions import SessionFold

MAX_LINES = 14  # the newest lines of a long life; the rest is engine replay --request's
MAX_SESSION_LINES = 8  # the newest lines of its session's turns; the rest is engine replay --session's


class RequestPanel(Static):
    """The picked request's timeline; ``select(None)`` hides it."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id)
        self.lives = RequestFold()
        self.sessions = SessionFold()
        self.request_id: str | None = None
        self._folded = 0  # replay: how many of the recording's events are in self.lives

    def on_mount(self) -> None:
        self.display = False

    # ------------------------------------------------------------------ input
    def fold(self, events: Sequence[Event]) -> None:
        """Live: the events the app just drained."""
        for event in events:
            self.lives(event)
            self.sessions(event)
        if events:
            self._show_life()

    def show_until(self, events: Sequence[Event], end: int) -> None:
        """Replay: the recording's ``events[:end]`` (the shown step's end)."""
        if end < self._folded:
            self.lives, self.sessions, self._folded = RequestFold(), SessionFold(), 0
        for event in events[self._folded:end]:
            self.lives(event)
            self.sessions(event)
        self._folded = end
        self._show_life()

    def select(self, request_id: str | None) -> None:
        self.request_id = request_id
        self._show_life()

    # ----------------------------------------------------------------- render
    def timeline_text(self) -> Text:
        life = self.lives.get(self.request_id) if self.request_id is not None else None
        if life is None:
            return Text(f"{self.request_id}: no events of it yet at this step", style="dim")
        text = Text()
        text.append(f"{life.request_id}", style="bold")
        text.append(f"  {life.state} · {life.held_blocks} blocks · {len(life.preemptions)} preemptions\n", style="cyan")
        rows = life.timeline()
        if len(rows) > MAX_LINES:
            text.append(f"  … {len(rows) - MAX_LINES} earlier lines (engine replay --request {life.request_id})\n",
                        style="dim")
            rows = rows[-MAX_LINES:]
        for step, what in rows:
            text.append(f"  {'' if step is None else step:>6} ", style="cyan")
            text.append(f"{what}\n")
        return text.append_text(self.session_text(life.request_id))

    def session_text(self, request_id: str) -> Text:
        """The turns of the session ``request_id`` belongs to; empty when it names none."""
        session = next((s for s in self.sessions.sessions.values()
                        if any(t.request_id == request_id for t in s.turns)), None)
        if session is None:
            return Text()
        lines = session.render().splitlines()
        text = Text(lines[0] + "\n", style="bold")
        rest = lines[1:]
        if len(rest) > MAX_SESSION_LINES:
            text.append(f"  … {len(rest) - MAX_SESSION_LINES} earlier lines (engine replay --session {session.key})\n",
                        style="dim")
            rest = rest[-MAX_SESSION_LINES:]
        for line in rest:
            text.append(line + "\n", style="red" if "CONTEXT LOST" in line else "")
        return text

    def _show_life(self) -> None:
        if self.request_id is None:
            self.display = False
            return
        self.display = True
        self.update(self.timeline_text())
