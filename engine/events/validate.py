"""The recording schema, checked on read.

A recording damaged in its bytes (a cut or garbled line) fails to parse; one damaged
in its types (``"t": "NaN"``, ``"allocated": null``, ``"config": null``) parses, and
without a check would reach a reader as a traceback far from the cause. So every row
is converted by msgspec into the type that declares it: an event into its dataclass
(engine/events/*_records.py; msgspec checks each field's annotation), the header into
:class:`RecordingHeader`. Where a dataclass leaves a shape open (``dict[str, Any]``)
but readers compute with what is inside, the shape is declared here too: each startup
phase's ``data`` (its record in engine/events/phase_data.py), the memory readings
around a phase and a refused phase's fixes, a step's ``scheduled`` entries and
``cached_runs``, an encoder step's items, and the flags of the header and ``engine.config``
(derived from engine/config.py's EngineConfig, the one declaration of the flags).

A value of the wrong type raises :class:`SchemaError` naming the field;
``read_events`` adds the file and the line. Keys nobody declares are let through,
so older readers survive newer writers.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.events.phase_data import PHASE_DATA
from engine.events.record import Event
from engine.events.schema import EVENT_TYPES
from engine.events.startup_records import EngineConfigEvent, StartupPhase
from engine.events.step_records import EncoderStepEvent, StepEvent


class SchemaError(ValueError):
    """A value whose JSON type is not the declared one: ``where`` names the field
    (``t``, ``allocated[...]``, ``data.num_blocks``), ``problem`` says what was found."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"field `{where}`: {problem}" if where else problem)
        self.where = where
        self.problem = problem


def _recorded_type(hint: Any) -> Any:
    """How a flag of type ``hint`` reads back: a dataclass-valued one (``kv_events_config``)
    as the dict ``EngineConfig.to_dict`` wrote, and null allowed for every one (readers take
    the default for a flag that is null)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    return (dict[str, Any] if dataclasses.is_dataclass(hint) else hint) | None


def recorded_flags(config: type[EngineConfig] = EngineConfig) -> type[msgspec.Struct]:
    """The flags of a header's ``config`` and of ``engine.config``: every field of
    engine/config.py's EngineConfig, typed as it declares them (so a new flag is checked on
    read without a line here), and ``simulation``, which only ``engine simulate`` writes
    (the GPU preset and pool it simulated)."""
    hints = typing.get_type_hints(config)
    fields = [(f.name, _recorded_type(hints[f.name]), None) for f in dataclasses.fields(config)]
    fields.append(("simulation", dict[str, Any] | None, None))
    return msgspec.defstruct("RecordedFlags", fields, module=__name__)


RecordedFlags = recorded_flags()

# A recording's first line (engine/events/recording.py ``header()``). Built as RecordedFlags is,
# because its ``config`` is of that derived type.
RecordingHeader = msgspec.defstruct("RecordingHeader", [
    ("schema", str),
    ("version", int, 0),
    ("config", RecordedFlags, msgspec.field(default_factory=RecordedFlags)),
    ("started_unix", float | None, None),
], module=__name__)


class MemoryReadingData(msgspec.Struct):
    """``memory_before`` / ``memory_after`` of a startup phase: engine/model/memory/device.py's
    MemoryReading (not imported: it needs torch), bytes as integers."""

    device: str | None = None
    total: int | None = None
    free: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    peak: int | None = None
    source: str | None = None
    process_used: int | None = None


class FixData(msgspec.Struct):
    """One of a failed phase's ``fixes``: engine/budget/fixes.py's ``Fix.to_json`` (not
    imported: the budget wing sits above this one)."""

    flag: str = ""
    current: Any = None
    proposed: Any = None
    why: str = ""
    effect: str | None = None
    numbers: dict[str, Any] = msgspec.field(default_factory=dict)


class CachedRunData(msgspec.Struct):
    """One entry of a step's ``cached_runs`` (engine/core/step_events.py)."""

    block_ids: list[int] = msgspec.field(default_factory=list)
    hashes: list[int] = msgspec.field(default_factory=list)
    parent_hash: int | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)


def _phase_schema(record: type) -> type:
    """A Struct with ``record``'s data fields and their declared types, every one
    optional (a phase reports only what it knows)."""
    hints = typing.get_type_hints(record)
    fields = [(f.name, hints[f.name], None) for f in dataclasses.fields(record) if f.name not in ("extra", "reported")]
    return msgspec.defstruct(f"{record.__name__}Schema", fields)


