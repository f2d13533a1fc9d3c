"""The title line: what the monitor shows and, live, whether the feed is connected."""

from __future__ import annotations

import time
from typing import Any

from rich.text import Text
from textual.widgets import Static

from engine.events.feed import CONNECTING, DISCONNECTED, LIVE, REFUSED, Connection

BADGE = {
    CONNECTING: ("◌ CONNECTING", "bold yellow"),
    LIVE: ("● LIVE", "bold green"),
    REFUSED: ("✕ REFUSED", "bold red"),
    DISCONNECTED: ("○ DISCONNECTED", "bold red"),
}


def connection_text(connection: Connection, now: float | None = None) -> Text:
    """``● LIVE``, ``✕ REFUSED 401: pass --api-key``, ``○ DISCONNECTED the server
    dropped the stream · retry 2 in 3 s``..."""
    word, style = BADGE.get(connection.state, (connection.state.upper(), "bold"))
    text = Text(word, style=style)
    if connection.reason:
        text.append(f" {connection.reason}")
    if connection.state == DISCONNECTED:
        if connection.retry_at is None:
            text.append(" · reconnecting…", style="dim")
        else:
            wait = max(0.0, connection.retry_at - (time.monotonic() if now is None else now))
            text.append(f" · retry {connection.attempt} in {wait:.0f} s", style="dim")
    return text


def stall_text(rank: int, stall: dict[str, Any]) -> str:
    """``rank 1 in forward, no step for 42 s (limit 30 s)``: what an ``engine.stalled`` said."""
    return (f"rank {rank} in {stall.get('phase') or '?'}, no step for {float(stall.get('stalled_s') or 0):,.0f} s "
            f"(limit {float(stall.get('limit_s') or 0):,.0f} s)")


def middle_cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells, cut in the middle (``http://…:8000/events``)."""
    if len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


class TitleBar(Static):
    """``kvscope monitor · SOURCE`` and, for a live feed, its connection badge, the DP rank
    the dashboard follows (``followed``: ``DP rank 1 of 2``; with several ranks), any engine
    core stalled (``engine.stalled`` until ``engine.recovered``: ``⏸ STALLED rank 1 in
    forward``), then any event sink the engine stopped (``sink.failed``: a full disk under
    ``--events``). When the line is too long the source is cut in its middle, never the
    badges or why."""

    def show(self, source: str, connection: Connection | None, failed_sinks: dict[str, str] | None = None,
             engine_error: str | None = None, followed: str = "",
             stalled: dict[int, dict[str, Any]] | None = None) -> None:
        badge = Text("  ").append_text(connection_text(connection)) if connection is not None else Text()
        if followed:
            badge.append("  ").append(f"◆ {followed}", style="bold magenta")
        for rank, stall in sorted((stalled or {}).items()):
            badge.append("  ⏸ STALLED ", style="bold red").append(stall_text(rank, stall))
        if engine_error:
            badge.append("  ✕ ENGINE STOPPED ", style="bold red").append(engine_error)
        if failed_sinks:  # the engine serves on, but a recording or an exporter has stopped
            badge.append("  ⚠ STOPPED ", style="bold red").append(", ".join(sorted(failed_sinks)))
        width = (self.content_region.width or self.size.width or 200)
        room = width - len("kvscope monitor · ") - badge.cell_len
        text = Text(f"kvscope monitor · {middle_cut(source, max(12, room))}")
        text.append_text(badge)
        self.update(text)
