"""Every line vLLM's own source can log, as generated data.

``vllm_templates.json.gz`` holds every logger call of vLLM's releases 0.4–0.33 and of the
plugins real logs show (tpu-inference, vllm-ascend, vllm-omni, vllm-gaudi), written by
:mod:`logparse.catalogue.generate` from the released sources: a level, the message as
literal parts and placeholders (``["f", "elapsed"]``: the conversion and the argument's
source text), the files and the releases (vLLM's, then the plugins') that print it. The
hand-written rows of :mod:`logparse.patterns` give a line its meaning (phase, figures,
failures, fixes); this catalogue recognises the rest, so a line no row knows is still
"vLLM's, from this file, at this level" rather than unknown.

Each template becomes a regular expression mechanically (:func:`template_regex`) when a
message first needs it; one Aho-Corasick automaton over each template's longest literal
picks the few templates a message can be, so a message costs one scan however many
templates there are. What stays unknown is grouped by :func:`mask` (numbers, quoted
names, paths, ids masked), so one warning repeated a hundred times is one template.

- ``generate``: the catalogue written from vLLM's released sources (run by hand)
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import ahocorasick

CATALOGUE_PATH = Path(__file__).with_name("vllm_templates.json.gz")

Part = str | list[str]  # a literal, or [conversion, argument source text]

MIN_ANCHOR_CHARS = 6  # a template's longest literal must be this long to be looked for
MIN_LITERAL_LETTERS = 8  # ... and its literals hold this many letters: "%s: %s" would match anything
MATCH_CHARS = 4096  # a message is matched on its first this many characters
MATCH_CACHE = 4096  # messages remembered with their template (a repeated warning is matched once)

_NUMBER_RE = r"[-+]?(?:\d[\d,_]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?%?|[-+]?(?:nan|inf)"
PLACEHOLDER_RES: dict[str, str] = {
    "d": r"-?\d[\d,_]*", "i": r"-?\d[\d,_]*", "u": r"\d[\d,_]*",
    "f": _NUMBER_RE, "F": _NUMBER_RE, "e": _NUMBER_RE, "E": _NUMBER_RE, "g": _NUMBER_RE, "G": _NUMBER_RE,
    "x": r"(?:0[xX])?[0-9a-fA-F]+", "X": r"(?:0[xX])?[0-9a-fA-F]+", "o": r"[0-7]+", "c": r".",
}
_ANY = r".*?"
_SPACE = re.compile(r"\s+")


def first_line_parts(parts: list[Part]) -> tuple[list[Part], bool]:
    """The parts a log record's first line shows (a record's message is its first physical
    line, continuation lines joined), and whether the template goes on past it."""
    out: list[Part] = []
    for part in parts:
        if isinstance(part, str):
            text = part if out else part.lstrip("\n")  # the record drops a message's leading newlines
            if "\n" in text:
                head = text.split("\n", 1)[0]
                if head:
                    out.append(head)
                return out, True
            if text:
                out.append(text)
        else:
            out.append(part)
    return out, False


def literals(parts: list[Part]) -> list[str]:
    return [p.strip() for p in first_line_parts(parts)[0] if isinstance(p, str) and p.strip()]


def anchor_of(parts: list[Part]) -> str:
    """The longest literal of the first line: the pre-filter's key."""
    return max(literals(parts), key=len, default="")


def is_matchable(parts: list[Part]) -> bool:
    """Enough literal text to tell this template's lines from others' (``logger.info(msg)``
    of an unknown ``msg``, or ``"%s: %s"``, is not)."""
    text = literals(parts)
    return len(anchor_of(parts)) >= MIN_ANCHOR_CHARS and sum(c.isalpha() for t in text for c in t) >= MIN_LITERAL_LETTERS


def template_regex(parts: list[Part]) -> re.Pattern[str]:
    """A template's first line as a regular expression over a whole message: literals exact
    (a whitespace run matches any whitespace run), each placeholder by its conversion
    (numbers for ``%d``/``%.2f``/``{:.2f}``, anything for ``%s``/``{x}``), anchored at both
    ends unless the template goes on past its first line."""
    shown, continues = first_line_parts(parts)
    pieces: list[str] = []
    for i, part in enumerate(shown):
        if isinstance(part, str):
            text = part.lstrip() if i == 0 else part
            text = text.rstrip() if i == len(shown) - 1 else text
            pieces.append(r"\s+".join(re.escape(w) for w in _SPACE.split(text)))
        else:
            pieces.append(f"(?P<g{i}>{PLACEHOLDER_RES.get(part[0], _ANY)})")
    body = "".join(pieces)
    return re.compile(body + ("" if continues else r"\s*\Z"), re.DOTALL)


