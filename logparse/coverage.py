"""How much of a log logparse explains: records recognised by a hand-written pattern, known
to vLLM's catalogue, classed as another program's noise, or unknown (grouped by masked
template, with memory bounded on any log)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from logparse.catalogue import mask
from logparse.fastscan import BulkRun
from logparse.parser import Record
from logparse.patterns import NOISE_SOURCES

UNKNOWN_TEMPLATES_KEPT = 2000  # distinct unknown templates counted (memory stays bounded on any log)
UNKNOWN_TEMPLATES_SHOWN = 20
UNKNOWN_LINES_KEPT = 200


@dataclass(slots=True)
class UnknownTemplate:
    """Unknown records that are one line masked alike (:func:`logparse.catalogue.mask`)."""

    template: str
    count: int
    first_line: int

    def to_json(self) -> dict[str, Any]:
        return {"template": self.template, "count": self.count, "first_line": self.first_line}


@dataclass(slots=True)
class Coverage:
    """How much of a log logparse explains, per record (line) and per template: records a
    hand-written pattern recognised (meaning, figures), records only the generated catalogue
    of vLLM's source knows (``catalogued``), records classed as another program's
    (``noise``, by source), and the unknown rest with their first lines (at most
    :data:`UNKNOWN_LINES_KEPT`), grouped by masked template so a warning printed a hundred
    times is one unknown template."""

    recognised: int = 0
    catalogued: int = 0
    noise: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NOISE_SOURCES, 0))
    unknown: int = 0
    unknown_lines: list[int] = field(default_factory=list)
    known_templates: set[str] = field(default_factory=set)  # pattern ids, catalogue ids, noise sources
    unknown_templates: dict[str, UnknownTemplate] = field(default_factory=dict)
    unknown_templates_dropped: int = 0  # records of unknown templates past UNKNOWN_TEMPLATES_KEPT
    ray_folded: int = 0  # lines Ray printed once for many ('[repeated Nx across cluster]': N - 1 each)

    @property
    def records(self) -> int:
        return self.recognised + self.catalogued + sum(self.noise.values()) + self.unknown

    def add(self, record: Record) -> None:
        self.ray_folded += record.repeated - 1
        if record.pattern is not None:
            self.recognised += 1
            self.known_templates.add(record.pattern.id)
        elif record.template is not None:
            self.catalogued += 1
            self.known_templates.add(f"vllm:{record.template.id}")
        elif record.noise is not None:
            self.noise[record.noise] += 1
            self.known_templates.add(f"noise:{record.noise}")
        else:
            self.unknown += 1
            if len(self.unknown_lines) < UNKNOWN_LINES_KEPT:
                self.unknown_lines.append(record.line)
            key = mask(record.text)
            group = self.unknown_templates.get(key)
            if group is not None:
                group.count += 1
            elif len(self.unknown_templates) < UNKNOWN_TEMPLATES_KEPT:
                self.unknown_templates[key] = UnknownTemplate(key, 1, record.line)
            else:
                self.unknown_templates_dropped += 1

    def add_bulk(self, run: BulkRun) -> None:
        self.recognised += run.records
        self.known_templates.update(p.id for p in run.patterns)

    def top_unknown(self, n: int = UNKNOWN_TEMPLATES_SHOWN) -> list[UnknownTemplate]:
        return sorted(self.unknown_templates.values(), key=lambda t: (-t.count, t.first_line))[:n]

    def to_json(self) -> dict[str, Any]:
        total = self.records or 1
        templates = len(self.known_templates) + len(self.unknown_templates)
        return {"records": self.records, "recognised": self.recognised, "catalogued": self.catalogued,
                "noise": sum(self.noise.values()), "unknown": self.unknown,
                "unknown_share": round(self.unknown / total, 6), "ray_folded_lines": self.ray_folded,
                "noise_by_source": {k: v for k, v in self.noise.items() if v}, "unknown_lines": list(self.unknown_lines),
                "templates": {"known": len(self.known_templates), "unknown": len(self.unknown_templates),
                              "unknown_share": round(len(self.unknown_templates) / (templates or 1), 6),
                              "unknown_records_beyond_kept": self.unknown_templates_dropped},
                "unknown_templates": [t.to_json() for t in self.top_unknown()]}
