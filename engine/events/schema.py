"""The event schema: its name and version, and every record type under its wire name.

Events are the single source of truth (docs/architecture.md): the monitor, the
Prometheus metrics, the periodic stats line, replay and the tests all read these
records and nothing else. An event is a small slotted dataclass (``record.Event``);
serialisation happens only in sinks, so publishing with nobody listening costs almost
nothing. The records live by what they describe: ``startup_records``, ``request_records``,
``step_records``, ``engine_records``; the bus (``bus``) stamps them, the JSONL recording
(``recording``) writes and reads them.

Every event carries ``type``, ``seq`` (monotonic integer) and ``t`` (seconds since
engine start on the bus clock). Producers build events without ``seq``/``t``; the
bus stamps both when it publishes, using the clock it was given (wall monotonic
for the real engine, simulated seconds for ``engine simulate``).
"""

from __future__ import annotations

from typing import Any

from engine.events.engine_records import (
    EngineRecovered,
    EngineStalled,
    EngineStopped,
    KvEventBatch,
    LogEvent,
    MetricsScrape,
    SinkFailed,
    SnapshotEvent,
    StatsEvent,
)
from engine.events.record import Event
from engine.events.request_records import (
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    RequestRejected,
    RequestScheduled,
)
from engine.events.startup_records import EngineConfigEvent, StartupEta, StartupPhase, StartupProgress
from engine.events.step_records import EncoderStepEvent, StepEvent

SCHEMA_NAME = "kvscope.events"
SCHEMA_VERSION = 1


EVENT_TYPES: dict[str, type[Event]] = {
    cls.type: cls
    for cls in (
        EngineConfigEvent,
        StartupPhase,
        StartupProgress,
        StartupEta,
        RequestArrived,
        RequestScheduled,
        RequestFirstToken,
        RequestPreempted,
        RequestFinished,
        RequestRejected,
        StepEvent,
        EncoderStepEvent,
        StatsEvent,
        SnapshotEvent,
        LogEvent,
        EngineStopped,
        EngineStalled,
        EngineRecovered,
        SinkFailed,
        MetricsScrape,
        KvEventBatch,
    )
}


def event_from_dict(data: dict[str, Any]) -> Event:
    """Rebuild a typed event from its JSON form, each field checked against its
    declared type (engine/events/validate.py); unknown keys are ignored so older
    readers survive newer writers. ValueError (a ``SchemaError`` naming the field)
    when a value is of the wrong type or the ``type`` is unknown."""
    from engine.events.validate import event_from_row  # it imports EVENT_TYPES from here

    return event_from_row(data)
