"""Legends as one or more lines, wrapped between items and never inside one
(the block map's and the memory bar's)."""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text


def wrap_items(items: Iterable[Text], width: int) -> list[Text]:
    """``items`` two spaces apart, a new line wherever the next would pass ``width``."""
    lines: list[Text] = []
    line = Text()
    for item in items:
        if line.cell_len and line.cell_len + 2 + item.cell_len > width:
            lines.append(line)
            line = Text()
        if line.cell_len:
            line.append("  ")
        line.append_text(item)
    if line.cell_len:
        lines.append(line)
    return lines
