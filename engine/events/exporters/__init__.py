"""The exporters: the event stream written out in other tools' shapes (vLLM's metrics, log
lines, traces and ZMQ messages), each a sink of the bus or a fold read by a server route.

- ``observers``: the one place that builds a bus's sinks from config and flags
- ``metrics``: vLLM's Prometheus families
- ``deferred_series``: series updated every step in plain Python, written into prometheus_client at collection
- ``priority_metrics``: the bucketed ``priority`` label, ``request_priority``, ``scheduler_policy_info``
- ``iteration_phase_metrics``: requests and tokens per engine step, by phase (prefill, decode)
- ``stats``: the periodic stats line and ``stats`` event
- ``iteration_details``: vLLM's ``Iteration(N)`` log line
- ``progress``: the console bar for ``startup.progress``
- ``otel``: OpenTelemetry spans in vLLM's shapes
- ``whole_spans``: a finished request's spans built whole and handed to the span processor
- ``perfetto``: a Trace Event Format timeline
- ``kv_events_config``: ``--kv-events-config``, vLLM's ``KVEventsConfig`` parsed
- ``kv_events``: step events folded into vLLM's KV event batches
- ``kv_publisher``: the ZMQ PUB and replay sockets
- ``kv_snapshot``: the whole cache as ``BlockStored`` events for a cold router
- ``forward_pass``: vLLM's ``ForwardPassMetrics`` over ZMQ
- ``bench_outputs``: ``vllm bench serve`` and ``vllm bench startup`` outputs from events
"""
