"""The event wing: every decision the engine makes, as typed records, and everything folded
from them. ``engine.events`` itself is the schema's public face: the records, the bus, the
JSONL sink and reader, re-exported from the modules below.

The records and how they are read, at the package root:

- ``schema``: the schema's name and version, every record type under its wire name
- ``record``: ``Event``, the base record: ``type``, ``seq``, ``t`` and its dict form
- ``startup_records``: the configuration, startup phases A–G, their progress and ETA
- ``request_records``: a request's life: arrived, scheduled, first token, preempted, finished, rejected
- ``step_records``: the ``step`` event, why a request waited, the step-budget rule, encoder steps
- ``engine_records``: stats, snapshots, logs, stalls, failed sinks; other engines' scrapes and KV batches
- ``bus``: ``EventBus``, the fan-out that stamps ``seq`` and ``t``
- ``deferred_delivery``: observers fed in batches (0.05 s behind while the engine steps), reads flushing first
- ``recording``: the JSONL wire form, the recording's header, sink and reader
- ``validate``: every recording line type-checked on read
- ``bounded``: every user file read line by line under size, depth and inflation caps
- ``phase_data``: each startup phase's numbers as a frozen record
- ``phase_names``: phases A–G under vLLM's startup span names
- ``ledger``: each memory quantity named once: field, label, unit, vLLM phrase, JSON key
- ``roofline``: a step's FLOPs and bytes (simulate and MFU metrics)
- ``feed``: live feeds: the in-process bus, a server's ``/events``

The subpackages:

- ``folds``: state folded from the events: the view, block tables, run tallies, request lives,
  accounting, KV occupancy and residency, sessions, run profiles, the parallel views
- ``exporters``: the events turned into other tools' shapes: Prometheus, the stats and log
  lines, traces, vLLM's KV events and forward-pass metrics, ``vllm bench`` outputs, and the
  one place that builds a bus's sinks
"""

from engine.events.bus import EventBus, Subscriber, sink_name
from engine.events.engine_records import (
    EngineStopped,
    KvEventBatch,
    LogEvent,
    MetricsScrape,
    SinkFailed,
    SnapshotEvent,
    StatsEvent,
)
from engine.events.record import Event
from engine.events.recording import JsonlSink, Recording, dumps, header, iter_jsonl, open_sink, read_events
from engine.events.request_records import (
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    RequestRejected,
    RequestScheduled,
)
from engine.events.schema import EVENT_TYPES, SCHEMA_NAME, SCHEMA_VERSION, event_from_dict
from engine.events.startup_records import PHASES, EngineConfigEvent, StartupEta, StartupPhase, StartupProgress
from engine.events.step_records import StepEvent

__all__ = [
    "EVENT_TYPES", "PHASES", "SCHEMA_NAME", "SCHEMA_VERSION", "EngineConfigEvent", "EngineStopped", "Event", "EventBus", "JsonlSink",
    "KvEventBatch", "LogEvent", "MetricsScrape", "Recording", "RequestArrived", "RequestFinished", "RequestFirstToken", "RequestPreempted",
    "RequestRejected", "RequestScheduled", "SinkFailed", "SnapshotEvent", "StartupEta", "StartupPhase", "StartupProgress", "StatsEvent", "StepEvent", "Subscriber",
    "dumps", "event_from_dict", "header", "iter_jsonl", "open_sink", "read_events", "sink_name",
]
