"""Streaming parser: physical log lines in, logical records out.

Every trap found in real vLLM logs (tests/data/vllm-logs, each with its origin) is handled here,
before any pattern is tried: real and caret-notation ANSI codes, k9s/TUI box
borders, docker/Buildkite/journald/FastChat timestamps, indentation, nested
process prefixes of every era (``(VllmWorkerProcess pid=N)``, ``(Worker_TP1
pid=N)``, Ray Serve's four-deep chains), ``[Stage-1]`` tags, the three vLLM prefix
eras, uvicorn and structlog prefixes, JSON log lines, tqdm bars with a record
glued to them, ``\\r`` redraws, Ray's ``[repeated Nx across cluster]``, records
wrapped by a terminal (joined back) and per-rank duplicates (marked, not dropped).

Memory is bounded by the longest line kept (:data:`MAX_LINE_BYTES`) and a fixed
duplicate window, never by the log size.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import ahocorasick

from engine.events.bounded import json_depth, open_binary
from logparse.catalogue import Template, catalogue
from logparse.patterns import BLANK, BULK_MARKERS, NOISE, PATTERNS, TEXT_FIELDS, LinePattern
from logparse.prefixes import learn_from, replay, strip_ansi

MAX_LINE_BYTES = 1 << 20  # a longer physical line keeps its first MiB; the rest is skipped
MATCH_CHARS = 8192  # patterns see at most this much of a message (config lines are ~3-5 kB)
MAX_RECORD_CHARS = 16384  # a record joined from wrapped lines stops growing here
WRAP_MIN_CHARS = 78  # a previous line at least this long may have been hard-wrapped
DEDUP_WINDOW = 4096
JSON_DEPTH = 64  # a JSON log line nested deeper is not a log record

_EXTERNAL_TS = re.compile(
    r"^(?:\[\d{4}-\d\d-\d\dT[\d:.]+Z?\]"  # Buildkite
    r"|\d{4}-\d\d-\d\dT[\d:.]+(?:Z|[+-]\d\d:?\d\d)?"  # docker --timestamps / k8s / structlog iso
    r"|[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \S+ [\w.\-/@]+(?:\[\d+\])?:"  # journald / syslog
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| (?P<fc_level>[A-Z]+) \| \w+ \|)"  # FastChat wrapper
    r"\s*"
)
_GUTTER = re.compile(r"^\s*\|\s")  # web UI table gutter ("  | ")
_COMPOSE = re.compile(r"^[A-Za-z0-9][\w.\-]{0,100}[-_]\d+\s+\|\s?")  # docker compose service ("vllm-1  | ")
# a process prefix; its name may nest parentheses twice (Ray Data's "MapWorker(MapBatches(UDF)) pid=N")
_PROC_NAME = r"(?:[^()]|\([^()]{0,200}(?:\([^()]{0,200}\))?[^()]{0,200}\)){0,200}?"
_PROCESS = re.compile(rf"^\((?P<proc>{_PROC_NAME}pid=\d+[^()]{{0,100}})\)\s?")
_RANK = re.compile(r"^\[rank(?P<rank>\d+)\]:\s?")  # torch.distributed's per-rank prefix
_STAGE = re.compile(r"^\[Stage-\d+\]\s?")
_VLLM_PREFIX = re.compile(
    r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)"
    r"(?:\s+(?P<date>\d\d-\d\d \d\d:\d\d:\d\d))?"
    r"(?:\s+(?:\[(?P<file>[^\]\s]{1,200}:\d+)\]|(?P<file_old>[\w.\-/]{1,200}\.py:\d+)\]))?"
    r"(?:\s|$)"
)
_FILE_ONLY = re.compile(r"^\[(?P<file>[\w.\-/]{1,200}\.py:\d+)\]\s?")
_UVICORN = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+")
_STRUCTLOG = re.compile(r"^\[(?P<level>debug|info|warning|error|critical)\s*\]\s+")
# Ray's deduplication count, with the notice Ray adds the first time it folds lines
_RAY_REPEAT = re.compile(r"\s*\[repeated (?P<n>\d+)x across cluster\](?:\s*\(Ray deduplicates logs by default.*)?\s*$")
_GLUED = re.compile(
    rf"(?:\({_PROC_NAME}pid=\d+[^()]{{0,100}}\)\s?)*(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d"
)
_NUMBER = re.compile(r"^-?\d[\d,]*(?:\.\d+)?$")


def _anchor_table() -> list[tuple[str, tuple[int, ...]]]:
    """Each distinct anchor literal with the patterns (table positions) it admits."""
    table: dict[str, list[int]] = {}
    for i, pattern in enumerate(PATTERNS):
        for anchor in pattern.anchors:
            table.setdefault(anchor, []).append(i)
    return [(anchor, tuple(indices)) for anchor, indices in table.items()]


def _prefilter(table: list[tuple[str, tuple[int, ...]]]) -> ahocorasick.Automaton:
    """One Aho-Corasick automaton over every anchor: a single pass over a message yields
    each anchor it holds with the table positions that anchor admits, so a message costs
    one scan however many patterns the catalogue has."""
    automaton = ahocorasick.Automaton()
    for anchor, indices in table:
        automaton.add_word(anchor, indices)
    automaton.make_automaton()
    return automaton


_ANCHOR_TABLE = _anchor_table()
_PREFILTER = _prefilter(_ANCHOR_TABLE)
_NOISE_PREFILTER = _prefilter([(anchor, (i,)) for i, noise in enumerate(NOISE) for anchor in noise.anchors])
_TRACEBACK_CODE = re.compile(r"^\s+\S")  # the code line Python prints under a frame, indented
_FRAME = re.compile(r'^\s*File "[^"]+", line \d+, in ')
# a line that opens a record of its own (a date-time, Ray's system processes): never a hard-wrapped continuation
_OWN_RECORD = re.compile(r"^(?:\d{4}-\d\d-\d\d[ T]\d\d:\d\d|\((?:raylet|gcs_server|autoscaler|monitor)\b[^)]{0,100}\) )")


@dataclass(slots=True)
class Record:
    """One logical log record (one or more physical lines)."""

    line: int  # first physical line, 1-based
    end_line: int
    text: str  # the message, prefixes stripped
    raw: str  # the first physical line as decoded (capped), for display
    level: str | None = None
    time: str | None = None  # "MM-DD HH:MM:SS" as vLLM prints it (no year)
    process: str | None = None  # innermost process prefix, e.g. "Worker_TP1 pid=448"
    source: str | None = None  # "gpu_worker.py:298"
    pattern: LinePattern | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    printed: dict[str, str] = field(default_factory=dict)  # numeric fields as printed
    repeated: int = 1
    duplicate_of: int | None = None
    has_prefix: bool = False
    noise: str | None = None  # the source of a line vLLM did not write (NOISE), when no pattern matched
    template: Template | None = None  # the generated catalogue's entry (vLLM's source), when no pattern matched
    template_args: dict[str, str] = field(default_factory=dict)  # its placeholders as printed, by argument

    @property
    def phase(self) -> str | None:
        return self.pattern.phase if self.pattern else None

    @property
    def pattern_id(self) -> str | None:
        return self.pattern.id if self.pattern else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "line": self.line,
            "phase": self.phase,
            "pattern": self.pattern_id,
            "fields": dict(self.fields),
        }
        if self.end_line != self.line:
            out["end_line"] = self.end_line
        for name in ("level", "time", "process", "source", "duplicate_of", "noise"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.template is not None:
            out["template"] = {**self.template.to_json(), "args": dict(self.template_args)}
        if self.repeated != 1:
            out["repeated"] = self.repeated
        return out


def convert_field(name: str, value: str) -> Any:
    """Numbers become int/float (thousands separators dropped); text fields stay text."""
    if name in TEXT_FIELDS or not _NUMBER.match(value):
        return value
    plain = value.replace(",", "")
    try:
        return float(plain) if "." in plain else int(plain)
    except ValueError:  # "1,2,,3" passes the shape test but is not a number
        return value


def match_message(text: str) -> tuple[LinePattern | None, dict[str, Any], dict[str, str]]:
    """The first catalogue pattern (in table order) that matches ``text``, with its
    fields (numbers converted) and the numbers as printed (for their precision)."""
    probe = text[:MATCH_CHARS]
    candidates = [i for _, indices in _PREFILTER.iter(probe) for i in indices]
    if len(candidates) > 1:
        candidates = sorted(set(candidates))
    for i in candidates:
        pattern = PATTERNS[i]
        m = pattern.regex.search(probe)
        if m is None:
            continue
        fields: dict[str, Any] = {}
        printed: dict[str, str] = {}
        groups = [m, *(ex.search(probe) for ex in pattern.extractors)]
        for gm in groups:
            if gm is None:
                continue
            for name, value in gm.groupdict().items():
                if value is not None and name not in fields:
                    fields[name] = convert_field(name, value)
                    if not isinstance(fields[name], str):
                        printed[name] = value
        return pattern, fields, printed
    return None, {}, {}


def match_noise(text: str) -> str | None:
    """The source of a message vLLM did not write (``NOISE``), ``BLANK`` for an empty one."""
    if not text.strip():
        return BLANK
    probe = text[:MATCH_CHARS]
    for i in sorted({i for _, (i,) in _NOISE_PREFILTER.iter(probe)}):
        if NOISE[i].regex.search(probe):
            return NOISE[i].source
    return None


@dataclass(slots=True)
class _Prefix:
    text: str
    level: str | None = None
    time: str | None = None
    process: str | None = None
    source: str | None = None
    repeated: int = 1
    indented: bool = False
    has_prefix: bool = False
    learned: bool = False  # the log's own learned prefix was on the line (logparse/prefixes.py)


def strip_prefix(line: str, learned: re.Pattern[str] | None = None) -> _Prefix:
    """Remove every kind of prefix around a vLLM message (see the module doc); ``learned`` is
    the log's own prefix (:func:`logparse.prefixes.learn`), removed first."""
    line, has_learned = _strip_frame(line, learned)
    out = _Prefix(text=line, learned=has_learned)
    m = _GUTTER.match(line) or _COMPOSE.match(line)
    if m:
        line = line[m.end():]
    m = _EXTERNAL_TS.match(line)
    if m:
        line = line[m.end():]
        if m.group("fc_level"):
            out.level = m.group("fc_level")
    stripped = line.lstrip()
    out.indented = len(stripped) != len(line)
    line = stripped
    if line.startswith("{") and line.endswith("}"):
        decoded = _json_message(line)
        if decoded is not None:
            out.text, out.level, out.time = decoded
            out.has_prefix = True
            return out
    line = _strip_level_prefix(_strip_processes(line, out), out)
    if "[repeated" in line:
        m = _RAY_REPEAT.search(line)
        if m:
            out.repeated = int(m.group("n"))
            line = line[: m.start()]
    out.text = line.rstrip()
    return out


