"""The one place that builds a bus's observers from the config and the flags.

Every entry point calls :func:`attach_observers`: the engine (``LLMEngine``: the
recording, the KV cache events, the startup progress bar, the stats line),
``engine generate`` / ``run-workload`` / ``serve`` for the trace exporters
(engine/cli/exporters.py turns their flags into :class:`ObserverFlags`), and
``engine simulate`` for all of them at once; ``engine replay`` calls
:func:`build_observers` and feeds them the recording. The server's own folds
(metrics, the view, the ``/events`` hub) belong to its routes and stay in
engine/serve/host.py.

Adding a sink: its module in engine/events/exporters/, the flag that asks for it as a field of
:class:`ObserverFlags`, and one line in :func:`build_observers`. Heavy libraries
(zmq for KV events, opentelemetry for spans) load only when their flag is given.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from engine.config import KVEventsConfig
from engine.errors import UserError
from engine.events.bus import EventBus
from engine.events.record import Event
from engine.events.recording import JsonlSink

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from engine.events.exporters.kv_publisher import KVEventsSink
    from engine.events.exporters.progress import ProgressPrinter
    from engine.events.exporters.stats import StatsReporter
    from engine.events.folds.request_record import SharedRequests

# vLLM's --collect-detailed-traces choices -> (forward seconds, forward + sample seconds)
DETAILED_TRACES: dict[str, tuple[bool, bool]] = {"model": (True, False), "worker": (False, True), "all": (True, True)}


class Sink(Protocol):
    def __call__(self, event: Event) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ObserverFlags:
    """The flags that ask for an observer, as values (from ``EngineConfig`` or argparse)."""

    events_path: str | None = None  # --events: the JSONL recording
    kv_events_config: KVEventsConfig | None = None  # --kv-events-config: vLLM's ZMQ KV cache events
    trace_out: str | None = None  # --trace-out: a Perfetto / Chrome trace
    otlp_traces_endpoint: str | None = None  # --otlp-traces-endpoint: OpenTelemetry spans
    collect_detailed_traces: str | None = None  # --collect-detailed-traces: adds to the spans
    iteration_details: bool = False  # --enable-logging-iteration-details: vLLM's Iteration(N) line
    progress: bool = False  # the startup progress bar / lines on the console (the real engine)
    stats_interval: float = 0.0  # --stats-interval: vLLM's periodic stats line, after startup
    forward_pass_metrics_port: int | None = None  # --forward-pass-metrics-port: vLLM's per-step ZMQ metrics

    def asks(self) -> bool:
        """Whether any sink is asked for (simulate and replay build a bus only then)."""
        return bool(self.events_path or self.kv_events_config or self.trace_out or self.otlp_traces_endpoint
                    or self.collect_detailed_traces or self.iteration_details
                    or self.forward_pass_metrics_port is not None)


@dataclass(slots=True)
class Observers:
    """The sinks the flags asked for. ``feed`` hands them a recording's events;
    ``end_startup`` and ``start_stats`` frame the engine's startup (the progress bar
    during it, the stats line after it); ``close`` publishes the last stats line, then ends each sink (the recording is flushed, the trace file written,
    queued spans exported, the KV publisher stopped)."""

    sinks: list[Sink] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)  # one line per exporter, printed when the run ends
    recording: JsonlSink | None = None
    kv_events: KVEventsSink | None = None
    stats: StatsReporter | None = None
    stats_interval: float = 0.0
    bus: EventBus | None = None  # where they are subscribed (None: fed by hand)
    progress: ProgressPrinter | None = None

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def feed(self, events: Iterable[Event]) -> None:
        for event in events:
            for sink in self.sinks:
                sink(event)

    def end_startup(self) -> None:
        """Startup ended, well or not: the progress bar goes."""
        if self.progress is not None and self.bus is not None:
            self.bus.unsubscribe(self.progress)
        self.progress = None

    def start_stats(self, device_word: str) -> None:
        """The engine is ready: the stats line begins when ``--stats-interval`` asks for it
        (``device_word``: "GPU"/"CPU", the word before "KV cache usage")."""
        if self.bus is not None and self.stats_interval > 0 and self.stats is None:
            from engine.events.exporters.stats import StatsReporter

            self.stats = StatsReporter(self.bus, self.stats_interval, device_word=device_word)
            self.bus.subscribe(self.stats)

    def close(self) -> None:
        if self.stats is not None and self.bus is not None:
            with contextlib.suppress(Exception):  # a final stats line is best effort at shutdown
                self.stats.report(self.bus.now())
        for sink in self.sinks:
            if self.bus is not None:
                self.bus.unsubscribe(sink)
            sink.close()
        self.sinks.clear()  # recording and kv_events stay readable: their counts outlive them


def build_observers(flags: ObserverFlags, *, wall_start_unix: float, recording_config: dict[str, Any] | None = None,
                    recording_started_unix: float | None = None, model_name: str | None = None,
                    span_model_name: str | None = None, registry: CollectorRegistry | None = None,
                    data_parallel_rank: int = 0, shared_requests: SharedRequests | None = None) -> Observers:
    """The sinks ``flags`` ask for, each flag checked before anything slow runs; on a
    failure the ones already opened are closed. ``wall_start_unix``: the wall-clock time
    of the bus clock's zero; ``recording_config``/``recording_started_unix``: the
    recording's header; ``model_name``: the KV events' label; ``span_model_name``: the
    spans' model (None: the ``engine.config`` event's); ``registry``: where sinks that count their own losses register
    those counters (the server's ``/metrics``); ``shared_requests``: the server's request fold, which the
    OTLP, Perfetto and forward-pass exporters read instead of folding their own."""
    if flags.collect_detailed_traces and not flags.otlp_traces_endpoint:
        raise UserError("--collect-detailed-traces adds to OpenTelemetry spans: give --otlp-traces-endpoint URL too")
    observers = Observers(stats_interval=flags.stats_interval)
    try:
        if flags.events_path:
            observers.recording = _recording(flags.events_path, recording_config, recording_started_unix)
            observers.sinks.append(observers.recording)
        if flags.kv_events_config is not None and flags.kv_events_config.publishes:
            from engine.events.exporters.kv_publisher import (
                KVEventsSink,  # zmq and msgspec load only when asked
            )

            observers.kv_events = KVEventsSink(flags.kv_events_config, registry=registry, model_name=model_name or "",
                                               data_parallel_rank=data_parallel_rank)
            observers.sinks.append(observers.kv_events)
        if flags.trace_out:
            observers.sinks.append(_perfetto(flags.trace_out, shared_requests))
            observers.summary.append(f"wrote the Perfetto trace {flags.trace_out} (open it in ui.perfetto.dev)")
        if flags.otlp_traces_endpoint:
            sink, protocol = _otlp(flags, wall_start_unix, span_model_name, shared_requests)
            observers.sinks.append(sink)
            # delivery failures are the SDK's to report (its log names each one)
            observers.summary.append(f"sent OpenTelemetry spans to {flags.otlp_traces_endpoint} ({protocol})")
        if flags.forward_pass_metrics_port is not None:
            from engine.events.exporters.forward_pass import ForwardPassPublisher  # zmq loads only when asked

            publisher = ForwardPassPublisher(flags.forward_pass_metrics_port, dp_rank=data_parallel_rank,
                                             shared_requests=shared_requests)
            observers.sinks.append(publisher)
            observers.summary.append(f"published forward-pass metrics on {publisher.endpoint}")
        if flags.iteration_details:
            from engine.events.exporters.iteration_details import IterationDetailsLog
            from engine.logs import get_logger

            observers.sinks.append(IterationDetailsLog(get_logger("kvscope.core").info))
    except BaseException:
        observers.close()
        raise
    return observers


def delivered_deferred(sink: Any) -> bool:
    """Whether a sink on the real engine's clock is subscribed deferred: every exporter is, but
    the JSONL recording, written as events are published so a killed process loses none of it."""
    return not isinstance(sink, JsonlSink)


def attach_observers(bus: EventBus, flags: ObserverFlags, *, simulated_clock: bool = False,
                     recording_config: dict[str, Any] | None = None, model_name: str | None = None,
                     registry: CollectorRegistry | None = None, data_parallel_rank: int = 0,
                     shared_requests: SharedRequests | None = None) -> Observers:
    """Build the asked-for observers and subscribe them to ``bus`` (before startup, so the
    phases are in them). ``simulated_clock``: the bus keeps simulated time, so the
    recording's header carries no wall-clock start and the sinks are fed as events are
    published. On the real engine's clock the exporters are fed deferred, in batches 0.05 s
    behind while it steps (engine/events/deferred_delivery.py: a sink's code stays warm over a few
    steps); the recording is written as events are published, so a killed process loses none."""
    wall_start = time.time() - bus.now()
    observers = build_observers(flags, wall_start_unix=wall_start, recording_config=recording_config,
                                recording_started_unix=None if simulated_clock else wall_start,
                                model_name=model_name, registry=registry, data_parallel_rank=data_parallel_rank,
                                shared_requests=shared_requests)
    observers.bus = bus
    for sink in observers.sinks:
        bus.subscribe(sink, deferred=not simulated_clock and delivered_deferred(sink))
    if flags.progress:  # long phases show progress where the log lines go (a bar on a terminal)
        from engine.events.exporters.progress import ProgressPrinter
        from engine.logs import console_stream, get_logger

        observers.progress = ProgressPrinter(console_stream(), get_logger("kvscope.startup").info)
        bus.subscribe(observers.progress)
    return observers


def _recording(path: str, config: dict[str, Any] | None, started_unix: float | None) -> JsonlSink:
    try:
        return JsonlSink(path, config=config, started_unix=started_unix)
    except OSError as exc:
        raise UserError(f"--events {path}: cannot write ({exc.strerror})") from None


def _perfetto(trace_out: str, shared_requests: SharedRequests | None) -> Sink:
    from engine.events.exporters.perfetto import PerfettoTrace

    path = Path(trace_out)
    try:
        path.write_text("", encoding="utf-8")  # refused now, not after the run
    except OSError as exc:
        raise UserError(f"--trace-out {trace_out}: cannot write ({exc.strerror})") from None
    return PerfettoTrace(path, shared_requests)


def _otlp(flags: ObserverFlags, wall_start_unix: float, model_name: str | None,
          shared_requests: SharedRequests | None) -> tuple[Sink, str]:
    from engine.events.exporters.otel import OtlpTraceSink, span_exporter, traces_protocol

    endpoint = flags.otlp_traces_endpoint or ""
    try:
        protocol = traces_protocol()
        exporter = span_exporter(endpoint, protocol)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    forward, execute = DETAILED_TRACES.get(flags.collect_detailed_traces or "", (False, False))
    return OtlpTraceSink(exporter, wall_start_unix=wall_start_unix, model_name=model_name,
                         forward_times=forward, execute_times=execute, shared_requests=shared_requests), protocol
