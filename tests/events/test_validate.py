"""The recording schema checked on read (engine/events/validate.py): a real recording
with one value's type changed anywhere either reads back as events whose fields have
their declared types, or is refused with a ValueError naming the line; every
committed recording still reads; the flags' declared types follow EngineConfig."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig, KVEventsConfig
from engine.events import Event, StartupPhase, read_events
from engine.events.phase_data import PHASE_DATA
from engine.events.validate import RecordedFlags, SchemaError, event_from_row, recorded_flags
from tests.paths import DATA, SAMPLES

# A real run of the bundled model (engine run-workload --events), 537 events.
REAL_RUN = SAMPLES / "smollm2_run.jsonl"
REAL_LINES = REAL_RUN.read_text().splitlines()

# A JSON value of each type, to put where another type belongs.
ANY_JSON = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["", "NaN", "1", "prefill"]), st.just([]), st.just({}), st.lists(st.none(), min_size=1, max_size=2),
    st.lists(st.text(max_size=2), min_size=1, max_size=2), st.just({"x": None}),
)


def _paths(value: Any, depth: int = 3) -> list[tuple[Any, ...]]:
    """Every place inside ``value`` (keys and indices, ``depth`` deep)."""
    if depth == 0:
        return []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    out: list[tuple[Any, ...]] = []
    for key, inner in items:
        out.append((key,))
        out.extend((key, *rest) for rest in _paths(inner, depth - 1))
    return out


def conforms(value: Any, hint: Any) -> bool:
    """``value`` is of the declared type ``hint`` (bool is not an int, an int is not a float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if hint in (bool, str, float):
        return type(value) is hint
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(conforms(v, args[0]) for v in value)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(conforms(v, a) for v, a in zip(value, args, strict=True))
    if origin in (dict, Mapping):
        return isinstance(value, Mapping) and all(conforms(k, args[0]) and conforms(v, args[1])
                                                  for k, v in value.items())
    raise AssertionError(f"conforms() has no rule for {hint!r}")


@functools.cache
def declared_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, declared type) of each field of a dataclass: an event or a phase record."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.name not in ("extra", "reported"))


def assert_declared_types(event: Event) -> None:
    for name, hint in declared_fields(type(event)):
        value = getattr(event, name)
        assert conforms(value, hint), (event.type, name, value)
    if isinstance(event, StartupPhase) and event.phase in PHASE_DATA:
        record = PHASE_DATA[event.phase].from_dict(event.data)
        for name, hint in declared_fields(type(record)):
            assert conforms(getattr(record, name), hint), (event.phase, name)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_value_of_another_type_reads_typed_or_is_refused_naming_its_line(tmp_path: Path, data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(REAL_LINES) - 1), label="line index")
    row = json.loads(REAL_LINES[index])
    path = data.draw(st.sampled_from(_paths(row)), label="where")
    new = data.draw(ANY_JSON, label="value")
    parent = row
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    lines = list(REAL_LINES)
    lines[index] = json.dumps(row)
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text("\n".join(lines) + "\n")
    number = index + 1
    try:
        recording = read_events(damaged)
    except ValueError as exc:
        message = str(exc)
        assert message.startswith(f"{damaged}: ")
        assert f"line {number}" in message or (number == 1 and "first line" in message), message
        return
    # The other lines are the real run's (test_the_real_run_reads_with_its_declared_types); the damaged one
    # read as an event of the declared types, or, the last line no longer being an event, as a cut tail.
    if index == 0 or (index == len(REAL_LINES) - 1 and recording.truncated):
        assert len(recording.events) == len(REAL_LINES) - 1 - (index != 0)
        return
    assert len(recording.events) == len(REAL_LINES) - 1
    assert_declared_types(recording.events[index - 1])


def test_the_real_run_reads_with_its_declared_types() -> None:
    recording = read_events(REAL_RUN)
    assert len(recording.events) == len(REAL_LINES) - 1 and not recording.truncated
    for event in recording.events:
        assert_declared_types(event)