# The shapes inside fields a dataclass types as open, per event class: field -> declared type.
_INNER_SHAPES: dict[type[Event], dict[str, Any]] = {
    StartupPhase: {"memory_before": MemoryReadingData | None, "memory_after": MemoryReadingData | None,
                   "fixes": list[FixData]},
    StepEvent: {"scheduled": dict[str, tuple[int, str]], "cached_runs": list[CachedRunData],
                "waiting_reasons": dict[str, list[str | int]], "prefix_lookups": dict[str, list[str | int]]},
    EncoderStepEvent: {"encoded": list[tuple[str, int, int]], "freed": list[tuple[str, int]]},
    EngineConfigEvent: {"config": RecordedFlags},
}


def _shape_schema(name: str, shapes: Mapping[str, Any]) -> type:
    # One Struct per event class (msgspec caches a Struct's decoder; a bare dict[...] alias
    # is rebuilt on every call and cost more than the event itself).
    return msgspec.defstruct(name, [(field_name, shape, None) for field_name, shape in shapes.items()])


_SHAPE_SCHEMAS: dict[type[Event], type] = {cls: _shape_schema(f"{cls.__name__}Shapes", shapes)
                                           for cls, shapes in _INNER_SHAPES.items()}
# A startup phase's shapes with its letter's data record (A-G; another letter: the data is not checked).
_PHASE_SCHEMAS: dict[str, type] = {
    letter: _shape_schema(f"StartupPhase{letter}Shapes", {**_INNER_SHAPES[StartupPhase], "data": _phase_schema(record)})
    for letter, record in PHASE_DATA.items()
}

_DECODER = msgspec.json.Decoder()
_MSGSPEC_AT = re.compile(r"^(?P<problem>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def decode_object(line: str) -> dict[str, Any] | None:
    """One line as a JSON object, or None when it is not one: not JSON at all (a line
    cut short, garbage), NaN or Infinity (not JSON; the sink writes a NaN as null), a
    number out of range, or JSON that is not an object."""
    try:
        obj = _DECODER.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return obj if isinstance(obj, dict) else None


def _convert(value: Any, kind: Any, where: str = "") -> Any:
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise _schema_error(exc, where) from None


def _schema_error(exc: msgspec.ValidationError, prefix: str) -> SchemaError:
    """msgspec's "Expected `float`, got `str` - at `$.t`" as field ``t``, "expected float, got str"."""
    match = _MSGSPEC_AT.match(str(exc))
    assert match is not None  # the pattern matches any text
    problem = match["problem"].replace("`", "")
    problem = problem[:1].lower() + problem[1:]
    path = (match["path"] or "").lstrip(".")
    if prefix and path:
        path = prefix + ("" if path.startswith("[") else ".") + path
    return SchemaError(path or prefix, problem)


def check_header(row: Mapping[str, Any]) -> None:
    """Raise :class:`SchemaError` when a header's fields (``config`` among them) are
    not of their declared types."""
    _convert(row, RecordingHeader)


def event_from_row(row: Mapping[str, Any]) -> Event:
    """The typed event of one JSON row; ValueError for an unknown ``type``,
    :class:`SchemaError` for a field of the wrong type."""
    kind = row.get("type")
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown event type {kind!r}")
    event = _convert(row, cls)
    shapes = _PHASE_SCHEMAS.get(event.phase) if isinstance(event, StartupPhase) else None
    shapes = shapes or _SHAPE_SCHEMAS.get(cls)
    if shapes is not None:
        shaped = _convert(row, shapes)
        if isinstance(event, StartupPhase) and isinstance(event.data, dict):
            _floats_as_declared(event.data, getattr(shaped, "data", None))
    return event


def _floats_as_declared(data: dict[str, Any], shaped: Any) -> None:
    """A phase's ``data`` keeps the row's own values (its open dict), so a float field written
    as a whole number (``0``, as another writer may) takes the checked copy's float: readers
    of the declared types see a float."""
    if shaped is None:
        return
    for name in shaped.__struct_fields__:
        value = getattr(shaped, name)
        if isinstance(value, float) and type(data.get(name)) is int:
            data[name] = value
