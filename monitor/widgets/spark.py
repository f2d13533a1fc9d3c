"""A sparkline as text (``▁▂▅█``), for table cells and panel lines where Textual's
Sparkline widget (one widget per chart) does not fit."""

from __future__ import annotations

from collections.abc import Sequence

BARS = "▁▂▃▄▅▆▇█"


def spark(values: Sequence[float], width: int) -> str:
    """The last ``width`` values as bars scaled from 0 to their maximum (an all-zero
    series is a flat line, an empty one blank), right-aligned in ``width`` cells."""
    tail = list(values)[-width:] if width > 0 else []
    if not tail:
        return " " * max(0, width)
    top = max(tail)
    if top <= 0:
        line = BARS[0] * len(tail)
    else:
        line = "".join(BARS[min(len(BARS) - 1, int(v / top * (len(BARS) - 1) + 0.5))] if v > 0 else BARS[0]
                       for v in tail)
    return line.rjust(width)