def _strip_frame(line: str, learned: re.Pattern[str] | None) -> tuple[str, bool]:
    """The line without colour codes, a console's box border and the log's own learned prefix;
    whether that prefix was there."""
    line = strip_ansi(line).rstrip()
    if line.startswith("│") or line.endswith("│"):
        line = line.strip("│").rstrip()
        if line.startswith(" "):
            line = line[1:]
    if learned is not None:
        m = learned.match(line)
        if m is not None and m.end() > 0:
            return line[m.end():], True
    return line, False


def _strip_processes(line: str, out: _Prefix) -> str:
    """Ray's and vLLM's process prefixes ("(EngineCore_0 pid=1)", "[rank0]") and a stage's
    "[Stage-N]", the last process kept in ``out``."""
    while line.startswith(("(", "[rank")):
        m = _PROCESS.match(line) or _RANK.match(line)
        if not m:
            break
        out.process = m.group("proc") if "proc" in m.groupdict() else f"rank{m.group('rank')}"
        out.has_prefix = True
        line = line[m.end():]
    if line.startswith("[Stage-"):
        m = _STAGE.match(line)
        if m:
            line = line[m.end():]
    return line


def _strip_level_prefix(line: str, out: _Prefix) -> str:
    """vLLM's "LEVEL date [file:line]" prefix, a file-only or structlog one, or uvicorn's
    "LEVEL:", their level, time and source kept in ``out``."""
    m = _VLLM_PREFIX.match(line)
    if m:
        out.level = m.group("level")
        out.time = m.group("date")
        out.source = m.group("file") or m.group("file_old")
        out.has_prefix = True
        line = line[m.end():]
        if not out.time and not out.source:
            line = line.lstrip()  # "INFO  message" (level only)
    elif line.startswith("["):
        m = _FILE_ONLY.match(line) or _STRUCTLOG.match(line)
        if m:
            if "file" in m.groupdict():
                out.source = m.group("file")
            else:
                out.level = m.group("level").upper()
            out.has_prefix = True
            line = line[m.end():]
    else:
        m = _UVICORN.match(line)
        if m:
            out.level = m.group("level")
            out.has_prefix = True
            line = line[m.end():]
    return line