@dataclass(frozen=True, slots=True)
class Template:
    """One generated catalogue entry."""

    id: int
    level: str  # DEBUG | INFO | WARNING | ERROR | CRITICAL
    parts: tuple[Part, ...]
    files: tuple[str, ...]
    releases: str  # "0.4.3–0.9.2, 0.12.0, tpu-inference 0.27.0"
    anchor: str
    specificity: int  # literal characters: a more specific template is tried first
    span: int = 0  # vLLM releases that print it (0: a plugin's alone): on a tie the longest-lived is tried first
    regex: re.Pattern[str] | None = field(default=None, compare=False)

    @property
    def text(self) -> str:
        """The template as vLLM's source writes it, placeholders as ``{argument}``."""
        return "".join(p if isinstance(p, str) else "{" + p[1] + "}" for p in self.parts)

    def match(self, message: str) -> dict[str, str] | None:
        regex = self.regex
        if regex is None:
            regex = template_regex(list(self.parts))
            object.__setattr__(self, "regex", regex)
        m = regex.match(message)
        if m is None:
            return None
        names = {f"g{i}": p[1] for i, p in enumerate(first_line_parts(list(self.parts))[0]) if not isinstance(p, str)}
        return {names[k]: v for k, v in m.groupdict().items() if v is not None}

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "level": self.level, "template": self.text, "files": list(self.files),
                "releases": self.releases}


_LEVEL_NAMES = {"D": "DEBUG", "I": "INFO", "W": "WARNING", "E": "ERROR", "C": "CRITICAL"}


class Catalogue:
    """The generated templates with their pre-filter."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.releases: list[str] = list(data["releases"])
        self.plugins: list[str] = list(data.get("plugins", []))  # "tpu-inference 0.27.0": absent in older files
        self.templates: list[Template] = []
        for i, row in enumerate(data["templates"]):
            parts = [p if isinstance(p, str) else list(p) for p in row["p"]]
            spans = ", ".join([*(self.releases[a] if a == b else f"{self.releases[a]}–{self.releases[b]}"
                                 for a, b in row["r"]), *(self.plugins[g] for g in row.get("g", ()))])
            self.templates.append(Template(
                i, _LEVEL_NAMES[row["l"].upper()], tuple(parts), tuple(row["f"]), spans, anchor_of(parts),
                sum(len(t) for t in literals(parts)), span=sum(b - a + 1 for a, b in row["r"])))
        self._automaton = ahocorasick.Automaton()
        by_anchor: dict[str, list[int]] = {}
        for t in self.templates:
            if t.anchor:
                by_anchor.setdefault(t.anchor, []).append(t.id)
        for anchor, ids in by_anchor.items():
            self._automaton.add_word(anchor, tuple(ids))
        if by_anchor:
            self._automaton.make_automaton()
        self._cache: dict[str, Template | None] = {}

    def candidates(self, message: str) -> list[Template]:
        if not self.templates:
            return []
        ids = {i for _, found in self._automaton.iter(message) for i in found}
        return sorted((self.templates[i] for i in ids), key=lambda t: (-t.specificity, -t.span, t.id))

    def match(self, message: str) -> tuple[Template, dict[str, str]] | None:
        """The most specific template whose expression matches ``message`` (its first
        :data:`MATCH_CHARS` characters), with the arguments as printed."""
        probe = message[:MATCH_CHARS].strip()
        if not probe:
            return None
        cached = self._cache.get(probe, False)
        if cached is not False:
            if cached is None:
                return None
            args = cached.match(probe)
            return (cached, args) if args is not None else None
        found: tuple[Template, dict[str, str]] | None = None
        for template in self.candidates(probe):
            args = template.match(probe)
            if args is not None:
                found = (template, args)
                break
        if len(self._cache) >= MATCH_CACHE:
            self._cache.clear()
        self._cache[probe] = found[0] if found else None
        return found


@lru_cache(maxsize=1)
def catalogue() -> Catalogue:
    """The generated catalogue, loaded once (an absent or damaged file is an empty catalogue
    and a message saying so: recognition falls back to the hand-written rows)."""
    try:
        with gzip.open(CATALOGUE_PATH, "rt", encoding="utf-8") as fh:
            return Catalogue(json.load(fh))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        import logging

        logging.getLogger(__name__).warning("logparse: the generated vLLM catalogue %s could not be read (%s); "
                                            "only the hand-written rows recognise lines", CATALOGUE_PATH, exc)
        return Catalogue({"releases": [], "templates": []})


# ------------------------------------------------------------------ unknown lines, grouped
_MASKS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\b\w+://\S+"), "<url>"),
    (re.compile(r"'[^']*'|\"[^\"]*\"|`[^`]*`"), "<str>"),
    (re.compile(r"(?:(?<=\s)|^)(?:[A-Za-z]:)?(?:~|\.{1,2})?(?:[/\\][\w.\-@+=:]+)+[/\\]?"), "<path>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b|\b[0-9a-f]{12,}\b|\b[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}\b"), "<id>"),
    (re.compile(r"\b(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[\w-]{6,}\b"), "<id>"),  # request ids, hashes: cmpl-00ab12-0
    (re.compile(r"(?<!\w)[-+]?\d[\d,_]*(?:\.\d+)?(?:[eE][-+]?\d+)?"), "<n>"),
    (re.compile(r"(?<==)[^\s,;)\]}]+"), "<v>"),
)
MASKED_CHARS = 240


def mask(message: str) -> str:
    """A message with what varies between its printings masked (URLs, quoted strings,
    paths, ids and hashes, numbers, ``key=value`` values), cut to :data:`MASKED_CHARS`:
    the key that groups an unknown line with its repeats."""
    text = message[: MASKED_CHARS * 4]
    for regex, replacement in _MASKS:
        text = regex.sub(replacement, text)
    return _SPACE.sub(" ", text).strip()[:MASKED_CHARS]
