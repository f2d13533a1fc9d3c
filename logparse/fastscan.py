"""The summary's fast path: one pass over big binary chunks in which the lines a
long-running server prints by the million (periodic stats, access lines:
:data:`~logparse.patterns.BULK_MARKERS`) are counted, not read.

A window of whole lines is *certified* when its lines hold as many first markers of
the bulk patterns as there are lines, as many lines start as each pattern's lines do
(:data:`~logparse.patterns.BULK_LINE_STARTS`) as hold its markers, each further marker of
a pattern occurs as often as its first, and no byte changes how a line becomes records:
a ``\\r`` redraw, or a ``]`` beyond each stats line's ``[file:line]`` (a tqdm bar a
record could be glued to has one). A line a pattern matches is never joined to its neighbour, so
each certified line is one record of its pattern. The counts cannot see *which* line
holds a marker; the prefix and bracket tests are what make a line that lost its
newline (two markers) beside a marker-less line fail: such a line would need a prefix
and no bracket, which no vLLM or uvicorn line of a run has. Such lines are records of their pattern, phase R, with their own prefix, never
joined to a neighbour and never per-rank duplicates, so the fold needs only how many
there were, the first and last line, the first and last time, and their
``Preemptions: N``: :class:`BulkRun` carries those. Counting uses ``bytes.count``
(C, memchr speed); everything else goes line by line through the same
:class:`~logparse.parser.RecordAssembler` as :func:`~logparse.parser.iter_records`,
so a summary and a full explanation fold the same records (tests/logparse/test_fastscan.py
holds the two to each other on every corpus log).

Windows grow while they certify and halve when they do not, down to
:data:`MIN_WINDOW` bytes, which are read line by line: the cost of a startup block
or a warning among a million stats lines is a few windows, not the file.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from engine.events.bounded import open_binary
from logparse.parser import (
    MAX_LINE_BYTES,
    Record,
    RecordAssembler,
    decode_physical,
    learn_prefix,
    strip_prefix,
)
from logparse.patterns import BULK_LINE_STARTS, BULK_MARKERS, PATTERNS_BY_ID, LinePattern

CHUNK_BYTES = 8 << 20  # read size; lines are never split across chunks
MIN_WINDOW = 4096  # a window this small that does not certify is read line by line
MAX_WINDOW = MAX_LINE_BYTES  # so no line of a certified window can be longer than the parser keeps
_PREEMPTIONS = re.compile(rb"Preemptions: (\d[\d,]*)")
_BULK = tuple((PATTERNS_BY_ID[pattern_id], markers) for pattern_id, markers in BULK_MARKERS.items())
# a line's start, found after the newline before it
_STARTS = tuple((pattern, b"\n" + BULK_LINE_STARTS[pattern.id]) for pattern, _ in _BULK)
_TIMED_MARKER = BULK_MARKERS["stats"][0]  # the bulk lines that carry a vLLM time (access lines do not)


@dataclass(slots=True)
class BulkRun:
    """Consecutive certified lines: what the fold needs of them without reading each."""

    first_line: int
    last_line: int
    counts: dict[str, int]  # pattern id -> lines
    first_time: str | None
    last_time: str | None
    preemptions: int
    preemption_line: int | None

    @property
    def records(self) -> int:
        return sum(self.counts.values())

    @property
    def patterns(self) -> list[LinePattern]:
        return [PATTERNS_BY_ID[pattern_id] for pattern_id, n in self.counts.items() if n]


def iter_summary(source: str | Path | BinaryIO) -> Iterator[Record | BulkRun]:
    """The records of ``source`` in order, with certified runs of bulk lines as :class:`BulkRun`."""
    if isinstance(source, str | Path):
        with open_binary(source, tolerant=True) as fh:  # gzipped or plain, a decompression bomb refused
            yield from iter_summary(fh)
        return
    assembler = RecordAssembler(learn_prefix(source))  # the same learned prefix as iter_records
    next_line = [1]  # the first physical line of the next chunk, advanced by _scan_chunk
    for chunk in _line_chunks(source):
        yield from _scan_chunk(chunk, next_line, assembler)
    yield from assembler.finish()


def _line_chunks(fh: BinaryIO) -> Iterator[bytes]:
    """Big reads cut after their last newline. A line longer than MAX_LINE_BYTES keeps
    its first MAX_LINE_BYTES (then its newline), as :func:`~logparse.parser.iter_physical_lines`
    reads it, so memory stays bounded by the chunk size."""
    carry = b""
    skipping = False  # inside the rest of an over-long line
    while True:
        data = fh.read(CHUNK_BYTES)
        if not data:
            break
        if skipping:
            end = data.find(b"\n")
            if end < 0:
                continue
            data, skipping = data[end + 1:], False
        buf = carry + data
        cut = buf.rfind(b"\n") + 1
        head, carry = buf[:cut], buf[cut:]
        if len(carry) > MAX_LINE_BYTES:
            head, carry, skipping = head + carry[:MAX_LINE_BYTES] + b"\n", b"", True
        if head:
            yield head
    if carry:
        yield carry


def _scan_chunk(chunk: bytes, next_line: list[int], assembler: RecordAssembler) -> Iterator[Record | BulkRun]:
    pos, number, size = 0, next_line[0], MIN_WINDOW * 16
    end_of_chunk = len(chunk)
    while pos < end_of_chunk:
        end = chunk.find(b"\n", min(pos + size, end_of_chunk) - 1)
        end = end_of_chunk if end < 0 else end + 1
        run = _certify(chunk, pos, end, number)
        if run is not None:
            first_end = chunk.find(b"\n", pos) + 1
            last_start = chunk.rfind(b"\n", pos, end - 1) + 1
            yield from assembler.feed(number, _decode_one(chunk[pos:first_end]))
            yield from assembler.finish()  # the first line, so the run follows it in order
            yield run
            yield from assembler.feed(run.last_line + 1, _decode_one(chunk[last_start:end]))
            number, pos, size = run.last_line + 2, end, min(size * 2, MAX_WINDOW)
            continue
        if size > MIN_WINDOW and end - pos > MIN_WINDOW:
            size //= 2
            continue
        pieces = chunk[pos:end].split(b"\n")
        if pieces[-1] == b"":
            pieces.pop()  # the window ends with its last line's newline
        for raw in pieces:
            for n, physical in decode_physical(number, raw[:MAX_LINE_BYTES]):
                yield from assembler.feed(n, physical)
            number += 1
        pos, size = end, MIN_WINDOW * 2
    next_line[0] = number


def _decode_one(raw: bytes) -> str:
    """One physical line the certification has shown to hold no redraw."""
    return raw.decode("utf-8", errors="replace").rstrip("\r\n")


def _certify(chunk: bytes, start: int, end: int, first_number: int) -> BulkRun | None:
    """The run of bulk lines between the window's first and last line, when every line of
    the window is certified (the first and last are then fed as ordinary lines). Each test
    is one ``bytes.count`` over the window, the cheapest to fail first."""
    lines = chunk.count(b"\n", start, end)
    if lines < 3 or chunk[end - 1] != 10:
        return None
    counts: dict[str, int] = {}
    for pattern, markers in _BULK:
        counts[pattern.id] = chunk.count(markers[0], start, end)
    if sum(counts.values()) != lines:
        return None
    # find (memchr) where absence is the test; count where a number must match
    if chunk.find(b"\r", start, end) >= 0:
        return None
    if (chunk.count(b"]", start, end) if counts["stats"] else chunk.find(b"]", start, end) + 1) != counts["stats"]:
        return None
    for pattern, mark in _STARTS:
        starts = chunk.count(mark, max(start - 1, 0), end - 1)
        if start == 0 and chunk.startswith(mark[1:]):
            starts += 1  # the file's first line has no newline before it
        if starts != counts[pattern.id]:
            return None
    for pattern, markers in _BULK:
        if any(chunk.count(marker, start, end) != counts[pattern.id] for marker in markers[1:]):
            return None
    first_end = chunk.find(b"\n", start) + 1
    last_start = chunk.rfind(b"\n", start, end - 1) + 1
    inner = dict(counts)
    for line_start, line_end in ((start, first_end), (last_start, end)):
        for pattern, markers in _BULK:
            if chunk.find(markers[0], line_start, line_end) >= 0:
                inner[pattern.id] -= 1
    preemptions, preemption_line = 0, None
    if inner["stats"] and chunk.count(b"Preemptions: ", first_end, last_start):
        for m in _PREEMPTIONS.finditer(chunk, first_end, last_start):
            preemptions += int(m.group(1).replace(b",", b""))
            if preemption_line is None:  # the fold marks the first line that prints the field
                preemption_line = first_number + 1 + chunk.count(b"\n", first_end, m.start())
    return BulkRun(
        first_line=first_number + 1,
        last_line=first_number + lines - 2,
        counts=inner,
        first_time=_run_time(chunk, first_end, last_start, last=False),
        last_time=_run_time(chunk, first_end, last_start, last=True),
        preemptions=preemptions,
        preemption_line=preemption_line,
    )


def _run_time(chunk: bytes, start: int, end: int, last: bool) -> str | None:
    """The vLLM time of the run's first (or last) line that has one: a stats line, nearly
    always the first one looked at (access lines and prefix-less lines have none)."""
    pos = chunk.rfind(_TIMED_MARKER, start, end) if last else chunk.find(_TIMED_MARKER, start, end)
    while pos >= 0:
        line_start = chunk.rfind(b"\n", 0, pos) + 1
        line_end = chunk.find(b"\n", pos)
        time = strip_prefix(_decode_one(chunk[line_start:line_end])).time
        if time is not None:
            return time
        pos = chunk.rfind(_TIMED_MARKER, start, line_start) if last else chunk.find(_TIMED_MARKER, line_end, end)
    return None
