"""OpenTelemetry spans from events: their shapes through the SDK's in-memory
exporter, and the real OTLP/HTTP protocol through a receiver this test starts on
loopback, which decodes ExportTraceServiceRequest with opentelemetry-proto."""

from __future__ import annotations

import gzip
import itertools
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from engine.cli import main
from engine.cli.exporters import recording_wall_start
from engine.events import Recording, read_events
from engine.events.exporters.otel import REQUEST_SPAN, STARTUP_SPAN, OtlpTraceSink, check_endpoint
from tests.events.test_perfetto import check_trace_event_format
from tests.paths import SAMPLES

WALL_START = 1_780_000_000.0  # any wall-clock zero: span times are it plus each event's t


def ns(t: float) -> int:
    return round((WALL_START + t) * 1e9)


@pytest.fixture(scope="module")
def real_run() -> Recording:
    return read_events(SAMPLES / "smollm2_run.jsonl")


@pytest.fixture(scope="module")
def spans(real_run: Recording) -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    sink = OtlpTraceSink(exporter, wall_start_unix=WALL_START, forward_times=True, execute_times=True)
    for event in real_run.events:
        sink(event)
    sink.close()
    return list(exporter.get_finished_spans())


def test_startup_spans_carry_vllms_names_phase_letters_memory_and_parentage(
        real_run: Recording, spans: list[ReadableSpan]) -> None:
    by_name = {s.name: s for s in spans if s.name != REQUEST_SPAN}
    root, prepare = by_name[STARTUP_SPAN], by_name["Prepare model"]
    assert root.parent is None
    phases = {s.attributes["kvscope.phase"]: s for s in by_name.values() if s.attributes
              and "kvscope.phase" in s.attributes}
    assert sorted(phases) == list("ABCDEFG")
    assert [phases[p].name for p in "ACF"] == ["Init device", "Load model", "Compile/warmup"]
    for letter, span in phases.items():
        parent = prepare if letter in "DEF" else root
        assert span.parent is not None and span.parent.span_id == parent.context.span_id
        assert span.context.trace_id == root.context.trace_id
    assert prepare.parent is not None and prepare.parent.span_id == root.context.span_id
    ends = {e.phase: e for e in real_run.events if e.type == "startup.phase" and e.status != "begin"}
    begins = {e.phase: e for e in real_run.events if e.type == "startup.phase" and e.status == "begin"}
    load = phases["C"]
    assert (load.start_time, load.end_time) == (ns(begins["C"].t), ns(ends["C"].t))
    assert load.attributes["kvscope.phase.duration_s"] == ends["C"].duration_s
    assert load.attributes["kvscope.memory_before.reserved"] == begins["C"].memory_before["reserved"]
    assert load.attributes["kvscope.memory_after.reserved"] == ends["C"].memory_after["reserved"]
    assert load.attributes["kvscope.phase.data.weights_bytes"] == ends["C"].data["weights_bytes"]
    assert (prepare.start_time, prepare.end_time) == (phases["D"].start_time, phases["F"].end_time)
    assert (root.start_time, root.end_time) == (phases["A"].start_time, phases["G"].end_time)


def test_one_server_span_per_request_backdated_to_arrival_with_vllms_attributes(
        real_run: Recording, spans: list[ReadableSpan]) -> None:
    requests = {s.attributes["gen_ai.request.id"]: s for s in spans if s.name == REQUEST_SPAN}
    finished = {e.request_id: e for e in real_run.events if e.type == "request.finished"}
    arrived = {e.request_id: e for e in real_run.events if e.type == "request.arrived"}
    assert requests.keys() == finished.keys()
    steps = [e for e in real_run.events if e.type == "step"]
    for request_id, span in requests.items():
        done, came = finished[request_id], arrived[request_id]
        assert span.kind == SpanKind.SERVER and span.status.status_code == StatusCode.UNSET
        assert (span.start_time, span.end_time) == (ns(came.t), ns(done.t))
        attributes = span.attributes
        assert attributes["gen_ai.usage.prompt_tokens"] == done.prompt_tokens
        assert attributes["gen_ai.usage.completion_tokens"] == done.output_tokens
        assert attributes["gen_ai.request.max_tokens"] == came.max_tokens
        assert attributes["gen_ai.response.model"] == "smollm2-135m"
        assert attributes["gen_ai.response.finish_reasons"] == (done.reason,)
        assert attributes["gen_ai.latency.time_in_queue"] == done.queue_time_s
        assert attributes["gen_ai.latency.time_to_first_token"] == done.ttft_s
        assert attributes["gen_ai.latency.time_in_model_prefill"] == done.prefill_time_s
        assert attributes["gen_ai.latency.time_in_model_decode"] == done.decode_time_s
        assert attributes["gen_ai.latency.e2e"] == done.e2e_s
        forward = sum(s.forward_s for s in steps if request_id in s.scheduled)
        assert attributes["gen_ai.latency.time_in_model_forward"] == pytest.approx(forward)
        names = [e.name for e in span.events]
        assert names[:2] == ["scheduled", "first_token"]
        assert names.count("preempted") == done.num_preemptions == attributes["kvscope.num_preemptions"]
        assert names.count("resumed") == sum(request_id in s.resumed for s in steps)
        assert all(span.start_time <= e.timestamp <= span.end_time for e in span.events)
    assert any(s.attributes["kvscope.num_preemptions"] for s in requests.values())  # the sample has some


