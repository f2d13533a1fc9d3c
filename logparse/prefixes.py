"""A log's own line prefix, learned from the log.

Whatever wrote the log around vLLM adds its own prefix to every line: ``docker compose logs``
(``vllm-1  | `` or ``2026-05-01 20:54:16.988 | ``), Kubernetes and journald timestamps, a
launcher's ``2026-05-08 11:47:02.256 [Error] (Process) ``, torch's ``[rank0]: ``, the
indentation of a Markdown list it was pasted into. No list of such formats is ever complete,
so the prefix is learned per log: in the first lines, the text before vLLM's own line start
(a process prefix ``(Name pid=N)``, ``LEVEL MM-DD HH:MM:SS``, ``[file.py:N]``, uvicorn's
``INFO:``, a traceback's ``Traceback``/``File "``) is cut into tokens (digit runs, letter
runs, blanks, single other characters); the token *shape* most of those lines share is the
prefix, and a regular expression is built from it: digits as ``\\d+``, a word literal where
every line has the same one (``vllm``, ``T``, ``Z``) and ``[A-Za-z_]+`` where it varies
(``Info``/``Error``), blanks as the exact run where it never changes. Every line of the log
then loses that prefix before the parser's own prefix handling, lines without it untouched.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import islice

LEARN_LINES = 200  # the first lines a prefix is learned from
LEARN_CHARS = 4 << 20  # ... at most this much text of them (a log of huge lines learns from fewer)
HEAD_CHARS = 160  # vLLM's own start must come within this many characters of a line's start
MIN_LINES = 3  # a prefix must be on at least this many lines
MIN_SHARE = 0.5  # ... and on at least this share of the lines where vLLM's own start was found

_ANSI = re.compile(r"(?:\x1b|\^\[)\[[0-9;?]*[A-Za-z]|\[(?:[01];)?(?:3[0-7]|9[0-7]|0)m")
# Where vLLM's own line begins (the process prefix may nest: Ray Data's MapWorker(MapBatches(...)))
_ANCHOR = re.compile(
    r"\((?:[^()\n]|\([^()\n]*(?:\([^()\n]*\))?[^()\n]*\)){0,200}?\bpid=\d+"
    r"|\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d"
    r"|\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):\s"
    r"|\[[\w.\-/]+\.py:\d+\]"
    r"|Traceback \(most recent call last\)|\bFile \""
)
_TOKEN = re.compile(r"\d+|[A-Za-z_]+|[ \t]+|.")
Shape = tuple[str, ...]  # per token: "d" digits, "w" letters, "s" blanks, or the character itself


def strip_ansi(line: str) -> str:
    """Colour codes, whole (``ESC[0;36m``), in caret notation (``^[[0m``) or as the remnant a copy
    leaves when it drops the escape byte (``[0;36m``)."""
    if "[" not in line:
        return line
    return _ANSI.sub("", line)


def _kind(token: str) -> str:
    if token[0].isdigit():
        return "d"
    if token[0].isalpha() or token[0] == "_":
        return "w"
    if token[0] in " \t":
        return "s"
    return token


def head_of(line: str) -> str | None:
    """The text before vLLM's own start, or None where the line shows no such start."""
    m = _ANCHOR.search(line, 0, HEAD_CHARS + 200)
    if m is None or m.start() > HEAD_CHARS:
        return None
    head = line[: m.start()]
    return head.rstrip() if head.strip() else head  # a pure indentation is kept whole


def learn(lines: Iterable[str]) -> re.Pattern[str] | None:
    """The prefix most lines with a visible vLLM start share, as an anchored expression."""
    shapes: Counter[Shape] = Counter()
    examples: dict[Shape, list[list[str]]] = {}
    anchored = chars = 0
    for line in islice(lines, LEARN_LINES):
        chars += len(line)
        if chars > LEARN_CHARS:
            break
        head = head_of(strip_ansi(line))
        if head is None:
            continue
        anchored += 1
        tokens = _TOKEN.findall(head)
        shape = tuple(_kind(t) for t in tokens)
        shapes[shape] += 1
        examples.setdefault(shape, []).append(tokens)
    if not shapes:
        return None
    shape, count = shapes.most_common(1)[0]
    if not shape or count < MIN_LINES or count < MIN_SHARE * anchored:
        return None
    return _compile(shape, examples[shape])


def _compile(shape: Shape, examples: list[list[str]]) -> re.Pattern[str]:
    parts = []
    for i, kind in enumerate(shape):
        seen = {tokens[i] for tokens in examples}
        if kind == "d":
            parts.append(r"\d+")
        elif kind in ("w", "s") and len(seen) == 1:
            parts.append(re.escape(next(iter(seen))))
        elif kind == "w":
            parts.append(r"[A-Za-z_]+")
        elif kind == "s":
            parts.append(r"[ \t]+")
        else:
            parts.append(re.escape(kind))
    indentation = shape == ("s",)
    return re.compile("^" + "".join(parts) + ("" if indentation else r"[ \t]?"))


def learn_from(lines: Iterable[tuple[int, str]]) -> tuple[re.Pattern[str] | None, list[tuple[int, str]]]:
    """Learn from the first lines of a stream of (number, line): the expression, and the lines read
    (to be parsed before the rest of the stream; at most LEARN_LINES of them are held)."""
    held: list[tuple[int, str]] = []
    chars = 0
    for number, text in lines:
        held.append((number, text))
        chars += len(text)
        if len(held) >= LEARN_LINES or chars > LEARN_CHARS:
            break
    return learn(text for _, text in held), held


def replay(held: list[tuple[int, str]], rest: Iterator[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    yield from held
    yield from rest
