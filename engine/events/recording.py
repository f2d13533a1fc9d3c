"""The JSONL recording: events in their wire form (``dumps``, ``event_line``), the header
line, the sink that writes a recording and the reader that reads one back, tolerating a cut
last line."""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TextIO

import msgspec

from engine.events.record import Event
from engine.events.schema import EVENT_TYPES, SCHEMA_NAME, SCHEMA_VERSION


def _json_default(obj: Any) -> Any:
    """What msgspec cannot encode by itself (it does dicts, lists, tuples, sets,
    dataclasses): paths as strings, numpy/torch scalars as numbers, the rest as text."""
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


# msgspec, not json: a step event with a full batch encodes ~5x faster, and every sink
# that writes events (the JSONL file, the server's /events history) pays it per event.
# Compact, UTF-8 as is, floats in shortest round-trip form; a NaN becomes null.
_ENCODER = msgspec.json.Encoder(enc_hook=_json_default)


def dumps(obj: Any) -> str:
    return _ENCODER.encode(obj).decode()


# The wire form of the events encoded lately, by id: each entry holds its event (so the id is not
# reused while the entry lives), the stamps it had then, its line's UTF-8 bytes and, once
# event_line has asked, the line as text. Many entries, not the last one: the recording encodes
# each event as it is published, the deferred observers (/events) read it a few steps later.
_WIRE_KEPT = 1024
_wire: dict[int, list[Any]] = {}
_wire_order: collections.deque[int] = collections.deque()


def _wire_entry(event: Event) -> list[Any]:
    key = id(event)
    entry = _wire.get(key)
    if entry is not None and entry[0] is event and entry[1] == event.seq and entry[2] == event.t:
        return entry
    fresh = [event, event.seq, event.t, _ENCODER.encode(event.to_dict()), None]
    if entry is None:  # a new key (one re-stamped keeps its place in the order)
        _wire_order.append(key)
        if len(_wire_order) > _WIRE_KEPT:
            _wire.pop(_wire_order.popleft(), None)
    _wire[key] = fresh
    return fresh


def event_bytes(event: Event) -> bytes:
    """``event.to_dict()`` in its wire form, UTF-8, made once however many sinks write the event
    (the recording writes these bytes, ``/events`` their text: event_line), on whichever thread."""
    return _wire_entry(event)[3]


def event_line(event: Event) -> str:
    """``dumps(event.to_dict())``, made once however many sinks write the event."""
    entry = _wire_entry(event)
    line = entry[4]
    if line is None:
        line = entry[4] = entry[3].decode()
    return line


def header(config: dict[str, Any] | None = None, started_unix: float | None = None) -> dict[str, Any]:
    """The first line of a recording. ``started_unix``: the wall-clock time of the bus
    clock's zero (an event at ``t`` happened at ``started_unix + t``), written when
    known, so a replay can re-emit spans at their original times."""
    out: dict[str, Any] = {"schema": SCHEMA_NAME, "version": SCHEMA_VERSION, "config": config or {}}
    if started_unix is not None:
        out["started_unix"] = started_unix
    return out


class JsonlSink:
    """Writes one event per line after a header line.

    Each line is written whole with a single ``write`` and flushed per step,
    phase and request lifecycle event, so a reader of a file cut at any byte
    loses at most the last line. A write that fails (a full disk) cuts the file
    back to its last whole line, closes it and raises: the bus stops this sink and
    the engine goes on; the recording stays readable up to that line.
    """

    sink_name = "jsonl"

    def __init__(self, path: str | Path | TextIO, config: dict[str, Any] | None = None,
                 started_unix: float | None = None) -> None:
        self._file: IO[Any]
        if isinstance(path, str | Path):
            # bytes, unbuffered: each event's line is written as event_bytes made it (not decoded and
            # encoded again), by one write(2) with no buffer to copy into and flush
            self._file = open(path, "wb", buffering=0)  # noqa: SIM115
            self._owns = True
            self.sink_name = f"jsonl {path}"
        else:
            self._file = path
            self._owns = False
        self._lock = threading.Lock()
        first = _ENCODER.encode(header(config, started_unix))
        self._write_line(first)
        self._file.flush()
        self._whole_lines_end = len(first) + 1  # bytes that are whole lines (an owned file)

    def _write_line(self, data: bytes, text: str | None = None) -> None:
        if not self._owns:
            self._file.write((data.decode() if text is None else text) + "\n")
            return
        line = data + b"\n"
        written = self._file.write(line)
        while written < len(line):  # a short write (the disk filling): the rest, or the error
            written += self._file.write(memoryview(line)[written:])

    def __call__(self, event: Event) -> None:
        data = event_bytes(event)
        with self._lock:
            if self._file.closed:
                return
            try:
                self._write_line(data, None if self._owns else event_line(event))
                self._file.flush()
            except OSError:
                self._cut_to_whole_lines()
                raise
            self._whole_lines_end += len(data) + 1

    def _cut_to_whole_lines(self) -> None:
        """After a failed write: drop the part-written line, then close the file (unbuffered:
        nothing is left to append mid-line)."""
        if not self._owns:
            return
        with contextlib.suppress(OSError, ValueError):
            os.ftruncate(self._file.fileno(), self._whole_lines_end)
        with contextlib.suppress(OSError, ValueError):
            self._file.close()

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                if self._owns:
                    self._file.close()


