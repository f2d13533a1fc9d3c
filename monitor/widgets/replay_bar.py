"""The status line of the player: position, play state, speed, source."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from engine.events.feed import Connection
from monitor.widgets.title_bar import BADGE


class ReplayBar(Static):
    def show(self, *, source: str, step: int | None, position: int, length: int, playing: bool,
             speed: float, live: bool, connection: Connection | None = None, now: float | None = None) -> None:
        clock = f"  ·  t {now:.2f} s" if now is not None else ""
        if live:
            word, style = BADGE.get(connection.state, ("● LIVE", "")) if connection else BADGE["live"]
            text = Text(word, style=style)
            text.append(f"  {source}  ·  step {step if step is not None else '-'}{clock}")
            self.update(text)
            return
        state = "▶ playing" if playing else "⏸ paused"
        self.update(
            f"{state} ×{speed:g}  ·  step {step if step is not None else '-'}"
            f"  ({position + 1 if length else 0}/{length}){clock}  ·  {source}"
        )
