"""Numbers as a person reads them: thousands separated, as many decimals as the size
needs (``47,620``, ``92.5``, ``8.51``, ``0.704``), never ``4.762e+04`` or 17 digits."""

from __future__ import annotations

import math


def number(value: float | int) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if value == int(value) and abs(value) >= 1:
        return f"{int(value):,}"
    size = abs(value)
    if size >= 1000:
        text = f"{value:,.0f}"
    elif size >= 100:
        text = f"{value:.1f}"
    elif size >= 1:
        text = f"{value:.2f}"
    elif size >= 0.001:
        text = f"{value:.3f}"
    elif size == 0:
        return "0"
    else:
        return f"{value:.1e}"
    return text.rstrip("0").rstrip(".") if "." in text else text
