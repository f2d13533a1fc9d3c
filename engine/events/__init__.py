"""The event wing: every decision the engine makes, as typed records, and everything
folded from them.

``engine.events`` itself is the schema's public face (the records, the bus, the JSONL
sink and reader, from :mod:`engine.events.schema`); :mod:`~engine.events.phase_data` types
each startup phase's ``data`` (one frozen record per phase A–G); the folds live beside it:
:mod:`~engine.events.block_table` (block deltas -> tables), :mod:`~engine.events.view`
(``EngineView``, what /debug/state and the dashboard show), :mod:`~engine.events.tally`
(a run's totals and peaks, for the driver and the simulator), :mod:`~engine.events.stats`
(the stats line) and :mod:`~engine.events.metrics` (vLLM's Prometheus families), with
:mod:`~engine.events.block_residency` (each block's birth, hits and eviction, for the
residency histograms) and :mod:`~engine.events.iteration_details` (vLLM's per-step
iteration line).
"""

from engine.events.schema import (
    EVENT_TYPES,
    PHASES,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    EngineConfigEvent,
    EngineStopped,
    Event,
    EventBus,
    JsonlSink,
    KvEventBatch,
    LogEvent,
    MetricsScrape,
    Recording,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    RequestRejected,
    RequestScheduled,
    SinkFailed,
    SnapshotEvent,
    StartupEta,
    StartupPhase,
    StartupProgress,
    StatsEvent,
    StepEvent,
    Subscriber,
    dumps,
    event_from_dict,
    header,
    iter_jsonl,
    open_sink,
    read_events,
    sink_name,
)

__all__ = [
    "EVENT_TYPES", "PHASES", "SCHEMA_NAME", "SCHEMA_VERSION", "EngineConfigEvent", "EngineStopped", "Event", "EventBus", "JsonlSink",
    "KvEventBatch", "LogEvent", "MetricsScrape", "Recording", "RequestArrived", "RequestFinished", "RequestFirstToken", "RequestPreempted",
    "RequestRejected", "RequestScheduled", "SinkFailed", "SnapshotEvent", "StartupEta", "StartupPhase", "StartupProgress", "StatsEvent", "StepEvent", "Subscriber",
    "dumps", "event_from_dict", "header", "iter_jsonl", "open_sink", "read_events", "sink_name",
]