def _json_message(line: str) -> tuple[str, str | None, str | None] | None:
    """vLLM 0.32+ JSON formatter or kvscope's structlog JSON renderer."""
    if len(line) > MATCH_CHARS * 8 or json_depth(line, stop_at=JSON_DEPTH) > JSON_DEPTH:
        return None  # no log record nests deeper; json.loads would recurse until RecursionError
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    message = obj.get("message", obj.get("event"))
    if not isinstance(message, str):
        return None
    level = obj.get("levelname", obj.get("level"))
    when = obj.get("asctime", obj.get("timestamp"))
    return message, str(level).upper() if level is not None else None, str(when) if when is not None else None


def _split_glued(line: str) -> list[str]:
    """A tqdm bar with a log record glued after it becomes two lines."""
    if "it/s]" not in line and "s/it]" not in line:
        return [line]
    parts: list[str] = []
    start = 0
    for m in _GLUED.finditer(line, 1):
        if m.start() > start:
            parts.append(line[start : m.start()])
            start = m.start()
    parts.append(line[start:])
    return parts


def iter_physical_lines(source: str | Path | BinaryIO | Iterable[bytes | str]) -> Iterator[tuple[int, str]]:
    """(line number, decoded text) for each physical line; invalid UTF-8 is replaced,
    lines beyond :data:`MAX_LINE_BYTES` are cut, ``\\r`` redraws are split."""
    if isinstance(source, str | Path):
        with open_binary(source, tolerant=True) as fh:  # gzipped or plain, bombs refused (engine/events/bounded.py)
            yield from iter_physical_lines(fh)
        return
    if isinstance(source, io.IOBase) or hasattr(source, "readline"):
        chunks: Iterable[bytes | str] = bounded_lines(source)  # type: ignore[arg-type]
    else:
        chunks = source
    for number, chunk in enumerate(chunks, 1):
        yield from decode_physical(number, chunk)