def test_a_wrong_type_on_the_last_line_is_damage_not_a_cut(tmp_path: Path) -> None:
    last = json.loads(REAL_LINES[-1])
    last["seq"] = "537"
    damaged = tmp_path / "last.jsonl"
    damaged.write_text("\n".join([*REAL_LINES[:-1], json.dumps(last)]) + "\n")
    with pytest.raises(ValueError, match=rf"line {len(REAL_LINES)}: .* field `seq`: expected int, got str"):
        read_events(damaged)


def test_every_committed_recording_reads() -> None:
    files = sorted(SAMPLES.glob("*.jsonl")) + sorted((DATA / "doctor").glob("*.jsonl.gz"))
    assert len(files) >= 10
    for path in files:
        raw = path.read_bytes()
        recording = read_events(gzip.decompress(raw) if path.suffix == ".gz" else raw, name=str(path))
        assert recording.events and not recording.truncated, path


def _without_none(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1 else hint


def test_the_declared_flag_types_follow_engine_config() -> None:
    flags = typing.get_type_hints(RecordedFlags)
    engine_flags = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        declared = _without_none(engine_flags[f.name])
        assert f.name in flags, f"RecordedFlags lacks EngineConfig.{f.name}"
        expected = dict[str, Any] if dataclasses.is_dataclass(declared) else declared
        assert _without_none(flags[f.name]) == expected, f.name


def test_the_recorded_flags_are_engine_configs_fields_and_no_other() -> None:
    """Derived from EngineConfig (engine/config.py), not written again: every field, plus
    ``simulation``, which engine simulate adds to its header."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(RecordedFlags.__struct_fields__) == names | {"simulation"}


@dataclasses.dataclass
class _WiderConfig(EngineConfig):
    """EngineConfig with a flag added, as the next issue would add one."""

    new_budget_knob: int | None = None
    new_feature: KVEventsConfig | None = None


def test_a_new_engine_config_field_is_recorded_and_checked_without_a_line_in_validate() -> None:
    flags = recorded_flags(_WiderConfig)
    hints = typing.get_type_hints(flags)
    assert hints["new_budget_knob"] == int | None and hints["new_feature"] == dict[str, Any] | None
    wider = _WiderConfig(new_budget_knob=3, new_feature=KVEventsConfig(enable_kv_cache_events=True))
    msgspec.convert(wider.to_dict(), flags)  # what the engine writes reads back
    with pytest.raises(msgspec.ValidationError, match=r"new_budget_knob"):
        msgspec.convert({**wider.to_dict(), "new_budget_knob": "three"}, flags)


def test_optional_flags_are_written_only_when_set() -> None:
    """``when_set`` in a field's metadata: a run without the feature records no key for it,
    so its recording is what it was before the flag existed; set, it reads back checked."""
    when_set = {f.name for f in dataclasses.fields(EngineConfig) if f.metadata.get("when_set")}
    assert {"kv_events_config", "data_parallel_size", "max_decode_step_tokens"} <= when_set
    assert not when_set & set(EngineConfig().to_dict())
    config = EngineConfig(data_parallel_size=2, kv_events_config=KVEventsConfig(enable_kv_cache_events=True))
    written = config.to_dict()
    assert written["data_parallel_size"] == 2 and written["kv_events_config"]["publisher"] == "zmq"
    msgspec.convert(written, RecordedFlags)


def test_a_refused_phases_fixes_are_checked_on_read() -> None:
    row = {"type": "startup.phase", "seq": 1, "t": 0.0, "phase": "B", "name": "budget", "status": "failed",
           "reason": "too small; try lower --max-model-len to 16 or less",
           "fixes": [{"flag": "--max-model-len", "current": 4096, "proposed": 16, "why": "the pool holds 16"}]}
    event = event_from_row(row)
    assert isinstance(event, StartupPhase) and event.fixes[0]["proposed"] == 16
    assert "fixes" not in StartupPhase(phase="B", status="end").to_dict()  # other phases are as they were
    with pytest.raises(SchemaError, match=r"fixes\[0\]\.flag"):
        event_from_row({**row, "fixes": [{"flag": 3}]})