def test_a_requests_spans_are_one_trace_under_the_engines_scope(spans: list[ReadableSpan]) -> None:
    """Request spans are built whole when the request ends (whole_spans.py), startup's live:
    both kinds come out under one instrumentation scope, each request's children in its trace."""
    assert {s.instrumentation_scope for s in spans} == {spans[0].instrumentation_scope}
    assert spans[0].instrumentation_scope.name == "kvscope.engine"
    requests = {s.context.span_id: s for s in spans if s.name == REQUEST_SPAN}
    children = [s for s in spans if s.parent is not None and s.parent.span_id in requests]
    assert len(children) >= 2 * len(requests) > 0
    for child in children:
        root = requests[child.parent.span_id]
        assert child.context.trace_id == root.context.trace_id and child.context.trace_flags.sampled
        assert child.kind == SpanKind.INTERNAL and root.parent is None
    assert len({s.context.trace_id for s in requests.values()}) == len(requests)


def test_the_samplers_choice_is_kept_for_request_traces(real_run: Recording, monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_TRACES_SAMPLER still decides: always_off exports no request's spans (startup's
    neither), and nothing else changes for the engine."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    exporter = InMemorySpanExporter()
    sink = OtlpTraceSink(exporter, wall_start_unix=WALL_START)
    for event in real_run.events:
        sink(event)
    sink.close()
    assert exporter.get_finished_spans() == ()


class _OtlpReceiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP traces endpoint: decodes each POST as the protocol defines it."""

    received: list[ExportTraceServiceRequest]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        assert self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.server.received.append(request)  # type: ignore[attr-defined]
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def otlp_receiver() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OtlpReceiver)
    server.received = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _received_spans(server: ThreadingHTTPServer) -> tuple[list[ProtoSpan], set[str]]:
    spans, services = [], set()
    for request in server.received:  # type: ignore[attr-defined]
        for resource_spans in request.resource_spans:
            services.update(a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name")
            for scope in resource_spans.scope_spans:
                spans.extend(scope.spans)
    return spans, services


def test_replay_sends_a_recordings_spans_over_otlp_http_with_their_original_times(
        otlp_receiver: ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = SAMPLES / "monitor_sim.jsonl"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    url = f"http://127.0.0.1:{otlp_receiver.server_address[1]}"  # no path: /v1/traces is added
    assert main(["replay", str(path), "--otlp", url]) == 0
    assert f"sent OpenTelemetry spans to {url} (http/protobuf)" in capsys.readouterr().out
    spans, services = _received_spans(otlp_receiver)
    assert services == {"kvscope"}
    recording = read_events(path)
    wall_start, _ = recording_wall_start(recording.header, path, recording.events[-1].t)
    arrived = {e.request_id: e.t for e in recording.events if e.type == "request.arrived"}
    requests = {s.attributes[0].value.string_value: s for s in spans if s.name == REQUEST_SPAN}
    assert requests.keys() == arrived.keys()
    for request_id, span in requests.items():
        assert span.kind == ProtoSpan.SpanKind.SPAN_KIND_SERVER
        assert span.start_time_unix_nano == round((wall_start + arrived[request_id]) * 1e9)
    assert {s.name for s in spans} >= {STARTUP_SPAN, "Prepare model", "Load model", "Compile/warmup"}


def test_bad_exporter_settings_are_refused_before_anything_runs(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = str(SAMPLES / "monitor_sim.jsonl")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    assert main(["replay", path, "--otlp", "http://127.0.0.1:4318"]) == 2
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json': use one of grpc, http/protobuf" in capsys.readouterr().err
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    assert main(["simulate", "--num-prompts", "2", "--collect-detailed-traces", "all"]) == 2
    assert "give --otlp-traces-endpoint URL too" in capsys.readouterr().err
    assert check_endpoint("localhost:4317", "grpc") == "localhost:4317"
    with pytest.raises(ValueError, match="give a URL such as"):
        check_endpoint("localhost:4318", "http/protobuf")


def test_a_live_run_sends_spans_and_writes_its_trace_as_it_goes(
        otlp_receiver: ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """engine simulate publishes the real engine's events on a live bus: the exporters
    subscribe to it before phase A, as they do under serve, run-workload and generate."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    url = f"http://127.0.0.1:{otlp_receiver.server_address[1]}/v1/traces"
    trace_file = tmp_path / "sim.json"
    before = time.time()
    assert main(["simulate", "--num-prompts", "3", "--random-input-len", "64:128", "--random-output-len", "4:8",
                 "--otlp-traces-endpoint", url, "--collect-detailed-traces", "all", "--trace-out",
                 str(trace_file)]) == 0
    assert "Perfetto trace" in capsys.readouterr().out
    spans, _ = _received_spans(otlp_receiver)
    requests = [s for s in spans if s.name == REQUEST_SPAN]
    assert len(requests) == 3
    assert all(s.start_time_unix_nano >= before * 1e9 for s in spans)
    keys = {a.key for a in requests[0].attributes}
    assert {"gen_ai.latency.time_in_model_forward", "gen_ai.latency.time_in_model_execute"} <= keys
    assert sum(s.name in ("Init device", "Load model", "Compile/warmup") for s in spans) == 3
    records = check_trace_event_format(json.loads(trace_file.read_text()))
    assert sum(r["name"] == "finished" for r in records) == 3


