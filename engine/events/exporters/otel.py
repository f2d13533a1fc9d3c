"""OpenTelemetry traces of a run, as vLLM's tracing shapes them, built from events.

:class:`OtlpTraceSink` is an event subscriber like the JSONL sink: every span is
built from events with explicit start and end timestamps (the bus clock's seconds
plus the wall-clock instant the clock started), so the same code traces a live
engine and re-emits a recording (``engine replay run.jsonl --otlp URL``) with its
original times. A request's span reads its arrival, first admission and finish from its
record (the shared fold, engine/events/folds/request_record.py) and keeps beside it only its
span events and model seconds.

Spans (vLLM's names, so a kvscope and a vLLM trace line up in Tempo or Jaeger):

- startup: ``kvscope startup`` around one span per phase A–G, named by
  :mod:`engine.events.phase_names` (``Init device``, ``Load model``, ...; D–F inside
  ``Prepare model`` as in vLLM), with the phase letter, status, duration, memory
  before/after and the phase's own numbers as attributes;
- one ``llm_request`` span per request (``SpanKind.SERVER``, started at its arrival)
  with vLLM's attributes (``gen_ai.usage.*``, ``gen_ai.request.*``,
  ``gen_ai.response.*``, ``gen_ai.latency.*``: vllm/tracing/utils.py
  ``SpanAttributes``) and span events ``scheduled``, ``first_token``,
  ``preempted``, ``resumed``, with three child spans under vLLM's PR#44402 names,
  ``vllm_queue`` (arrival to first admission; the step's waiting reason at admission
  as ``kvscope.wait_reason``), ``vllm_prefill`` (admission to first token; where the
  prefix-cache match stopped as ``kvscope.prefix.*``) and ``vllm_decode`` (first token
  to finish), each preemption a span event (reason, for whom, blocks and tokens lost)
  on the child it fell in. ``forward_times`` / ``execute_times`` (vLLM's
  ``--collect-detailed-traces`` model / worker) add the forward (forward + sample)
  seconds of the steps each request was in.

Each sink owns its TracerProvider (never the global one) with a
BatchSpanProcessor, so exporting happens on the SDK's thread, off the step loop.
Import this module only when traces are asked for: it loads opentelemetry.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode

from engine.events.exporters.whole_spans import WholeSpans
from engine.events.folds.request_record import (
    WAIT_UNLISTED,
    WAIT_UNRECORDED,
    RequestRecord,
    SharedRequests,
    request_fold_for,
)
from engine.events.phase_names import VLLM_GROUPS, span_name, vllm_group
from engine.events.record import Event
from engine.events.request_records import (
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    RequestScheduled,
)
from engine.events.startup_records import EngineConfigEvent, StartupPhase
from engine.events.step_records import StepEvent

TRACES_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOLS = ("grpc", "http/protobuf")  # vLLM's choices; grpc is its default
REQUEST_SPAN = "llm_request"
QUEUE_SPAN, PREFILL_SPAN, DECODE_SPAN = "vllm_queue", "vllm_prefill", "vllm_decode"  # vLLM PR#44402's phases
STARTUP_SPAN = "kvscope startup"
SERVICE_NAME = "kvscope"
TRACER_SCOPE = "kvscope.engine"
SPANS_QUEUED = 65_536  # the processor's queue: a replay hands over every span at once


class SpanAttributes:
    """vLLM's attribute names (vllm/tracing/utils.py), the ones kvscope has facts for."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASON = "gen_ai.response.finish_reasons"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"


def traces_protocol(environ: os._Environ[str] | dict[str, str] | None = None) -> str:
    """The OTLP protocol ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` asks for (grpc when
    unset, as vLLM); anything else is refused with the choices."""
    value = (environ if environ is not None else os.environ).get(TRACES_PROTOCOL_ENV, "grpc").strip() or "grpc"
    if value not in PROTOCOLS:
        raise ValueError(f"{TRACES_PROTOCOL_ENV}={value!r}: use one of {', '.join(PROTOCOLS)}")
    return value


