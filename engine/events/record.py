"""``Event``, the base every record extends: ``type`` (the wire name, a class constant),
``seq`` and ``t`` (stamped by the bus when it publishes), and its dict form for the JSONL
recording (engine/events/recording.py)."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
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
        keys, values_of, optional = _layout(type(self))
        # every value read in one C call and zipped into the dict: a step event has some 50
        # fields, and this runs once per event on the publishing thread
        out = dict(zip(keys, values_of(self), strict=True))
        for name in optional:
            if not out[name]:
                del out[name]
        return out


# a record class -> its dict's keys ("type", then the fields in order), the getter of their
# values, and the fields written only when set
_LAYOUTS: dict[type, tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]], tuple[str, ...]]] = {}


def _layout(cls: type[Event]) -> tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]], tuple[str, ...]]:
    layout = _LAYOUTS.get(cls)
    if layout is None:
        keys = ("type", *(f.name for f in dataclasses.fields(cls)))  # every record has seq and t
        optional = tuple(name for name in keys[1:] if name in cls.written_when_set)
        layout = _LAYOUTS[cls] = (keys, operator.attrgetter(*keys), optional)
    return layout
