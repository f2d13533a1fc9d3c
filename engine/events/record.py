"""``Event``, the base every record extends: ``type`` (the wire name, a class constant),
``seq`` and ``t`` (stamped by the bus when it publishes), and its dict form for the JSONL
recording (engine/events/recording.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(slots=True)
class Event:
    """Base of every event. ``type`` is a class constant, the wire name."""

    type: ClassVar[str] = "event"
    # Fields written only when non-empty: facts recorded only when a feature asks for
    # them (the KV cache events' block contents), so a recording made without it is
    # byte for byte what it was before the field existed.
    written_when_set: ClassVar[frozenset[str]] = frozenset()
    seq: int = field(default=0, kw_only=True)
    t: float = field(default=0.0, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        optional = self.written_when_set
        for name in _field_names(type(self)):
            value = getattr(self, name)
            if optional and not value and name in optional:
                continue
            out[name] = value
        return out



_FIELD_CACHE: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_CACHE.get(cls)
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(cls))
        _FIELD_CACHE[cls] = names
    return names
