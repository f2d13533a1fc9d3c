"""vLLM V1's Prometheus metrics, as a sink of the event stream.

Names, types, label names and bucket lists are those vLLM V1 exports (0.8.5+,
``vllm/v1/metrics/loggers.py``), so a
dashboard or scraper built for vLLM reads kvscope unchanged. Every family
carries ``model_name`` (the served model name) and ``engine`` (the data-parallel
rank as a string, "0"); ``vllm:cache_config_info`` carries ``engine`` and the
cache config fields instead, as vLLM's info gauge does.

Counters are created under vLLM's code names (``vllm:prompt_tokens``) and
prometheus_client adds ``_total`` on the wire (``vllm:prompt_tokens_total``),
exactly as in vLLM. Nothing here reads engine objects: each value comes from an
event (DESIGN principle 1).

Where each value comes from:
- running / waiting / KV usage / prefix-cache queries and hits / preemptions /
  iteration tokens: the ``step`` event; ``kv_cache_token_usage_perc`` (experimental, vLLM
  PR#57336's name): the step's blocks less their unfilled tails, the requests' computed
  tokens folded by a private :class:`~engine.events.folds.view.EngineView`
  (engine/events/folds/kv_occupancy.py);
- prompt and generation tokens: :class:`engine.events.exporters.stats.TokenTally` (shared with
  the stats line), vLLM's counting;
- TTFT: ``request.first_token``; every other per-request histogram and
  ``request_success_total{finished_reason}``: ``request.finished`` (aborted
  requests included, as vLLM); ``request_prompt_tokens`` / ``request_generation_tokens``
  observe what the token counters counted for the request, so their sums equal
  ``prompt_tokens_total`` / ``generation_tokens_total`` exactly once every request has
  finished; aborts by cause and the prefill work of requests that ended before their
  first token: engine/events/folds/accounting.py;
- ``cache_config_info``: ``engine.config`` (``--kv-cache-memory-bytes`` among the
  flags) plus the phase E ``startup.phase`` event's ``num_blocks`` /
  ``kv_cache_tokens`` / ``max_concurrency``, under vLLM's CacheConfig field names;
- ``num_preemptions_by_reason{reason}``: each ``request.preempted`` event's reason
  (kv_full | priority; the reasons sum to ``num_preemptions``);
- the MFU estimates (``estimated_flops_per_gpu_total``, ``estimated_read_bytes_per_gpu_total``,
  ``estimated_write_bytes_per_gpu_total``): each step event's tokens and
  ``kv_tokens_read`` through the cost model's one formula
  (:class:`engine.events.roofline.Roofline`), sized by ``engine.config``'s model
  summary (parameters, KV bytes per token, tensor parallelism) and phase C's weights;
  counted once those three facts have arrived;
- with ``kv_cache_metrics`` (``--kv-cache-metrics``) the block residency histograms
  (``kv_block_lifetime_seconds``, ``kv_block_idle_before_evict_seconds``,
  ``kv_block_reuse_gap_seconds``): the step events' block deltas folded by
  :class:`engine.events.folds.block_residency.BlockResidency`, every block observed;
- the V0-era ``avg_*_throughput_toks_per_s`` gauges: the ``stats`` event;
- ``iteration_requests{phase}`` / ``iteration_tokens_by_phase{phase}`` (vLLM PR#53550's):
  each step event's rows and tokens by phase (engine/events/exporters/iteration_phase_metrics.py);
- ``scheduler_policy_info{policy}``: the constructor's policy, then ``engine.config``'s; under
  ``--scheduling-policy priority`` the finished-request families' ``priority`` label and
  ``request_priority``: each request's ``request.arrived`` priority.

The same fact is also exported under the other names vLLM serves or served
(``request_time_per_output_token_seconds``, ``time_per_output_token_seconds``,
``prompt_tokens_by_source``, ``num_requests_waiting_by_reason``, the request
parameter histograms), so a tool that looks for any of them finds data.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.events import (
    EngineConfigEvent,
    Event,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    SinkFailed,
    StartupPhase,
    StatsEvent,
    StepEvent,
)
from engine.events.deferred_delivery import FlushedOnRead
from engine.events.exporters.deferred_series import (
    DeferredCounter,
    DeferredGauge,
    DeferredHistogram,
    SeriesWriter,
)
from engine.events.exporters.iteration_phase_metrics import IterationPhaseHistograms
from engine.events.exporters.priority_metrics import (
    PRIORITY_LABEL,
    REQUEST_PRIORITY_BUCKETS,
    ByPriority,
    priority_bucket,
    scheduler_policy_info,
)
from engine.events.exporters.stats import TokenTally, kv_cache_usage
from engine.events.folds.accounting import AbortMetrics
from engine.events.folds.block_residency import BlockResidency
from engine.events.folds.kv_occupancy import step_token_usage
from engine.events.folds.view import EngineView
from engine.events.phase_data import KvCacheData, LoadWeightsData, read_phase
from engine.events.request_records import PREEMPTION_REASONS
from engine.events.roofline import Roofline

# ---------------------------------------------------------------- vLLM buckets
# vllm/v1/metrics: time_to_first_token (0.8.4+)
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# inter_token_latency (0.10.2+; also time_per_output_token 0.8.4+)
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# request_latency (0.8.4+): e2e, queue, inference, prefill, decode
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# iteration_tokens (0.8.5+)
ITERATION_TOKENS_BUCKETS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# request_params_n and request_num_preemptions (vllm/v1/metrics/buckets.py)
REQUEST_PARAMS_N_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20)
REQUEST_PREEMPTION_BUCKETS: tuple[float, ...] = (1, 2, 3, 4, 5, 10, 20)
# kv_cache_residency (vllm/v1/metrics/buckets.py): ms-scale reuse gaps to 30-minute lifetimes
KV_CACHE_RESIDENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800,
)  # fmt: skip

# used only when neither the constructor nor an engine.config event gives one
FALLBACK_MAX_MODEL_LEN = 8192

# vLLM pre-creates a request_success series per FinishReason
FINISHED_REASONS = ("stop", "length", "abort", "error")

# The cache_config_info labels of current vLLM (CacheConfig.metrics_info plus engine)
CACHE_CONFIG_LABELS = (
    "block_size",
    "cache_dtype",
    "enable_prefix_caching",
    "engine",
    "gpu_memory_utilization",
    "kv_cache_max_concurrency",
    "kv_cache_memory_bytes",
    "kv_cache_size_tokens",
    "num_gpu_blocks",
    "prefix_caching_hash_algo",
    "sliding_window",
)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's request-token buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def _resolved_max_model_len(event: EngineConfigEvent) -> int | None:
    value = event.config.get("max_model_len") or event.model.get("max_position_embeddings")
    return int(value) if value else None


def observe_many(histogram: Histogram | DeferredHistogram, amounts: Sequence[float]) -> None:
    """``histogram.observe(a)`` for every ``a``, the same counts and sum, with each bucket
    touched once: prometheus_client's observe walks the bounds and takes two locks per
    value, and a finishing request brings one inter-token latency per output token."""
    if isinstance(histogram, DeferredHistogram):
        histogram.observe_many(amounts)
        return
    if not amounts:
        return
    histogram._raise_if_not_observable()
    bounds = histogram._upper_bounds  # ascending, the last +Inf; observe's `amount <= bound`
    for index, count in collections.Counter(bisect.bisect_left(bounds, a) for a in amounts).items():
        histogram._buckets[index].inc(count)
    histogram._sum.inc(sum(amounts))


class SharedView(Protocol):
    """An engine view another subscriber of the same bus keeps (the server's ``/debug/state``
    view, behind its lock): called with each event, it folds the event once however many of its
    readers call it; ``view`` is the fold, read on the thread that folds."""

    view: EngineView

    def __call__(self, event: Event) -> None: ...


class LabelledFamilies:
    """Declares metric families in one registry under the ``model_name`` and ``engine`` labels
    (``values`` for this engine): a plain family comes back as its one labelled series, a family
    with one more label (``counter_by``, ``gauge_by``) as the family, whose series the caller
    creates. ``priority_bucket``, under ``--scheduling-policy priority``, gives the
    finished-request histograms the bucketed ``priority`` label of the request at hand."""

    def __init__(self, registry: CollectorRegistry, labels: tuple[str, ...], values: tuple[str, ...],
                 priority_bucket: Callable[[], str] | None = None, writer: SeriesWriter | None = None) -> None:
        self.registry = registry
        self.labels = labels
        self.values = values
        self.priority_bucket = priority_bucket
        # the plain series' values, kept by their deferred wrappers and written when the registry
        # is collected (engine/events/exporters/deferred_series.py): registered before any family
        self.writer = writer or SeriesWriter(registry)

    def gauge(self, name: str, doc: str) -> Any:
        return self.writer.add(DeferredGauge(Gauge(name, doc, self.labels, registry=self.registry).labels(*self.values)))

    def counter(self, name: str, doc: str) -> Any:
        return self.writer.add(DeferredCounter(
            Counter(name, doc, self.labels, registry=self.registry).labels(*self.values)))

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Any:
        return self.writer.add(DeferredHistogram(
            Histogram(name, doc, self.labels, registry=self.registry, buckets=buckets).labels(*self.values)))

    def request_histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Any:
        """A finished-request histogram: plain, or by the request's priority bucket."""
        if self.priority_bucket is None:
            return self.histogram(name, doc, buckets)
        family = Histogram(name, doc, (*self.labels, PRIORITY_LABEL), registry=self.registry, buckets=buckets)
        return ByPriority(family, self.values, self.priority_bucket)

    def counter_by(self, name: str, doc: str, label: str) -> Counter:
        return Counter(name, doc, (*self.labels, label), registry=self.registry)

    def gauge_by(self, name: str, doc: str, label: str) -> Gauge:
        return Gauge(name, doc, (*self.labels, label), registry=self.registry)


