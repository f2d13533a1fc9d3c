"""Every file kvscope reads from a user — recordings (``.jsonl``, gzipped or not) and vLLM
logs — is read here, line by line, with bounded memory: a line-length cap, a JSON
nesting-depth cap, a cap on the text a recording may hold in memory, and a cap on how far a
gzip file may inflate (a 1 MB file that inflates to 2 GiB is a decompression bomb, not a
log). What breaks a cap, or cannot be read at all, ends as one :class:`InputLimitError` line
naming the file and the line, never a ``MemoryError`` or ``RecursionError`` traceback.

``engine doctor``, ``engine diff``, ``engine replay``, ``monitor replay`` and logparse all
come through :func:`open_lines` / :func:`iter_text_lines`; the caps are module constants, the
text cap also ``KVSCOPE_MAX_RECORDING_MB``.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from engine.errors import UserError

GZIP_MAGIC = b"\x1f\x8b"
MAX_LINE_BYTES = 16 << 20  # one line of a recording: an event of a few kB, a snapshot of a few MB at most
MAX_JSON_DEPTH = 64  # an event nests a handful of levels
DEFAULT_MAX_RECORDING_MB = 32  # text held as events (~10x its size in objects): within 500 MB on any input
MAX_INFLATION = 200  # a gzipped log compresses 5-30x (300x if it is nothing but /health lines) ...
MIN_INFLATION_BYTES = 32 << 20  # ... once past this much text (a tiny file may inflate far)
READ_ERRORS = (OSError, EOFError, zlib.error)


class InputLimitError(UserError, ValueError):
    """A file that breaks a reading cap or cannot be read: one line naming the file and the line
    (a UserError, so every CLI prints it as its one error line; a ValueError, as readers raise)."""


def _env_number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, "") or default)
    except ValueError:
        return default


def max_inflation() -> int:
    """How many times its size a gzip file may inflate (``KVSCOPE_MAX_INFLATION`` overrides)."""
    return int(_env_number("KVSCOPE_MAX_INFLATION", MAX_INFLATION))


def max_recording_bytes() -> int:
    """The text one recording may hold in memory (``KVSCOPE_MAX_RECORDING_MB`` overrides)."""
    return int(_env_number("KVSCOPE_MAX_RECORDING_MB", DEFAULT_MAX_RECORDING_MB) * (1 << 20))


class Inflated(io.RawIOBase):
    """A gzip file's inflated bytes that refuse to inflate more than MAX_INFLATION-fold (past
    MIN_INFLATION_BYTES): a decompression bomb ends as one line before it fills memory or disk."""

    def __init__(self, path: str | Path, name: str, tolerant: bool = False) -> None:
        self.raw_file = open(path, "rb")  # noqa: SIM115 - closed with this reader
        self.gz = gzip.GzipFile(fileobj=self.raw_file, mode="rb")
        self.name_ = name
        self.limit = max(max_inflation() * os.path.getsize(path), MIN_INFLATION_BYTES)
        self.total = 0
        self.lines = 0  # newlines inflated so far: the error names the line it reached
        self.tolerant = tolerant  # a log cut mid-stream (still being written) ends where it is cut
        self.cut = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        if self.cut:
            return 0
        try:  # read1: what one piece of compressed input gives, so a cut file yields all but its tail
            data = self.gz.read1(min(len(buffer), 1 << 16))
            n = len(data)
            buffer[:n] = data
        except READ_ERRORS as exc:
            if self.tolerant:
                self.cut = True
                return 0
            raise InputLimitError(f"{self.name_}: line {self.lines + 1}: cannot be read ({exc})") from None
        self.total += n
        if self.total > self.limit:
            raise InputLimitError(f"{self.name_}: line {self.lines + 1}: the gzip file inflates more than "
                                  f"{max_inflation()}-fold (to over {_size(self.total)}): a decompression bomb, not a "
                                  "log or a recording (KVSCOPE_MAX_INFLATION raises the limit)")
        self.lines += bytes(buffer[:n]).count(b"\n")
        return n

    def close(self) -> None:
        self.gz.close()
        self.raw_file.close()
        super().close()


def open_binary(path: str | Path, name: str | None = None, tolerant: bool = False) -> BinaryIO:
    """The file's bytes, inflated as they are read when it is gzipped (told by its magic, not its
    name), within the inflation cap; ``tolerant`` (logs): damaged or cut gzip data ends the text
    where it breaks instead of raising."""
    with open(path, "rb") as fh:
        head = fh.read(2)
    if head == GZIP_MAGIC:
        reader = Inflated(path, name or str(path), tolerant)
        return io.BufferedReader(reader, 1 << 20)  # type: ignore[return-value]
    return open(path, "rb")  # handed to the caller, who closes it


def iter_text_lines(path: str | Path, name: str | None = None, max_line_bytes: int = MAX_LINE_BYTES,
                    max_total_bytes: int | None = None, long_lines: str = "error") -> Iterator[tuple[int, bytes]]:
    """(line number, bytes of the line with its newline) for each line of ``path``, within the caps.
    ``long_lines="cut"`` keeps a longer line's first ``max_line_bytes`` and skips its rest (a log);
    ``"error"`` refuses it (a recording, whose lines are whole JSON objects)."""
    name = name or str(path)
    number, total = 0, 0
    with open_binary(path, name) as fh:
        while True:
            try:
                line, skipped = _read_line(fh, max_line_bytes, long_lines)
            except READ_ERRORS as exc:
                raise InputLimitError(f"{name}: line {number + 1}: cannot be read ({exc})") from None
            if not line:
                return
            number += 1
            total += len(line) + skipped
            if skipped and long_lines == "error":
                raise InputLimitError(f"{name}: line {number}: longer than {_size(max_line_bytes)} (no line of a "
                                      "kvscope recording is): not a recording, or damaged")
            if max_total_bytes is not None and total > max_total_bytes:
                raise InputLimitError(f"{name}: line {number}: more than {_size(max_total_bytes)} of text, more than "
                                      "a recording is read into memory; raise KVSCOPE_MAX_RECORDING_MB to read it")
            yield number, line


def _read_line(fh: BinaryIO, limit: int, long_lines: str) -> tuple[bytes, int]:
    """One line of at most ``limit`` bytes, and how many bytes of it beyond that were skipped
    (read in ``limit``-sized pieces, so an endless line never sits in memory whole)."""
    line = fh.readline(limit)
    skipped = 0
    if len(line) == limit and not line.endswith(b"\n"):
        while True:
            rest = fh.readline(limit)
            skipped += len(rest)
            if not rest or rest.endswith(b"\n") or long_lines == "error":
                break
    return line, skipped


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n:,} B"


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_depth(text: str, stop_at: int | None = None) -> int:
    """How deep a JSON text nests arrays and objects (brackets inside strings do not count);
    stops counting once past ``stop_at``."""
    depth = deepest = 0
    for m in _JSON_TOKEN.finditer(text):
        token = m.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if stop_at is not None and deepest > stop_at:
                return deepest
        elif token in "]}":
            depth -= 1
    return deepest


def check_json_depth(text: str, name: str, number: int, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse a JSON line nested deeper than ``max_depth`` before any decoder recurses into it
    (a line with fewer brackets than that cannot be, and is not scanned)."""
    if text.count("[") + text.count("{") > max_depth and json_depth(text, stop_at=max_depth) > max_depth:
        raise InputLimitError(f"{name}: line {number}: JSON nested deeper than {max_depth} levels (an event nests a "
                              "few): not a kvscope recording, or damaged")


def text_lines(source: str | Path | bytes, name: str, max_total_bytes: int | None) -> Iterator[tuple[int, str]]:
    """(number, decoded text) of a recording given as a path (plain or gzipped) or as bytes."""
    if isinstance(source, bytes):
        stream = io.BytesIO(source)
        for number, raw in enumerate(iter(lambda: stream.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise InputLimitError(f"{name}: line {number}: longer than {_size(MAX_LINE_BYTES)}: not a recording")
            yield number, raw.decode("utf-8", errors="replace")
        return
    for number, raw in iter_text_lines(source, name, max_total_bytes=max_total_bytes):
        yield number, raw.decode("utf-8", errors="replace")