def decode_physical(number: int, chunk: bytes | str) -> Iterator[tuple[int, str]]:
    """One physical line as the parser sees it: decoded, its newline dropped, a ``\\r``
    redraw split into its non-empty pieces."""
    text = chunk.decode("utf-8", errors="replace") if isinstance(chunk, bytes | bytearray) else chunk
    text = text.rstrip("\r\n")
    if "\r" in text:
        for piece in text.split("\r"):
            if piece.strip():
                yield number, piece
        return
    yield number, text


def bounded_lines(fh: BinaryIO) -> Iterator[bytes]:
    while True:
        chunk = fh.readline(MAX_LINE_BYTES)
        if not chunk:
            return
        if len(chunk) == MAX_LINE_BYTES and not chunk.endswith(b"\n"):
            while True:  # skip the rest of an over-long line
                rest = fh.readline(MAX_LINE_BYTES)
                if not rest or rest.endswith(b"\n"):
                    break
        yield chunk


def iter_records(source: str | Path | BinaryIO | Iterable[bytes | str]) -> Iterator[Record]:
    """Parse a log into :class:`Record` objects, one pending record at a time, its own line
    prefix learned from its first lines (:mod:`logparse.prefixes`)."""
    lines = iter_physical_lines(source)
    learned, held = learn_from(lines)
    assembler = RecordAssembler(learned)
    for number, physical in replay(held, lines):
        yield from assembler.feed(number, physical)
    yield from assembler.finish()


def learn_prefix(source: str | Path | BinaryIO) -> re.Pattern[str] | None:
    """The learned prefix of a file (or a seekable binary stream, read back to where it was), as
    :func:`iter_records` learns it: for readers that parse a file in their own way."""
    if isinstance(source, str | Path):
        with open_binary(source, tolerant=True) as fh:
            return learn_from(iter_physical_lines(fh))[0]
    if not source.seekable():
        return None
    start = source.tell()
    try:
        return learn_from(iter_physical_lines(source))[0]
    finally:
        source.seek(start)