def block_residency_histograms(families: LabelledFamilies) -> BlockResidency:
    """``--kv-cache-metrics``: vLLM's block residency histograms and kvscope's block ages,
    fed by a :class:`BlockResidency` fold of the step events."""
    lifetime, idle, reuse_gap, age_at_hit, age_at_eviction = [
        families.histogram(name, doc, KV_CACHE_RESIDENCY_BUCKETS).observe
        for name, doc in (
            ("vllm:kv_block_lifetime_seconds", "KV cache block lifetime from allocation to eviction."),
            ("vllm:kv_block_idle_before_evict_seconds",
             "Idle time before KV cache block eviction (since its last prefix-cache hit)."),
            ("vllm:kv_block_reuse_gap_seconds", "Time between consecutive KV cache block accesses."),
            ("kvscope:kv_block_age_at_hit_seconds",
             "Age of a KV cache block at each prefix-cache hit: seconds since its last hit, or its "
             "allocation when never hit (every block, no sampling)."),
            ("kvscope:kv_block_age_at_eviction_seconds",
             "Age of a KV cache block when its cached contents are evicted: seconds since its last hit, "
             "or its allocation when never hit (every block, no sampling)."),
        )
    ]

    def idle_and_age(seconds: float) -> None:  # one clock, read at eviction, under both names
        idle(seconds)
        age_at_eviction(seconds)

    return BlockResidency(lifetime, idle_and_age, reuse_gap, age_at_hit)