def check_endpoint(url: str, protocol: str) -> str:
    """The endpoint the exporter is given. A URL without a scheme and host (for grpc,
    a bare host:port will do) is refused here, before startup; for http/protobuf a URL with no path gets OTLP's
    ``/v1/traces`` (a collector answers 404 on ``/``)."""
    if protocol == "grpc" and "://" not in url:
        parts = urlsplit(f"grpc://{url}")  # gRPC takes a bare host:port too
        if parts.hostname:
            return url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https", "grpc") or not parts.hostname:
        raise ValueError(f"--otlp-traces-endpoint {url!r}: give a URL such as http://localhost:4317 (grpc) "
                         "or http://localhost:4318/v1/traces (http/protobuf)")
    if protocol == "http/protobuf":
        if parts.scheme == "grpc":
            raise ValueError(f"--otlp-traces-endpoint {url!r} is a grpc:// URL but {TRACES_PROTOCOL_ENV} is "
                             "http/protobuf: give an http(s):// URL or set the protocol to grpc")
        if parts.path in ("", "/"):
            return url.rstrip("/") + "/v1/traces"
    return url


def span_exporter(url: str, protocol: str) -> SpanExporter:
    """vLLM's exporter choice: OTLP/gRPC (insecure, as vLLM) or OTLP/HTTP protobuf."""
    endpoint = check_endpoint(url, protocol)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint, insecure=True)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=endpoint)


@dataclass(slots=True)
class _SpanNotes:
    """What a request's span keeps beside its record (the shared fold's) until it finishes:
    its span events in the order they were published, and the model seconds of its steps."""

    events: list[tuple[str, float, dict[str, Any]]] = field(default_factory=list)
    forward_s: float = 0.0
    execute_s: float = 0.0


def _admission(record: RequestRecord) -> dict[str, Any]:
    """The first admission's prefix lookup and, when a step named one, why it waited before it."""
    if not record.lookups:
        return {}
    lookup = record.lookups[0]
    admitted: dict[str, Any] = {"kvscope.prefix.hit_tokens": lookup.hit_tokens, "kvscope.prefix.stop": lookup.cause,
                                "kvscope.step": lookup.step}
    named = [run.reason for run in record.waits if run.first_step < lookup.step and run.reason
             and run.reason[0] not in (WAIT_UNLISTED, WAIT_UNRECORDED)]  # the fold's own codes name no reason
    if named:
        admitted["kvscope.wait_reason"] = named[-1][0]
    return admitted


def _scalar_attributes(prefix: str, values: dict[str, Any] | None) -> dict[str, Any]:
    """OTel attributes take scalars: the numbers, words and flags of ``values``."""
    if not values:
        return {}
    return {f"{prefix}.{key}": value for key, value in values.items() if isinstance(value, bool | int | float | str)}


