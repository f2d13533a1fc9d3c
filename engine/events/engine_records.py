"""The running engine's other records: the periodic stats, a snapshot for a new subscriber,
a log line, stopped, stalled and recovered, a failed sink; and other engines' streams read
into a recording (a ``/metrics`` scrape, a vLLM KV event batch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.events.record import Event


@dataclass(slots=True)
class StatsEvent(Event):
    """The periodic summary vLLM prints every --stats-interval seconds."""

    type: ClassVar[str] = "stats"
    interval_s: float = 0.0
    prompt_throughput: float = 0.0
    generation_throughput: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0


@dataclass(slots=True)
class SnapshotEvent(Event):
    """The whole visible state at once, sent first to a new live subscriber."""

    type: ClassVar[str] = "snapshot"
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class LogEvent(Event):
    """A free-form engine message (warnings, refusals) for event consumers."""

    type: ClassVar[str] = "log"
    level: str = "info"
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class EngineStopped(Event):
    """The engine loop raised out of a step: its own state is unknown, so it stopped (the
    server answers /health 503 and exits 1). ``error`` is the exception in one line."""

    type: ClassVar[str] = "engine.stopped"
    error: str = ""


@dataclass(slots=True)
class EngineStalled(Event):
    """An engine core has work and finished no step within the stall limit (``--stall-timeout``;
    engine/serve/stall.py): ``rank`` (the data-parallel rank, 0 for one core) is alive or not,
    but makes no progress. ``phase`` is what its step was doing (engine/heartbeat.py's phases),
    ``stalled_s`` how long it had been at it, ``last_step`` the last step it finished (its
    ``index``, None before any), ``requests`` the ids it held, ``dump`` the file of its stacks,
    last step and requests (None when none could be written)."""

    type: ClassVar[str] = "engine.stalled"
    rank: int = 0
    phase: str = ""
    stalled_s: float = 0.0
    limit_s: float = 0.0
    last_step: int | None = None
    num_waiting: int = 0
    num_running: int = 0
    requests: list[str] = field(default_factory=list)
    dump: str | None = None


@dataclass(slots=True)
class EngineRecovered(Event):
    """A stalled engine core finished a step again (or its work left): ``stalled_s`` from the
    start of the stalled step (or the last sign of progress) until now."""

    type: ClassVar[str] = "engine.recovered"
    rank: int = 0
    stalled_s: float = 0.0
    last_step: int | None = None


@dataclass(slots=True)
class SinkFailed(Event):
    """A subscriber of the bus (the recording, an exporter, a metrics fold) raised: the
    bus stopped delivering to it and the engine went on. ``sink`` names it, ``error``
    is the exception in one line, ``at_event`` the type of the event it failed on."""

    type: ClassVar[str] = "sink.failed"
    sink: str = ""
    error: str = ""
    at_event: str = ""


# ------------------------------------------------------- other engines' streams
@dataclass(slots=True)
class MetricsScrape(Event):
    """One scrape of another server's Prometheus ``/metrics`` (a vLLM replica, or a
    kvscope one watched through its vLLM families): ``text`` is the exposition text
    as served, less comment and ``_created`` lines, so a recording replays through
    the same parser the live monitor uses."""

    type: ClassVar[str] = "metrics.scrape"
    source: str = ""
    text: str = ""


@dataclass(slots=True)
class KvEventBatch(Event):
    """One vLLM KV-cache ``EventBatch`` as received from its ZMQ publisher:
    ``batch_seq`` the publisher's sequence number, ``ts`` its timestamp, ``events``
    the BlockStored / BlockRemoved / AllBlocksCleared maps (each tagged ``type``)."""

    type: ClassVar[str] = "kv.events"
    source: str = ""
    batch_seq: int = 0
    ts: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)
    data_parallel_rank: int | None = None
