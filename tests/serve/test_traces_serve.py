"""`engine serve --otlp-traces-endpoint --trace-out` end to end (slow: it loads the
bundled model): an OTLP/gRPC collector this test starts on loopback (vLLM's default
protocol; opentelemetry-proto's service definition, grpcio's server) receives the
startup spans and one llm_request span per completion a real openai client sends;
after SIGTERM the Perfetto trace holds the same requests."""

from __future__ import annotations

import json
from concurrent import futures
from pathlib import Path

import grpc
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench.bench_server import free_port, start_server, stop_server
from engine.modelspec.presets import bundled_gguf_path
from tests.events.test_perfetto import check_trace_event_format

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list:
        return [span for request in self.requests for resource in request.resource_spans
                for scope in resource.scope_spans for span in scope.spans]


def test_serve_sends_startup_and_request_spans_over_grpc_and_writes_a_trace(tmp_path: Path) -> None:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    trace_file = tmp_path / "serve-trace.json"
    port = free_port()
    proc = start_server(port, "--max-model-len", "512", "--kv-cache-memory-bytes", "64Mi", "--threads", "1",
                        "--otlp-traces-endpoint", f"http://127.0.0.1:{grpc_port}", "--trace-out", str(trace_file),
                        log_path=tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        model = client.models.list().data[0].id
        for prompt in ("The capital of France is", "One, two, three,"):
            client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    finally:
        assert stop_server(proc) == 0
        server.stop(grace=None)
    spans = collector.spans()
    names = [s.name for s in spans]
    assert {"kvscope startup", "Init device", "Load model", "Prepare model", "Compile/warmup", "Ready"} <= set(names)
    requests = [s for s in spans if s.name == "llm_request"]
    assert len(requests) == 2
    for span in requests:
        attributes = {a.key: a.value for a in span.attributes}
        assert attributes["gen_ai.response.model"].string_value == model
        assert attributes["gen_ai.usage.completion_tokens"].int_value == 4
        assert span.start_time_unix_nano < span.end_time_unix_nano
    records = check_trace_event_format(json.loads(trace_file.read_text()))
    assert sum(r["name"] == "finished" for r in records) == 2
