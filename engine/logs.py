"""structlog, configured once: a console renderer on a tty, JSON lines otherwise.

Log lines are a sink of the same facts the events carry; the vLLM-format lines
("CPU KV cache size: N tokens", the periodic stats line) are emitted as the
message text so ``logparse`` can read kvscope's own logs.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_configured: str | None = None


def configure_logging(fmt: str = "auto", level: str = "info", stream: Any = None) -> None:
    """``fmt``: ``auto`` (console on a tty, JSON otherwise), ``console`` or ``json``.
    Safe to call again; the latest call wins."""
    global _configured
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    if fmt not in ("console", "json"):
        raise ValueError(f"--log-format {fmt!r}: use auto, console or json")
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=True) if fmt == "console" else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=False),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _configured = fmt


def get_logger(name: str = "kvscope") -> Any:
    if _configured is None:
        configure_logging()
    return structlog.get_logger(name)
