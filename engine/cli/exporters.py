"""The trace exporters' flags and the sinks they subscribe to a bus.

``--otlp-traces-endpoint URL`` (vLLM's flag; ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
grpc | http/protobuf picks the transport, grpc by default, as vLLM) sends
OpenTelemetry spans (engine/events/otel.py); ``--collect-detailed-traces`` (vLLM's
``model`` | ``worker`` | ``all``) adds forward / execute seconds to each request span;
``--trace-out PATH`` writes a Perfetto / Chrome trace (engine/events/perfetto.py) when
the run ends. ``--trace`` stays the simulator's workload *input*; the output flag has
its own name everywhere. ``--enable-logging-iteration-details`` (vLLM's) logs one
``Iteration(N): ...`` line per step (engine/events/iteration_details.py). All are off
unless given; opentelemetry is imported only when ``--otlp-traces-endpoint`` is.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from engine.errors import UserError

if TYPE_CHECKING:
    from engine.events import Event, EventBus

# vLLM's --collect-detailed-traces choices -> (forward seconds, forward + sample seconds)
DETAILED_TRACES: dict[str, tuple[bool, bool]] = {"model": (True, False), "worker": (False, True), "all": (True, True)}


def add_exporter_flags(p: argparse.ArgumentParser, *, replay: bool = False) -> None:
    """The exporter flags in one "traces" group. ``replay`` adds the short spellings
    ``engine replay`` takes (``--otlp``, ``--trace``: it has no workload trace input)."""
    g = p.add_argument_group("traces", "OpenTelemetry spans and a Perfetto timeline, built from the events")
    otlp = ("--otlp-traces-endpoint", "--otlp") if replay else ("--otlp-traces-endpoint",)
    g.add_argument(*otlp, dest="otlp_traces_endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry spans (startup phases, one llm_request per request) to this OTLP "
                        "endpoint; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc (default) or http/protobuf, as vLLM"
                        + ("; a recording's spans keep their original times" if replay else ""))
    g.add_argument("--collect-detailed-traces", choices=tuple(DETAILED_TRACES), default=None,
                   help="as vLLM: add each request's forward seconds (model), forward + sample seconds "
                        "(worker) or both (all) to its span")
    out = ("--trace-out", "--trace") if replay else ("--trace-out",)
    g.add_argument(*out, dest="trace_out", default=None, metavar="PATH",
                   help="write a Perfetto / Chrome trace (Trace Event Format JSON) of the run here; open it in "
                        "ui.perfetto.dev")
    p.add_argument("--enable-logging-iteration-details", action="store_true",
                   help="as vLLM: log each step's context and generation requests and tokens and its model time "
                        "(Iteration(N): ... iteration elapsed time: X ms)")


class _Sink(Protocol):
    def __call__(self, event: Event) -> None: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class Exporters:
    """The sinks the flags asked for. ``close`` ends each (the trace file is written,
    queued spans are exported); ``feed`` hands them a recording's events."""

    sinks: list[_Sink] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)  # one line per sink, printed when the run ends

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def feed(self, events: Iterable[Event]) -> None:
        for event in events:
            for sink in self.sinks:
                sink(event)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks.clear()


# the argparse dests of the flags above: any of them given means a sink to build
EXPORTER_DESTS = ("otlp_traces_endpoint", "collect_detailed_traces", "trace_out", "enable_logging_iteration_details")


def exporters_asked(args: argparse.Namespace) -> bool:
    """Whether any exporter flag was given (simulate and replay build a bus or feed a
    recording only then)."""
    return any(getattr(args, dest, None) for dest in EXPORTER_DESTS)


def build_exporters(args: argparse.Namespace, wall_start_unix: float, model_name: str | None = None) -> Exporters:
    """The sinks ``args`` ask for, their flags checked before anything slow runs.
    ``wall_start_unix``: the wall-clock time of the bus clock's zero."""
    exporters = Exporters()
    endpoint = getattr(args, "otlp_traces_endpoint", None)
    detailed = getattr(args, "collect_detailed_traces", None)
    if detailed and not endpoint:
        raise UserError("--collect-detailed-traces adds to OpenTelemetry spans: give --otlp-traces-endpoint URL too")
    trace_out = getattr(args, "trace_out", None)
    if trace_out:
        from engine.events.perfetto import PerfettoTrace

        path = Path(trace_out)
        try:
            path.write_text("", encoding="utf-8")  # refused now, not after the run
        except OSError as exc:
            raise UserError(f"--trace-out {trace_out}: cannot write ({exc.strerror})") from None
        exporters.sinks.append(PerfettoTrace(path))
        exporters.summary.append(f"wrote the Perfetto trace {trace_out} (open it in ui.perfetto.dev)")
    if endpoint:
        from engine.events.otel import OtlpTraceSink, span_exporter, traces_protocol

        try:
            protocol = traces_protocol()
            exporter = span_exporter(endpoint, protocol)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        forward, execute = DETAILED_TRACES.get(detailed or "", (False, False))
        exporters.sinks.append(OtlpTraceSink(exporter, wall_start_unix=wall_start_unix, model_name=model_name,
                                             forward_times=forward, execute_times=execute))
        # delivery failures are the SDK's to report (its log names each one)
        exporters.summary.append(f"sent OpenTelemetry spans to {endpoint} ({protocol})")
    if getattr(args, "enable_logging_iteration_details", False):
        from engine.events.iteration_details import IterationDetailsLog
        from engine.logs import get_logger

        exporters.sinks.append(IterationDetailsLog(get_logger("kvscope.core").info))
    return exporters


def attach_exporters(args: argparse.Namespace, bus: EventBus) -> Exporters:
    """Build the asked-for sinks and subscribe them to ``bus`` (before startup, so the
    phases are in them)."""
    exporters = build_exporters(args, wall_start_unix=time.time() - bus.now())
    for sink in exporters.sinks:
        bus.subscribe(sink)
    return exporters


def recording_wall_start(header: dict[str, Any], path: str | Path, last_t: float) -> tuple[float, str | None]:
    """The wall-clock time of a recording's clock zero: the header's ``started_unix``
    when it has one, else the file's modification time less its last event's ``t``
    (the file was last written at that event), with a note saying so."""
    started = header.get("started_unix")
    if isinstance(started, int | float):
        return float(started), None
    mtime = Path(path).stat().st_mtime
    return mtime - last_t, ("note: the recording has no wall-clock start; span times are placed so its last "
                            "event falls at the file's modification time")
