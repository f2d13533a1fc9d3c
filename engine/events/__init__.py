"""The event wing: every decision the engine makes, as typed records, and everything folded
from them. ``engine.events`` itself is the schema's public face (the records, the bus, the
JSONL sink and reader, from ``schema``).

The records and how they are read:

- ``schema``: event records, the bus, the JSONL sink and reader, the step-budget rule
- ``validate``: every recording line type-checked on read
- ``bounded``: every user file read line by line under size, depth and inflation caps
- ``phase_data``: each startup phase's numbers as a frozen record
- ``phase_names``: phases A–G under vLLM's startup span names
- ``ledger``: each memory quantity named once: field, label, unit, vLLM phrase, JSON key
- ``roofline``: a step's FLOPs and bytes (simulate and MFU metrics)

The folds:

- ``view``: ``EngineView``, the whole state, for ``/debug/state``, ``/events`` and the dashboard
- ``block_table``: block tables rebuilt from step events
- ``tally``: ``RunTally``, a run's totals, peaks and per-request times
- ``request_lifecycle``: one request's whole life; per-request metrics
- ``accounting``: every arrival finished once with a typed reason; aborts by cause, discarded prefill work
- ``kv_occupancy``: KV occupancy by token slots, filled against allocated per KV cache group
- ``sessions``: a session's turns: the previous turn's blocks still resident, who evicted the rest
- ``run_diff``: a run's profile, and two profiles compared
- ``expert_load``: MoE expert counts over a window
- ``dp_balance``: data-parallel ranks' load over a run
- ``frozen_counters``: a stall seen from ``/metrics``: requests running, token counters frozen
- ``pipeline_idle``: pipeline stages' bubbles over a run
- ``parallel_window``: the last seconds of both, for the monitor
- ``feed``: live feeds: the in-process bus, a server's ``/events``

The outputs:

- ``observers``: the one place that builds a bus's sinks from config and flags
- ``metrics``: vLLM's Prometheus families
- ``priority_metrics``: the bucketed ``priority`` label, ``request_priority``, ``scheduler_policy_info``
- ``block_residency``: the ``--kv-cache-metrics`` histograms
- ``stats``: the periodic stats line and ``stats`` event
- ``iteration_details``: vLLM's ``Iteration(N)`` log line
- ``progress``: the console bar for ``startup.progress``
- ``otel``: OpenTelemetry spans in vLLM's shapes
- ``perfetto``: a Trace Event Format timeline
- ``kv_events_config``: ``--kv-events-config``, vLLM's ``KVEventsConfig`` parsed
- ``kv_events``: step events folded into vLLM's KV event batches
- ``kv_publisher``: the ZMQ PUB and replay sockets
- ``kv_snapshot``: the whole cache as ``BlockStored`` events for a cold router
- ``forward_pass``: vLLM's ``ForwardPassMetrics`` over ZMQ
- ``bench_outputs``: ``vllm bench serve`` and ``vllm bench startup`` outputs from events
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