class OtlpTraceSink:
    """Event subscriber that builds startup and request spans and hands them to
    ``exporter`` through its own BatchSpanProcessor. ``wall_start_unix`` is the
    wall-clock time of the bus clock's zero (an event at ``t`` happened at
    ``wall_start_unix + t``)."""

    def __init__(self, exporter: SpanExporter, *, wall_start_unix: float, model_name: str | None = None,
                 forward_times: bool = False, execute_times: bool = False,
                 service_name: str = SERVICE_NAME, shared_requests: SharedRequests | None = None) -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name,
                                                                 "kvscope.process_id": str(os.getpid())}))
        processor = BatchSpanProcessor(exporter, max_queue_size=SPANS_QUEUED)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer(TRACER_SCOPE)  # startup's spans, live as its phases run
        self._spans = WholeSpans(self.provider, processor, TRACER_SCOPE)  # requests' spans, built when they end
        self.wall_start_unix = wall_start_unix
        self.model_name = model_name
        self.forward_times = forward_times
        self.execute_times = execute_times
        # every request's record (its arrival, admission and finish): the server's fold when
        # given (one fold of each event for every reader), else a private one
        self.requests, self._fold_requests = request_fold_for(shared_requests)
        self._notes: dict[str, _SpanNotes] = {}  # requests followed since their arrival, until their span
        self._finishing: list[str] = []  # detailed traces: until their last step is counted
        self._startup: trace.Span | None = None
        self._groups: dict[str, trace.Span] = {}
        self._phase_starts: dict[str, float] = {}
        self._startup_end = 0.0

    def _ns(self, t: float) -> int:
        return round((self.wall_start_unix + t) * 1e9)

    # ------------------------------------------------------------- the fold
    def __call__(self, event: Event) -> None:
        self._fold_requests(event)
        if isinstance(event, StepEvent):
            if event.resumed or self.forward_times or self.execute_times:
                self._step(event)
        elif isinstance(event, RequestArrived):
            self._notes[event.request_id] = _SpanNotes()
        elif isinstance(event, RequestScheduled):
            self._note(event.request_id, "scheduled", event.t, {"queue_time_s": event.queue_time_s,
                                                                "prefix_hit_tokens": event.prefix_hit_tokens})
        elif isinstance(event, RequestFirstToken):
            self._note(event.request_id, "first_token", event.t, {"ttft_s": event.ttft_s})
        elif isinstance(event, RequestPreempted):
            self._note(event.request_id, "preempted", event.t, {
                "computed_tokens_lost": event.computed_tokens_lost, "blocks_freed": event.blocks_freed,
                "num_preemptions": event.num_preemptions, "reason": event.reason,
                **({"for_request": event.for_request} if event.for_request else {})})
        elif isinstance(event, RequestFinished):
            self._finished(event)
        elif isinstance(event, StartupPhase):
            self._phase(event)
        elif isinstance(event, EngineConfigEvent) and self.model_name is None:
            self.model_name = event.config.get("served_model_name") or event.config.get("model")

    def _note(self, request_id: str, name: str, t: float, attributes: dict[str, Any]) -> None:
        notes = self._notes.get(request_id)
        if notes is not None:
            notes.events.append((name, t, attributes))

    def _step(self, event: StepEvent) -> None:
        for request_id in event.resumed:
            self._note(request_id, "resumed", event.t - event.duration_s, {"step": event.index})
        if self.forward_times or self.execute_times:
            for request_id in event.scheduled:
                notes = self._notes.get(request_id)
                if notes is not None:
                    notes.forward_s += event.forward_s
                    notes.execute_s += event.forward_s + event.sample_s
            self._end_finished()

    def _end_finished(self) -> None:
        """The spans of requests that finished in the step just counted."""
        for request_id in self._finishing:
            self._request_span(self.requests.record(request_id), self._notes.pop(request_id, None))
        self._finishing.clear()

    # --------------------------------------------------------------- startup
    def _phase(self, event: StartupPhase) -> None:
        letter = event.phase
        if event.status == "begin":
            # Simulated phases all sit at t=0 with modelled durations: each starts
            # where the one before ended (a live engine's already do).
            start = max(event.t, self._startup_end)
            self._phase_starts[letter] = start
            if self._startup is None:
                self._startup = self.tracer.start_span(STARTUP_SPAN, start_time=self._ns(start))
            group = vllm_group(letter)
            if group is not None and group not in self._groups:
                self._groups[group] = self.tracer.start_span(
                    group, context=trace.set_span_in_context(self._startup), start_time=self._ns(start))
            return
        start = self._phase_starts.pop(letter, max(event.t - (event.duration_s or 0.0), self._startup_end))
        end = max(event.t, start + (event.duration_s or 0.0))
        self._startup_end = end
        if self._startup is None:  # a recording that starts mid-startup
            self._startup = self.tracer.start_span(STARTUP_SPAN, start_time=self._ns(start))
        group = vllm_group(letter)
        parent = self._groups.get(group) if group is not None else None
        attributes: dict[str, Any] = {"kvscope.phase": letter, "kvscope.phase.name": event.name,
                                      "kvscope.phase.status": event.status}
        if event.duration_s is not None:
            attributes["kvscope.phase.duration_s"] = event.duration_s
        attributes.update(_scalar_attributes("kvscope.memory_before", event.memory_before))
        attributes.update(_scalar_attributes("kvscope.memory_after", event.memory_after))
        attributes.update(_scalar_attributes("kvscope.phase.data", event.data))
        if event.planned or event.simulated:
            attributes["kvscope.phase.simulated" if event.simulated else "kvscope.phase.planned"] = True
        span = self.tracer.start_span(span_name(letter), context=trace.set_span_in_context(parent or self._startup),
                                      start_time=self._ns(start), attributes=attributes)
        failed = event.status == "failed"
        if failed:
            span.set_status(Status(StatusCode.ERROR, event.reason or "failed"))
        span.end(end_time=self._ns(end))
        if group is not None and (failed or letter == VLLM_GROUPS[group][-1]):
            self._groups.pop(group).end(end_time=self._ns(end))
        if failed or letter == "G":
            for open_group in self._groups.values():
                open_group.end(end_time=self._ns(end))
            self._groups.clear()
            if failed:
                self._startup.set_status(Status(StatusCode.ERROR, event.reason or f"phase {letter} failed"))
            self._startup.end(end_time=self._ns(end))
            self._startup = None

    # -------------------------------------------------------------- requests
    def _finished(self, event: RequestFinished) -> None:
        if self.forward_times or self.execute_times:
            # the step that sampled its last token is published after this event,
            # and its forward seconds belong to the request: that step ends the span
            self._finishing.append(event.request_id)
            return
        self._request_span(self.requests.record(event.request_id), self._notes.pop(event.request_id, None))

    def _request_span(self, record: RequestRecord, notes: _SpanNotes | None) -> None:
        event = record.finished
        assert event is not None
        # a recording that begins after this request arrived: neither arrival nor notes
        arrived = record.arrival if notes is not None else None
        notes = notes or _SpanNotes()
        start = arrived.t - arrived.preprocess_s if arrived is not None else event.t - event.e2e_s
        attributes: dict[str, Any] = {
            SpanAttributes.GEN_AI_REQUEST_ID: event.request_id,
            SpanAttributes.GEN_AI_REQUEST_N: 1,  # kvscope requests are single sequences
            SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: event.prompt_tokens,
            SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: event.output_tokens,
            SpanAttributes.GEN_AI_USAGE_CACHED_TOKENS: event.prefix_hit_tokens,
            SpanAttributes.GEN_AI_USAGE_NUM_SEQUENCES: 1,
            SpanAttributes.GEN_AI_RESPONSE_FINISH_REASON: (event.reason,),
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE: event.queue_time_s,
            SpanAttributes.GEN_AI_LATENCY_E2E: event.e2e_s,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: event.prefill_time_s,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: event.decode_time_s,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: event.inference_time_s,
            "kvscope.num_preemptions": event.num_preemptions,
        }
        if self.model_name:
            attributes[SpanAttributes.GEN_AI_RESPONSE_MODEL] = self.model_name
        if event.ttft_s is not None:
            attributes[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = event.ttft_s
        if arrived is not None:
            attributes[SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS] = arrived.max_tokens
            attributes["kvscope.priority"] = arrived.priority
            if arrived.sampling:  # the real engine's requests (the simulator's have none)
                for name, key in (("temperature", SpanAttributes.GEN_AI_REQUEST_TEMPERATURE),
                                  ("top_p", SpanAttributes.GEN_AI_REQUEST_TOP_P)):
                    if name in arrived.sampling:
                        attributes[key] = arrived.sampling[name]
        if self.forward_times:
            attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD] = notes.forward_s
        if self.execute_times:
            attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE] = notes.execute_s
        root = self._spans.new_trace(REQUEST_SPAN, SpanKind.SERVER, attributes)
        if root is None:  # the sampler dropped this request's trace
            return
        self._spans.emit(REQUEST_SPAN, root, parent=None, kind=SpanKind.SERVER, start_ns=self._ns(start),
                         end_ns=self._ns(event.t), attributes=attributes,
                         events=[(name, self._ns(t), note) for name, t, note in notes.events])
        self._phase_spans(root, event, notes, _admission(record) if arrived is not None else {}, start)

    def _phase_spans(self, parent: SpanContext, event: RequestFinished, notes: _SpanNotes, admitted: dict[str, Any],
                     start: float) -> None:
        """``vllm_queue``, ``vllm_prefill`` and ``vllm_decode`` under the request's span (the
        ones it reached), preemptions and resumes as events on the child they fell in."""
        end = event.t
        first_times = {name: t for name, t, _ in reversed(notes.events)}  # each note's first time
        scheduled = first_times.get("scheduled", min(start + event.queue_time_s, end))
        first = first_times.get("first_token", start + event.ttft_s if event.ttft_s is not None else None)
        queue_attributes = {k: v for k, v in admitted.items() if k == "kvscope.wait_reason"}
        phases = [(QUEUE_SPAN, start, scheduled, queue_attributes)]
        if first is not None or event.output_tokens:
            prefill_end = first if first is not None else end
            phases.append((PREFILL_SPAN, scheduled, prefill_end,
                           {k: v for k, v in admitted.items() if k != "kvscope.wait_reason"}))
            if first is not None:
                phases.append((DECODE_SPAN, first, end, {"kvscope.output_tokens": event.output_tokens}))
        elif end > scheduled:
            phases.append((PREFILL_SPAN, scheduled, end, {}))
        for i, (name, begin, finish, attributes) in enumerate(phases):
            last = i == len(phases) - 1
            moves = [(note, self._ns(t), note_attributes) for note, t, note_attributes in notes.events
                     if note in ("preempted", "resumed") and begin <= t and (t < finish or last)]
            self._spans.emit(name, self._spans.child_of(parent), parent=parent, kind=SpanKind.INTERNAL,
                             start_ns=self._ns(begin), end_ns=self._ns(max(finish, begin)), attributes=attributes,
                             events=moves)

    # ---------------------------------------------------------------- the end
    def close(self) -> None:
        """Export what is queued and stop the processor's thread."""
        self._end_finished()
        self.provider.force_flush()
        self.provider.shutdown()