@dataclass(slots=True)
class Recording:
    """A parsed event file: header, events, and whether the tail was cut."""

    header: dict[str, Any]
    events: list[Event]
    truncated: bool = False

    @property
    def config(self) -> dict[str, Any]:
        return self.header.get("config", {})


def iter_jsonl(source: str | Path | TextIO) -> Iterator[dict[str, Any] | None]:
    """Yield each JSON object of an event file; ``None`` for a line that does not
    parse (a line cut by a crash or a partial copy)."""
    for _, row in _numbered_rows(source):
        yield row


def _numbered_rows(source: str | Path | TextIO | bytes, name: str | None = None,
                   max_total_bytes: int | None = None) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """(line number, JSON object or None) for each non-blank line, read through the bounded
    reader (engine/events/bounded.py: plain or gzipped, line-length, depth and size caps)."""
    from engine.events.bounded import MAX_LINE_BYTES, InputLimitError, check_json_depth, text_lines
    from engine.events.validate import decode_object

    name = name or (str(source) if isinstance(source, str | Path) else "<stream>")
    lines: Iterable[tuple[int, str]]
    if isinstance(source, str | Path | bytes):
        lines = text_lines(source, name, max_total_bytes)
    else:
        lines = enumerate(source, start=1)
    for number, line in lines:
        if len(line) > MAX_LINE_BYTES:
            raise InputLimitError(f"{name}: line {number}: longer than {MAX_LINE_BYTES >> 20} MiB: not a recording")
        line = line.strip()
        if line:
            check_json_depth(line, name, number)
            yield number, decode_object(line)


def read_events(source: str | Path | TextIO | bytes, name: str | None = None) -> Recording:
    """Read a JSONL recording, tolerating a truncated last line.

    Raises ``ValueError`` naming the file (``name``, else the path) and the line when
    the header is missing or of another schema, when a line that is not the last one
    does not parse (only a cut tail is expected), and when a field of the header or of
    an event is not of its declared type (engine/events/validate.py: the field is named).
    """
    from engine.events.bounded import max_recording_bytes
    from engine.events.validate import SchemaError, event_from_row

    name = name or (str(source) if isinstance(source, str | Path) else "<stream>")
    # streamed: the header is judged before the second line is read, a bad line before the next one
    rows = _numbered_rows(source, name, max_recording_bytes())
    first = next(rows, None)
    head = first[1] if first else None
    if first is None or head is None or head.get("schema") != SCHEMA_NAME:
        raise ValueError(f"{name}: not a kvscope event file (first line must be the {SCHEMA_NAME} header)")
    _check_head(head, name, first[0])
    events: list[Event] = []
    bad: tuple[int, str | None] | None = None  # a line that is not an event: a cut tail if nothing follows
    for number, row in rows:
        if bad is not None:
            raise ValueError(f"{name}: line {bad[0]} is not a valid event")
        kind = row.get("type") if row is not None else None
        if row is None or not isinstance(kind, str) or kind not in EVENT_TYPES:
            bad = (number, None)
            continue
        try:
            events.append(event_from_row(row))
        except SchemaError as exc:  # a whole line with a value of the wrong type: damage, not a cut
            raise ValueError(f"{name}: line {number}: {kind} event's {exc}") from None
    return Recording(header=head, events=events, truncated=bad is not None)


def _check_head(head: dict[str, Any], name: str, number: int) -> None:
    from engine.events.validate import SchemaError, check_header

    try:
        check_header(head)
    except SchemaError as exc:
        raise ValueError(f"{name}: line {number}: the header's {exc}") from None
    if head.get("version", 0) > SCHEMA_VERSION:
        raise ValueError(
            f"{name}: line {number} (the header): schema version {head.get('version')} is newer than this "
            f"kvscope reads ({SCHEMA_VERSION})"
        )


def open_sink(path: str | os.PathLike[str], config: dict[str, Any] | None = None) -> JsonlSink:
    return JsonlSink(Path(path), config)
