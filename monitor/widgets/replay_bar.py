"""The status line of the player: position, play state, speed, source."""

from __future__ import annotations

from textual.widgets import Static


class ReplayBar(Static):
    def show(self, *, source: str, step: int | None, position: int, length: int, playing: bool,
             speed: float, live: bool) -> None:
        if live:
            self.update(f"● LIVE  {source}  ·  step {step if step is not None else '-'}")
            return
        state = "▶ playing" if playing else "⏸ paused"
        self.update(
            f"{state} ×{speed:g}  ·  step {step if step is not None else '-'}"
            f"  ({position + 1 if length else 0}/{length})  ·  {source}"
        )