class MfuEstimates:
    """vLLM's MFU estimates (``vllm/v1/metrics/perf.py``): FLOPs and bytes read and written per
    GPU, counted per step from the cost model's one formula (:class:`Roofline`) once
    ``engine.config``'s model summary and phase C's weights have arrived. The counters are named
    with ``_total`` in code, as in vLLM, so the wire names are the same."""

    def __init__(self, families: LabelledFamilies) -> None:
        self.estimated_flops = families.counter(
            "vllm:estimated_flops_per_gpu_total",
            "Estimated number of floating point operations per GPU (for Model Flops Utilization calculations).",
        )
        self.estimated_read_bytes = families.counter(
            "vllm:estimated_read_bytes_per_gpu_total",
            "Estimated number of bytes read from memory per GPU (for Model Flops Utilization calculations).",
        )
        self.estimated_write_bytes = families.counter(
            "vllm:estimated_write_bytes_per_gpu_total",
            "Estimated number of bytes written to memory per GPU (for Model Flops Utilization calculations).",
        )
        self.roofline: Roofline | None = None  # known once engine.config and phase C have arrived
        self._model_summary: dict[str, Any] = {}
        self._tensor_parallel_size = 1
        self._weights_bytes: int | None = None

    def configure(self, model_summary: dict[str, Any], tensor_parallel_size: int) -> None:
        self._model_summary = model_summary
        self._tensor_parallel_size = tensor_parallel_size
        self._size_roofline()

    def weights_loaded(self, weights_bytes: int) -> None:
        self._weights_bytes = weights_bytes
        self._size_roofline()

    def count(self, event: StepEvent, num_tokens: int) -> None:
        roofline = self.roofline
        if roofline is not None and num_tokens:
            self.estimated_flops.inc(roofline.flops(num_tokens))
            self.estimated_read_bytes.inc(roofline.read_bytes(event.kv_tokens_read, num_tokens))
            self.estimated_write_bytes.inc(roofline.write_bytes(num_tokens))

    def _size_roofline(self) -> None:
        """The per-GPU roofline once the model summary and the weights are known: each
        tensor-parallel rank holds 1/tp of the parameters (the weights and the KV bytes
        per token the events carry are per rank already)."""
        parameters = self._model_summary.get("num_parameters")
        kv_bytes = self._model_summary.get("bytes_per_kv_token")
        if parameters is None or kv_bytes is None or self._weights_bytes is None:
            return
        tp = self._tensor_parallel_size
        experts = int(self._model_summary.get("expert_parameters") or 0)  # a MoE model (ModelConfig.summary)
        self.roofline = Roofline(int(parameters) // tp, self._weights_bytes, int(kv_bytes),
                                 expert_parameters=experts // tp,
                                 expert_weights_bytes=self._weights_bytes * experts // (int(parameters) or 1),
                                 num_experts=int(self._model_summary.get("num_experts") or 0),
                                 experts_per_token=int(self._model_summary.get("num_experts_per_tok") or 0))


