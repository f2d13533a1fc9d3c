"""The trace exporters' flags, turned into :class:`~engine.events.exporters.observers.ObserverFlags`
for the one place that builds the sinks (engine/events/exporters/observers.py).

``--otlp-traces-endpoint URL`` (vLLM's flag; ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
grpc | http/protobuf picks the transport, grpc by default, as vLLM) sends
OpenTelemetry spans (engine/events/exporters/otel.py); ``--collect-detailed-traces`` (vLLM's
``model`` | ``worker`` | ``all``) adds forward / execute seconds to each request span;
``--trace-out PATH`` writes a Perfetto / Chrome trace (engine/events/exporters/perfetto.py) when
the run ends. ``--trace`` stays the simulator's workload *input*; the output flag has
its own name everywhere. ``--enable-logging-iteration-details`` (vLLM's) logs one
``Iteration(N): ...`` line per step (engine/events/exporters/iteration_details.py). All are off
unless given; opentelemetry is imported only when ``--otlp-traces-endpoint`` is.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.events.exporters.observers import (
    DETAILED_TRACES,
    ObserverFlags,
    Observers,
    attach_observers,
    build_observers,
)

if TYPE_CHECKING:
    from engine.events import EventBus
    from engine.events.folds.request_record import SharedRequests


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
    p.add_argument("--forward-pass-metrics-port", type=int, default=None, metavar="PORT",
                   help="as vLLM (PR #52061): publish each step's forward-pass metrics (vLLM's ForwardPassMetrics, "
                        "msgpack) on a ZMQ PUB socket bound at 127.0.0.1:PORT, an idle heartbeat when the engine "
                        "empties (engine/events/exporters/forward_pass.py)")
    p.add_argument("--enable-logging-iteration-details", action="store_true",
                   help="as vLLM: log each step's context and generation requests and tokens and its model time "
                        "(Iteration(N): ... iteration elapsed time: X ms)")


def exporter_flags(args: argparse.Namespace) -> ObserverFlags:
    """The exporter flags above as :class:`ObserverFlags` (the recording and the KV events
    are the engine's: its config asks for them)."""
    return ObserverFlags(trace_out=getattr(args, "trace_out", None),
                         otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", None),
                         collect_detailed_traces=getattr(args, "collect_detailed_traces", None),
                         iteration_details=bool(getattr(args, "enable_logging_iteration_details", False)),
                         forward_pass_metrics_port=getattr(args, "forward_pass_metrics_port", None))


def exporters_asked(args: argparse.Namespace) -> bool:
    """Whether any exporter flag was given (replay feeds a recording only then)."""
    return exporter_flags(args).asks()


def build_exporters(args: argparse.Namespace, wall_start_unix: float, model_name: str | None = None) -> Observers:
    """The sinks ``args`` ask for, unsubscribed (``engine replay`` feeds them a recording).
    ``wall_start_unix``: the wall-clock time of the recording's clock zero."""
    return build_observers(exporter_flags(args), wall_start_unix=wall_start_unix, span_model_name=model_name)


def attach_exporters(args: argparse.Namespace, bus: EventBus, shared_requests: SharedRequests | None = None) -> Observers:
    """Build the asked-for sinks and subscribe them to ``bus`` (before startup, so the
    phases are in them); a bad flag is refused here, before anything slow. ``shared_requests``:
    the server's request fold, read by the span and trace exporters instead of their own."""
    return attach_observers(bus, exporter_flags(args), shared_requests=shared_requests)


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