class RecordAssembler:
    """Physical lines in, records out: a record is held until the next line shows it is
    not continued (an indented line, or the rest of a line a terminal hard-wrapped).
    :func:`iter_records` feeds it every line; the fast summary (logparse/fastscan.py)
    feeds it every line it does not count in a run."""

    def __init__(self, learned: re.Pattern[str] | None = None) -> None:
        self.learned = learned  # the log's own line prefix (logparse/prefixes.py)
        self.pending: Record | None = None
        self.previous_len = 0
        self.seen: dict[tuple[str, str], tuple[int, str | None]] = {}
        self.frame_process: str | bool | None = False  # the process whose traceback frame came last (False: none)
        self.after_frame = False  # the last record was a frame line: the next is its code, however indented
        self.at_start = True  # no record closed yet: a paste that starts mid-traceback starts with a code line

    def feed(self, number: int, physical: str) -> Iterator[Record]:
        for piece in _split_glued(physical):
            prefix = strip_prefix(piece, self.learned)
            text = prefix.text
            pattern, fields, printed = match_message(text) if text else (None, {}, {})
            pending = self.pending
            joinable = (
                pending is not None
                and not prefix.has_prefix
                and pattern is None
                and text
                # indented: a continuation line; long unmatched previous line: a terminal hard wrap (which
                # never repeats the log's own prefix, nor starts with a date-time of its own)
                and (prefix.indented or (not prefix.learned and self.previous_len >= WRAP_MIN_CHARS
                                         and pending.pattern is None and not _OWN_RECORD.match(text)))
                and len(pending.text) < MAX_RECORD_CHARS
            )
            self.previous_len = len(piece)
            if joinable:
                assert pending is not None
                pending.text = (pending.text + (" " if prefix.indented else "") + text)[:MAX_RECORD_CHARS]
                pending.end_line = number
                pending.pattern, pending.fields, pending.printed = match_message(pending.text)
                continue
            if pending is not None:
                yield self._close(pending)
            self.pending = Record(
                line=number,
                end_line=number,
                text=text[:MAX_RECORD_CHARS],
                raw=piece[:2000],
                level=prefix.level,
                time=prefix.time,
                process=prefix.process,
                source=prefix.source,
                pattern=pattern,
                fields=fields,
                printed=printed,
                repeated=prefix.repeated,
                has_prefix=prefix.has_prefix,
            )

    def finish(self) -> Iterator[Record]:
        """The record still held (the log's last); the assembler is empty afterwards."""
        if self.pending is not None:
            yield self._close(self.pending)
        self.pending = None

    def _close(self, record: Record) -> Record:
        code_line = self._is_code_line(record)
        self.at_start = False
        if record.pattern is None:
            found = None if code_line or not record.text else catalogue().match(record.text)
            if found is not None:  # vLLM's own line, from its source: vLLM's even where it names Triton or NUMA
                record.template, record.template_args = found
                self.frame_process, self.after_frame = False, False
                return record
            record.noise = match_noise(record.text)
            if record.noise is None and code_line:
                record.noise = "traceback"  # the code line under a frame, printed with its own log prefix
            if record.noise != BLANK:  # a blank line the paste doubled keeps the traceback open
                self.frame_process = record.process if record.noise == "traceback" else False
                self.after_frame = record.noise == "traceback" and bool(_FRAME.match(record.text))
        elif not code_line:
            self.frame_process, self.after_frame = False, False  # an echoed source line a pattern knows keeps it open
        return _mark_duplicate(record, self.seen)

    def _is_code_line(self, record: Record) -> bool:
        """Whether ``record`` is the source line Python prints under a traceback frame: indented
        under a frame of its own process (or as a paste's first line, cut mid-traceback), or the
        line right after a frame where the paste lost the indentation."""
        if self.frame_process == record.process and self.after_frame and record.text:
            return True
        if not _TRACEBACK_CODE.match(record.text):
            return False
        return self.frame_process == record.process or self.at_start


def _mark_duplicate(record: Record, seen: dict[tuple[str, str], tuple[int, str | None]]) -> Record:
    """Worker lines print once per TP/PP rank: the same message under another
    process prefix is marked as a duplicate of the first. The API server's periodic
    lines (:data:`BULK_MARKERS`) are never per-rank copies, so they are not tracked."""
    if record.pattern is None or record.process is None or record.pattern.id in BULK_MARKERS:
        return record
    key = (record.pattern.id, record.text)
    first = seen.get(key)
    if first is None:
        if len(seen) >= DEDUP_WINDOW:
            seen.clear()
        seen[key] = (record.line, record.process)
    elif first[1] != record.process:
        record.duplicate_of = first[0]
    return record