def _token_usage_view(shared: SharedView | None) -> tuple[Callable[[Event], None], EngineView]:
    """The token usage gauge reads a whole engine view: the server's own when given (one fold of
    each event for both), else a private one. Returns (what folds an event, the view)."""
    if shared is None:
        own = EngineView(series_window=1, recent_window=1)
        return own.apply, own
    return shared, shared.view


def _throughput_gauges(families: LabelledFamilies) -> tuple[Any, Any]:
    """vLLM V0's average prompt and generation throughput gauges, in that order."""
    return (families.gauge("vllm:avg_prompt_throughput_toks_per_s",
                           "Average prefill throughput in tokens/s over the last stats interval (vLLM V0's gauge)."),
            families.gauge("vllm:avg_generation_throughput_toks_per_s",
                           "Average generation throughput in tokens/s over the last stats interval (vLLM V0's gauge)."))


class PrometheusMetrics(FlushedOnRead):
    """Bus subscriber that keeps vLLM V1's metric families in ``registry``.

    ``model_name`` is the served model name (label ``model_name``);
    ``engine_index`` the ``engine`` label. ``max_model_len`` sets the top of the
    request-token histograms (vLLM's 1-2-5 series); without it they are created
    when the engine.config event arrives. ``kv_cache_metrics`` adds the block
    residency histograms (vLLM's ``--kv-cache-metrics``; off, they cost nothing).
    ``scheduling_policy`` "priority" adds the bucketed ``priority`` label to the
    finished-request families and ``vllm:request_priority``
    (engine/events/exporters/priority_metrics.py). ``render()`` is the /metrics body.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        engine_index: str = "0",
        max_model_len: int | None = None,
        kv_cache_metrics: bool = False,
        scheduling_policy: str | None = None,
        shared_view: SharedView | None = None,
    ) -> None:
        self.registry = registry
        self._fold_view, self._occupancy = _token_usage_view(shared_view)
        self.model_name = model_name
        self.engine_index = str(engine_index)
        labels = ("model_name", "engine")
        values = (model_name, self.engine_index)
        self._label_names = labels
        self._label_values = values
        # --scheduling-policy priority: finished-request families carry vLLM PR#58078's bucketed
        # priority label (engine/events/exporters/priority_metrics.py), the bucket of the request at hand
        self._priority_labels = scheduling_policy == "priority"
        self._bucket = "0"
        self._priorities: dict[str, int] = {}  # request id -> priority, from arrival to finish
        # The families are declared in the order /metrics lists them (the registry's order).
        families = LabelledFamilies(registry, labels, values,
                                    (lambda: self._bucket) if self._priority_labels else None)
        self._request_histogram = families.request_histogram
        self._set_policy = scheduler_policy_info(registry, labels, values)
        self._set_policy(scheduling_policy or "fcfs")
        self.request_priority: Any = (
            families.histogram("vllm:request_priority", "Histogram of the priorities of finished requests.",
                               REQUEST_PRIORITY_BUCKETS) if self._priority_labels else None)
        self._declare_engine_families(families)
        self._declare_request_families(families)
        self.iteration_phases = IterationPhaseHistograms(registry, labels, values, ITERATION_TOKENS_BUCKETS,
                                                         families.writer)
        self._declare_token_source_families(families)
        self.mfu = MfuEstimates(families)
        self.block_residency = block_residency_histograms(families) if kv_cache_metrics else None
        self.avg_prompt_throughput, self.avg_generation_throughput = _throughput_gauges(families)
        self._max_tokens: dict[str, int] = {}  # request id -> max_tokens, from arrival to finish
        self.request_prompt_tokens: Any = None
        self.request_generation_tokens: Any = None
        self.request_prefill_kv_computed_tokens: Any = None
        self.request_max_num_generation_tokens: Any = None
        self.request_params_max_tokens: Any = None
        if max_model_len is not None:
            self._create_request_token_histograms(max_model_len)
        self._cache_config_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            CACHE_CONFIG_LABELS,
            registry=registry,
        )
        self._cache_config: dict[str, str] | None = None
        self.tokens = TokenTally()
        self._handlers = self._event_handlers()

    def _event_handlers(self) -> dict[type, Callable[[Any], None]]:
        return {
            StepEvent: self._on_step,
            RequestPreempted: self._on_preempted,
            RequestArrived: self._on_arrived,
            StatsEvent: self._on_stats,
            RequestFirstToken: self._on_first_token,
            RequestFinished: self._on_finished,
            EngineConfigEvent: self._on_config,
            StartupPhase: self._on_phase,
            SinkFailed: self._on_sink_failed,
        }

    def _declare_engine_families(self, families: LabelledFamilies) -> None:
        """The engine's state and running counts: requests running and waiting, KV usage, the
        prefix cache, preemptions, failed sinks, aborts, tokens, finished requests."""
        self.num_requests_running = families.gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = families.gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage_perc = families.gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        # experimental: vLLM PR#57336's name (open), token slots holding K/V over all slots
        self.kv_cache_token_usage_perc = families.gauge(
            "vllm:kv_cache_token_usage_perc",
            "Experimental: KV-cache token slots holding a token's K/V over all token slots (the block gauge counts "
            "a block holding one token as full). 1 means 100 percent usage.")
        self.prefix_cache_queries = families.counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = families.counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.num_preemptions = families.counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        by_reason = families.counter_by("vllm:num_preemptions_by_reason",
                                        "Cumulative number of preemptions by reason (kv_full, priority).", "reason")
        self._preemptions_by_reason = {reason: by_reason.labels(*self._label_values, reason)
                                       for reason in PREEMPTION_REASONS}
        self._preemptions_by_reason_family = by_reason
        self._sink_failures = families.counter_by(
            "kvscope:event_sink_failures", "Event sinks (recording, exporters, folds) that raised and were stopped; "
            "the engine went on without them.", "sink")
        # aborts by cause, prefill work discarded
        self.accounting = AbortMetrics(self.registry, self._label_names, self._label_values)
        self.prompt_tokens = families.counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = families.counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._declare_request_success(families)

    def _declare_request_success(self, families: LabelledFamilies) -> None:
        """``vllm:request_success``, one series per finish reason created up front as vLLM does
        (under ``--scheduling-policy priority`` at the default priority's bucket)."""
        values = self._label_values
        self._request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*self._label_names, "finished_reason", *((PRIORITY_LABEL,) if self._priority_labels else ())),
            registry=self.registry,
        )
        self._success_by_priority = (ByPriority(self._request_success, values, lambda: self._bucket)
                                     if self._priority_labels else None)
        self._success_by_reason = {
            reason: self._request_success.labels(*values, reason) for reason in FINISHED_REASONS
        } if not self._priority_labels else {}
        if self._success_by_priority is not None:  # vLLM's series per reason, at the default priority's bucket
            for reason in FINISHED_REASONS:
                self._success_by_priority.child(reason)

    def _declare_request_families(self, families: LabelledFamilies) -> None:
        """The per-request latency and parameter histograms, and tokens per engine step."""
        request_histogram = families.request_histogram
        self.time_to_first_token = request_histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = request_histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e_request_latency = request_histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.request_queue_time = request_histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_preprocess_time = request_histogram(
            "kvscope:request_preprocess_time_seconds",
            "Histogram of time from the server receiving a request to the scheduler taking it (parsing, "
            "tokenising, the queue to the engine thread); TTFT and e2e include it.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_inference_time = request_histogram(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = request_histogram(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = request_histogram(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.iteration_tokens = families.histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS,
        )
        # Same facts under the other names vLLM serves or served, so tools that look for
        # them (vllm-htop's *time_per_output_token*, V0-era dashboards) find data.
        self.request_time_per_output_token = request_histogram(
            "vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.time_per_output_token = request_histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (vLLM's old name of inter_token_latency).",
            ITL_BUCKETS,
        )
        self.request_params_n = request_histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                                  REQUEST_PARAMS_N_BUCKETS)
        self.request_num_preemptions = request_histogram(
            "vllm:request_num_preemptions", "Number of preemptions per finished request.", REQUEST_PREEMPTION_BUCKETS
        )

    def _declare_token_source_families(self, families: LabelledFamilies) -> None:
        """Prompt tokens by where they came from, and waiting requests by reason."""
        values = self._label_values
        self.prompt_tokens_cached = families.counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local prefix-cache hits)."
        )
        # vLLM counts here cached tokens computed again because a hit covered the whole prompt
        # (the last token must run to give logits). Local lookups stop one token short of the
        # prompt, in kvscope as in vLLM, so only an external KV source could move it: 0.
        families.counter("vllm:prompt_tokens_recomputed", "Number of cached tokens recomputed for forward pass.")
        by_source = families.counter_by("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", "source")
        self.prompt_tokens_computed = families.writer.add(DeferredCounter(by_source.labels(*values, "local_compute")))
        self.prompt_tokens_cache_hit = families.writer.add(DeferredCounter(by_source.labels(*values, "local_cache_hit")))
        by_source.labels(*values, "external_kv_transfer")  # present at 0, as vLLM pre-creates it
        waiting_by_reason = families.gauge_by("vllm:num_requests_waiting_by_reason",
                                              "Number of requests waiting, by reason.", "reason")
        self.waiting_for_capacity = families.writer.add(DeferredGauge(waiting_by_reason.labels(*values, "capacity")))
        waiting_by_reason.labels(*values, "deferred").set(0)  # kvscope defers nothing (no KV transfer)

    # ------------------------------------------------------------- subscriber
    def __call__(self, event: Event) -> None:
        self._fold_view(event)
        handler = self._handlers.get(type(event))
        if handler is not None:
            if self._priority_labels:
                self._priority_of(event)
            handler(event)

    def _priority_of(self, event: Event) -> None:
        """Set the priority bucket the finished-request families observe under: the request's."""
        if isinstance(event, RequestArrived):
            self._priorities[event.request_id] = event.priority
        request_id = getattr(event, "request_id", None)
        if request_id is not None:
            priority = self._priorities.get(request_id, 0)
            self._bucket = priority_bucket(priority)
            if isinstance(event, RequestFinished):
                self._priorities.pop(request_id, None)
                self.request_priority.observe(priority)

    def render(self) -> bytes:
        """The Prometheus text exposition of the registry (the /metrics body), after the
        events the bus held back (a deferred subscriber: engine/events/deferred_delivery.py)."""
        self.settle()
        return generate_latest(self.registry)

    # --------------------------------------------------------------- handlers
    def _on_sink_failed(self, event: SinkFailed) -> None:
        self._sink_failures.labels(*self._label_values, event.sink).inc()

    def _on_step(self, event: StepEvent) -> None:
        self.num_requests_running.set(event.num_running)
        self.num_requests_waiting.set(event.num_waiting)
        self.waiting_for_capacity.set(event.num_waiting)
        self.kv_cache_usage_perc.set(kv_cache_usage(event))
        self.kv_cache_token_usage_perc.set(step_token_usage(self._occupancy, event))
        if event.prefix_queries_tokens:
            self.prefix_cache_queries.inc(event.prefix_queries_tokens)
        if event.prefix_hits_tokens:
            self.prefix_cache_hits.inc(event.prefix_hits_tokens)
        if event.preempted:
            self.num_preemptions.inc(len(event.preempted))
        generated = self.tokens.step(event)
        if generated:
            self.generation_tokens.inc(generated)
        num_tokens = event.num_prefill_tokens + event.num_decode_tokens
        self.iteration_tokens.observe(num_tokens)
        self.iteration_phases.observe(event)
        self.mfu.count(event, num_tokens)
        if self.block_residency is not None:
            self.block_residency.apply(event)

    def _on_preempted(self, event: RequestPreempted) -> None:
        counter = self._preemptions_by_reason.get(event.reason)
        if counter is None:  # a reason a newer recording names
            counter = self._preemptions_by_reason[event.reason] = self._preemptions_by_reason_family.labels(
                *self._label_values, event.reason)
        counter.inc()

    def _on_arrived(self, event: RequestArrived) -> None:
        self.tokens.arrived(event)
        self.request_preprocess_time.observe(event.preprocess_s)
        self._max_tokens[event.request_id] = event.max_tokens

    def _on_stats(self, event: StatsEvent) -> None:
        self.avg_prompt_throughput.set(event.prompt_throughput)
        self.avg_generation_throughput.set(event.generation_throughput)

    def _on_first_token(self, event: RequestFirstToken) -> None:
        prompt = self.tokens.first_token(event)
        if prompt:
            self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(1)
        self.time_to_first_token.observe(event.ttft_s)

    def _on_finished(self, event: RequestFinished) -> None:
        prompt, generated, prompt_total, generated_total = self.tokens.settle(event)
        if prompt:
            self.prompt_tokens.inc(prompt)
        if generated:
            self.generation_tokens.inc(generated)
        success = (self._success_by_priority.child(event.reason) if self._success_by_priority is not None
                   else self._success_by_reason.get(event.reason))
        if success is None:
            success = self._request_success.labels(*self._label_values, event.reason)
            self._success_by_reason[event.reason] = success
        success.inc()
        self.accounting.finished(event)
        self.e2e_request_latency.observe(event.e2e_s)
        self.request_queue_time.observe(event.queue_time_s)
        self.request_inference_time.observe(event.inference_time_s)
        self.request_prefill_time.observe(event.prefill_time_s)
        self.request_decode_time.observe(event.decode_time_s)
        if self.request_prompt_tokens is None:
            self._create_request_token_histograms(FALLBACK_MAX_MODEL_LEN)
        # what the counters counted for it: their sums are vllm:prompt_tokens_total and
        # vllm:generation_tokens_total exactly, aborted and failed requests included
        self.request_prompt_tokens.observe(prompt_total)
        self.request_generation_tokens.observe(generated_total)
        self.request_max_num_generation_tokens.observe(event.output_tokens)  # n = 1: the one sequence
        max_tokens = self._max_tokens.pop(event.request_id, None)
        if max_tokens is not None:
            self.request_params_max_tokens.observe(max_tokens)
        self.request_params_n.observe(1)
        self.request_num_preemptions.observe(event.num_preemptions)
        if event.ttft_s is not None:  # the prefill ran: split its prompt by where the tokens came from
            computed = max(0, event.prompt_tokens - event.prefix_hit_tokens)
            self.request_prefill_kv_computed_tokens.observe(computed)
            self.prompt_tokens_computed.inc(computed)
            if event.prefix_hit_tokens:
                self.prompt_tokens_cache_hit.inc(event.prefix_hit_tokens)
                self.prompt_tokens_cached.inc(event.prefix_hit_tokens)
        if event.output_tokens > 1:  # vLLM: decode time over the tokens after the first
            self.request_time_per_output_token.observe(event.decode_time_s / (event.output_tokens - 1))
        observe_many(self.inter_token_latency, event.inter_token_latencies_s)
        observe_many(self.time_per_output_token, event.inter_token_latencies_s)

    def _on_config(self, event: EngineConfigEvent) -> None:
        config = event.config
        self._set_policy(str(config.get("scheduling_policy") or "fcfs"))
        self.mfu.configure(event.model, int(config.get("tensor_parallel_size") or 1))
        if self.request_prompt_tokens is None:
            self._create_request_token_histograms(_resolved_max_model_len(event) or FALLBACK_MAX_MODEL_LEN)
        self._set_cache_config(
            block_size=config.get("block_size"),
            cache_dtype=config.get("kv_cache_dtype", "auto"),
            enable_prefix_caching=config.get("enable_prefix_caching"),
            gpu_memory_utilization=config.get("gpu_memory_utilization"),
            kv_cache_memory_bytes=config.get("kv_cache_memory_bytes"),
            prefix_caching_hash_algo="builtin",  # Python's hash() of token tuples (engine.core.kv_cache)
            sliding_window=None,
        )

    def _on_phase(self, event: StartupPhase) -> None:
        if event.status != "end" or event.rank:  # the replica's numbers are rank 0's (every rank's pool is alike)
            return
        weights = read_phase(event, LoadWeightsData)
        if weights is not None and weights.weights_bytes is not None:
            self.mfu.weights_loaded(weights.weights_bytes)
        kv = read_phase(event, KvCacheData)
        if kv is None:
            return
        fields: dict[str, Any] = {}
        if kv.num_blocks is not None:
            fields["num_gpu_blocks"] = kv.num_blocks
        if kv.kv_cache_tokens is not None:
            fields["kv_cache_size_tokens"] = kv.kv_cache_tokens
        if kv.max_concurrency is not None:
            fields["kv_cache_max_concurrency"] = kv.max_concurrency
        if kv.block_size is not None:
            fields["block_size"] = kv.block_size
        if fields:
            self._set_cache_config(**fields)

    # ---------------------------------------------------------------- helpers
    def _create_request_token_histograms(self, max_model_len: int) -> None:
        buckets = tuple(float(b) for b in build_1_2_5_buckets(max_model_len))
        self.request_prompt_tokens = self._request_histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", buckets)
        self.request_generation_tokens = self._request_histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", buckets)
        for attribute, name, doc in (
            ("request_prefill_kv_computed_tokens", "vllm:request_prefill_kv_computed_tokens",
             "Histogram of new KV tokens computed during prefill (excluding cached tokens)."),
            ("request_max_num_generation_tokens", "vllm:request_max_num_generation_tokens",
             "Histogram of maximum number of requested generation tokens."),
            ("request_params_max_tokens", "vllm:request_params_max_tokens",
             "Histogram of the max_tokens request parameter."),
        ):
            setattr(self, attribute, self._request_histogram(name, doc, buckets))

    def _set_cache_config(self, **fields: Any) -> None:
        """Replace the single cache_config_info series (value 1) with updated labels;
        values are stringified as vLLM does (``str(value)``: "True", "None")."""
        current = self._cache_config or {name: "None" for name in CACHE_CONFIG_LABELS}
        for name, value in fields.items():
            current[name] = str(value)
        current["engine"] = self.engine_index
        self._cache_config = current
        self._cache_config_info.clear()
        self._cache_config_info.labels(**current).set(1)
