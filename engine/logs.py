"""structlog, configured once: vLLM's line format on a tty and a pipe alike
(``INFO 12-01 07:30:22 [startup.py:120] message``), JSON lines with ``--log-format json``.

Log lines are a sink of the same facts the events carry; the vLLM-format lines
("CPU KV cache size: N tokens", the periodic stats line) are emitted as the
message text so ``logparse`` can read kvscope's own logs.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Any

import structlog

_configured: str | None = None
_stream: Any = None  # where log lines go (the dashboard points it at os.devnull)


LOG_FORMATS = ("auto", "text", "json")  # "console" is kept as another name for "text"
_CALLSITE = structlog.processors.CallsiteParameterAdder(
    [structlog.processors.CallsiteParameter.FILENAME, structlog.processors.CallsiteParameter.LINENO],
    additional_ignores=[__name__],  # log_failure's lines name its caller, not this module
)


_REQUEST_CONTEXT = ("request_id", "trace_id")  # bound per request by the server's routes


def vllm_line(_logger: Any, _method: str, event_dict: dict[str, Any]) -> str:
    """``LEVEL MM-DD HH:MM:SS [file.py:line] message key=value ...``: vLLM's own layout,
    so operators' greps and logparse read kvscope's logs as they read vLLM's."""
    level = str(event_dict.pop("level", "info")).upper()
    stamp = event_dict.pop("timestamp", "")
    where = f"{event_dict.pop('filename', '?')}:{event_dict.pop('lineno', 0)}"
    message = str(event_dict.pop("event", ""))
    # a request's bound context (request_id, trace_id) is left off a line that already names it,
    # so vLLM's own lines ("Received request <id>: ...") stay exactly vLLM's
    extras = " ".join(f"{k}={v}" for k, v in event_dict.items()
                      if not k.startswith("_") and not (k in _REQUEST_CONTEXT and str(v) in message))
    return f"{level} {stamp} [{where}] {message}" + (f" {extras}" if extras else "")


class _CurrentStderr:
    """Whatever ``sys.stderr`` is when a line is written, not when logging was set up:
    a redirected or replaced stderr (a test's capture, a daemon's reopen) is followed,
    and a closed one left behind is never written to."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(fmt: str = "auto", level: str = "info", stream: Any = None) -> None:
    """``fmt``: ``auto`` or ``text`` (vLLM's line format, on a tty and a pipe alike) or
    ``json`` (one JSON object per line, ISO timestamps). Safe to call again; the
    latest call wins."""
    global _configured, _stream
    stream = stream or _CurrentStderr()
    _stream = stream
    if fmt in ("auto", "console"):
        fmt = "text"
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format {fmt!r}: use text or json")
    if fmt == "json":
        processors: list[Any] = [structlog.processors.TimeStamper(fmt="iso", utc=False),
                                 structlog.processors.JSONRenderer()]
    else:
        processors = [structlog.processors.TimeStamper(fmt="%m-%d %H:%M:%S", utc=False), _CALLSITE, vllm_line]
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level, *processors],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _configured = fmt


def console_stream() -> Any:
    """The stream log lines go to (stderr unless configured otherwise)."""
    return sys.stderr if _stream is None or isinstance(_stream, _CurrentStderr) else _stream


def get_logger(name: str = "kvscope") -> Any:
    if _configured is None:
        configure_logging()
    return structlog.get_logger(name)


def log_failure(name: str, message: str) -> None:
    """An error line with the traceback of the exception being handled under it, as
    vLLM's logger.exception prints it (a contained failure: the process goes on)."""
    get_logger(name).error(f"{message}\n{traceback.format_exc().rstrip()}")