def test_sampling_settings_and_the_wall_clock_start_reach_spans_through_events(tmp_path: Path) -> None:
    from engine.core.request import Request
    from engine.core.sampling_params import SamplingParams
    from engine.core.scheduler import Scheduler, SchedulerConfig
    from engine.events import EventBus, JsonlSink, RequestFinished

    bus = EventBus()
    sink_path = tmp_path / "run.jsonl"
    jsonl = JsonlSink(sink_path, started_unix=WALL_START)
    bus.subscribe(jsonl)
    scheduler = Scheduler(SchedulerConfig(num_blocks=8), bus)
    scheduler.add_request(Request("greedy", [1, 2, 3], 4, sampling=SamplingParams(temperature=0.0, top_p=0.9)), 0.0)
    scheduler.add_request(Request("simulated", [1, 2, 3], 4), 0.0)
    for request_id in ("greedy", "simulated"):
        bus.publish(RequestFinished(request_id=request_id, prompt_tokens=3, output_tokens=4))
    jsonl.close()
    recording = read_events(sink_path)
    assert recording_wall_start(recording.header, sink_path, 99.0) == (WALL_START, None)
    arrived = [e.to_dict() for e in recording.events if e.type == "request.arrived"]
    assert arrived[0]["sampling"] == {"temperature": 0.0, "top_p": 0.9} and "sampling" not in arrived[1]
    exporter = InMemorySpanExporter()
    sink = OtlpTraceSink(exporter, wall_start_unix=WALL_START)
    for event in recording.events:
        sink(event)
    sink.close()
    spans = {s.attributes["gen_ai.request.id"]: s.attributes for s in exporter.get_finished_spans()
             if s.name == REQUEST_SPAN}
    assert (spans["greedy"]["gen_ai.request.temperature"], spans["greedy"]["gen_ai.request.top_p"]) == (0.0, 0.9)
    assert "gen_ai.request.temperature" not in spans["simulated"]


def test_each_request_span_has_vllms_phase_children_with_preemptions_as_events(
        otlp_receiver: ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM PR#44402's child spans, as the protocol carries them: vllm_queue, vllm_prefill,
    vllm_decode under each llm_request, back to back; a preemption is an event on the child
    it fell in, naming its reason and the request it made room for (issue 33)."""
    from engine.events.exporters.otel import DECODE_SPAN, PREFILL_SPAN, QUEUE_SPAN

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert main(["replay", str(SAMPLES / "monitor_sim.jsonl"), "--otlp",
                 f"http://127.0.0.1:{otlp_receiver.server_address[1]}"]) == 0
    spans, _ = _received_spans(otlp_receiver)
    requests = {s.span_id: s for s in spans if s.name == REQUEST_SPAN}
    children: dict[bytes, list[ProtoSpan]] = {}
    for span in spans:
        if span.parent_span_id in requests:
            children.setdefault(span.parent_span_id, []).append(span)
    assert len(children) == len(requests) == 55
    for parent_id, kids in children.items():
        kids.sort(key=lambda s: s.start_time_unix_nano)
        assert [k.name for k in kids] == [QUEUE_SPAN, PREFILL_SPAN, DECODE_SPAN]
        assert kids[0].start_time_unix_nano == requests[parent_id].start_time_unix_nano
        assert all(a.end_time_unix_nano == b.start_time_unix_nano for a, b in itertools.pairwise(kids))
        assert kids[-1].end_time_unix_nano == requests[parent_id].end_time_unix_nano
    r13 = next(s for s in requests.values() if s.attributes[0].value.string_value == "r13")
    decode = children[r13.span_id][2]
    preempted = next(e for e in decode.events if e.name == "preempted")
    attributes = {a.key: a.value for a in preempted.attributes}
    assert attributes["for_request"].string_value == "r5" and attributes["reason"].string_value == "kv_full"
    prefill = {a.key: a.value for a in children[r13.span_id][1].attributes}
    assert prefill["kvscope.prefix.stop"].string_value == "complete"
    assert prefill["kvscope.prefix.hit_tokens"].int_value == 96
