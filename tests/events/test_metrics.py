"""The Prometheus sink: vLLM V1's families, types, labels and buckets, fed by a
real event stream and read back with prometheus_client's own text parser."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from engine.events import Event, EventBus, RequestArrived, RequestFinished, RequestFirstToken
from engine.events.exporters.metrics import PrometheusMetrics, build_1_2_5_buckets, observe_many
from tests.scripted_events import MAX_MODEL_LEN, NUM_BLOCKS, new_bus, run_script

MODEL = "SmolLM2-135M-Instruct"

# Parser family name (counters lose "_total") -> type, as vLLM V1 exposes them.
EXPECTED_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:cache_config_info": "gauge",
    # vLLM 0.32's other families for the same facts, and the names older tools look for
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_num_preemptions": "histogram",
    "vllm:prompt_tokens_cached": "counter",
    "vllm:prompt_tokens_by_source": "counter",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:avg_prompt_throughput_toks_per_s": "gauge",
    "vllm:avg_generation_throughput_toks_per_s": "gauge",
}

# Copied from ../shared/reference/vllm-metrics.md (V1, 0.8.5+), not from engine.events.exporters.metrics.
REFERENCE_BUCKETS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5,
                                         5, 7.5, 10, 20, 40, 80, 160, 640, 2560],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5,
                                         7.5, 10, 20, 40, 80],
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "vllm:request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000],  # 1-2-5 up to 2048
    "vllm:request_generation_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000],
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    "vllm:request_num_preemptions": [1, 2, 3, 4, 5, 10, 20],
}  # fmt: skip
REQUEST_LATENCY = [0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680]  # fmt: skip
for _name in ("e2e_request_latency", "request_queue_time", "request_inference_time", "request_prefill_time",
              "request_decode_time"):  # fmt: skip
    REFERENCE_BUCKETS[f"vllm:{_name}_seconds"] = REQUEST_LATENCY


def parse(metrics: PrometheusMetrics) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def sample_value(families: dict, family: str, sample_name: str, **labels: str) -> float:
    for s in families[family].samples:
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {sample_name} {labels} in {family}")


def counter_values(families: dict) -> dict[tuple, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        if f.type == "counter"
        for s in f.samples
        if s.name.endswith("_total")
    }


@pytest.fixture
def scripted() -> tuple[PrometheusMetrics, object, list[dict]]:
    bus, clock = new_bus()
    metrics = PrometheusMetrics(CollectorRegistry(), MODEL)
    bus.subscribe(metrics)
    renders: list[dict] = []
    totals = run_script(bus, clock, after_step=lambda _i: renders.append(parse(metrics)))
    return metrics, totals, renders


def test_every_vllm_family_is_exposed_with_its_type_and_labels(scripted) -> None:
    metrics, _totals, _renders = scripted
    families = parse(metrics)
    for name, kind in EXPECTED_FAMILIES.items():
        assert name in families, f"{name} missing from /metrics"
        assert families[name].type == kind, f"{name} is a {families[name].type}, vLLM exports a {kind}"
        assert families[name].samples, f"{name} has no samples"
    for name in EXPECTED_FAMILIES:
        if name == "vllm:cache_config_info":
            continue
        for s in families[name].samples:
            assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0", (name, s.labels)
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    # wire names, the ones dashboards query
    text = metrics.render().decode()
    for wire in ("vllm:prompt_tokens_total{", "vllm:num_preemptions_total{", "vllm:iteration_tokens_total_bucket{",
                 "vllm:prefix_cache_hits_total{", "vllm:request_success_total{"):  # fmt: skip
        assert wire in text


def test_histogram_buckets_equal_the_reference(scripted) -> None:
    metrics, _totals, _renders = scripted
    families = parse(metrics)
    for name, expected in REFERENCE_BUCKETS.items():
        les = [s.labels["le"] for s in families[name].samples if s.name == name + "_bucket"]
        assert les[-1] == "+Inf"
        assert [float(le) for le in les[:-1]] == [float(b) for b in expected], name


def test_counts_agree_with_the_events(scripted) -> None:
    metrics, totals, _renders = scripted
    f = parse(metrics)
    assert sample_value(f, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == totals.prompt_tokens == 60
    assert (
        sample_value(f, "vllm:generation_tokens", "vllm:generation_tokens_total") == totals.output_tokens == 8
    )
    assert sample_value(f, "vllm:num_preemptions", "vllm:num_preemptions_total") == totals.preemptions == 1
    assert (
        sample_value(f, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
        == totals.prefix_queries
    )
    assert sample_value(f, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == totals.prefix_hits
    for reason in ("stop", "length", "abort"):
        expected = sum(1 for r in totals.finished.values() if r == reason)
        assert (
            sample_value(f, "vllm:request_success", "vllm:request_success_total", finished_reason=reason)
            == expected
        )
    finished = len(totals.finished)
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):  # fmt: skip
        assert sample_value(f, f"vllm:{name}", f"vllm:{name}_count") == finished, name
    # the per-request sums are the counters' totals: the 30-token prompt aborted before its first
    # token is observed (count 3) with the 0 prompt tokens the counter billed for it
    assert sample_value(f, "vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == 20 + 40 == \
        sample_value(f, "vllm:prompt_tokens", "vllm:prompt_tokens_total")
    assert sample_value(f, "vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == \
        sample_value(f, "vllm:generation_tokens", "vllm:generation_tokens_total")
    assert sample_value(f, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum") == 4.6
    assert sample_value(f, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 2
    itl_count = sample_value(f, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count")
    assert itl_count == totals.inter_token_latencies == 6
    assert sample_value(f, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count") == totals.steps
    # the old ITL name carries the same observations; the per-request TPOT one per request with 2+ tokens
    assert sample_value(f, "vllm:time_per_output_token_seconds", "vllm:time_per_output_token_seconds_count") == 6
    tpot = sample_value(f, "vllm:request_time_per_output_token_seconds",
                        "vllm:request_time_per_output_token_seconds_count")
    assert 1 <= tpot <= finished
    assert sample_value(f, "vllm:request_params_n", "vllm:request_params_n_count") == finished
    assert sample_value(f, "vllm:request_num_preemptions", "vllm:request_num_preemptions_sum") == totals.preemptions
    computed = sample_value(f, "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_by_source_total",
                            source="local_compute")
    hit = sample_value(f, "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_by_source_total",
                       source="local_cache_hit")
    assert hit == sample_value(f, "vllm:prompt_tokens_cached", "vllm:prompt_tokens_cached_total")
    assert computed == sample_value(f, "vllm:request_prefill_kv_computed_tokens",
                                    "vllm:request_prefill_kv_computed_tokens_sum")
    assert (
        sample_value(f, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum")
        == totals.iteration_tokens
    )


def test_gauges_follow_the_last_step(scripted) -> None:
    metrics, totals, renders = scripted
    # after step 2 (r2 preempted): 1 running, 1 waiting, 2 of 64 blocks
    assert sample_value(renders[2], "vllm:num_requests_running", "vllm:num_requests_running") == 1
    assert sample_value(renders[2], "vllm:num_requests_waiting", "vllm:num_requests_waiting") == 1
    assert sample_value(renders[2], "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == 2 / NUM_BLOCKS
    assert sample_value(renders[3], "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == 3 / NUM_BLOCKS
    last = totals.last_step
    final = parse(metrics)
    usage = sample_value(final, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc")
    assert usage == last.kv_blocks_used / last.kv_blocks_total


def test_generation_tokens_count_as_they_are_sampled(scripted) -> None:
    _metrics, _totals, renders = scripted
    generated = [sample_value(r, "vllm:generation_tokens", "vllm:generation_tokens_total") for r in renders]
    # step 0: two first tokens; step 1: +2 decodes; step 2: +1; step 3: r1's last (at its finish);
    # step 4: r2's recompute token and its last, both at its finish
    assert generated == [2, 4, 5, 6, 8]
    prompt = [sample_value(r, "vllm:prompt_tokens", "vllm:prompt_tokens_total") for r in renders]
    assert prompt == [60, 60, 60, 60, 60]


def test_counters_never_decrease(scripted) -> None:
    _metrics, _totals, renders = scripted
    previous: dict[tuple, float] = {}
    for families in renders:
        current = counter_values(families)
        for key, value in previous.items():
            assert current[key] >= value, f"{key} went from {value} to {current[key]}"
        previous = current
    assert previous, "no counters parsed"


def test_cache_config_info_carries_the_cache_config() -> None:
    bus, clock = new_bus()
    metrics = PrometheusMetrics(CollectorRegistry(), MODEL)
    bus.subscribe(metrics)
    seen: list[dict[str, str]] = []

    def info() -> dict[str, str]:
        samples = parse(metrics)["vllm:cache_config_info"].samples
        assert len(samples) == 1 and samples[0].value == 1.0
        return samples[0].labels

    def look(event: Event) -> None:  # subscribed after the sink: sees its update to each event
        if event.type in ("engine.config", "startup.phase"):
            seen.append(info())

    bus.subscribe(look)
    run_script(bus, clock)
    before_e, after_e = seen[0], seen[-1]
    assert before_e["num_gpu_blocks"] == "None"
    assert after_e == {
        "block_size": "16",
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
        "engine": "0",
        "gpu_memory_utilization": "0.9",
        "kv_cache_max_concurrency": "None",  # the script's phase E does not report it
        "kv_cache_memory_bytes": "None",  # nor does its config give --kv-cache-memory-bytes
        "kv_cache_size_tokens": str(NUM_BLOCKS * 16),
        "num_gpu_blocks": str(NUM_BLOCKS),
        "prefix_caching_hash_algo": "builtin",
        "sliding_window": "None",
    }
    assert "model_name" not in after_e  # vLLM's info gauge has engine but no model_name


def test_request_token_buckets_follow_max_model_len() -> None:
    assert build_1_2_5_buckets(MAX_MODEL_LEN) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert build_1_2_5_buckets(1) == [1]
    metrics = PrometheusMetrics(CollectorRegistry(), MODEL, max_model_len=500)
    les = [
        s.labels["le"]
        for s in parse(metrics)["vllm:request_generation_tokens"].samples
        if s.name.endswith("_bucket")
    ]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "+Inf"]


def test_a_late_subscriber_still_counts_finished_requests_exactly() -> None:
    """Subscribed after a request arrived and got its first token: the finish
    event's exact counts fill in what the sink did not see."""
    bus = EventBus(clock=lambda: 1.0)
    bus.publish(RequestArrived(request_id="x", prompt_tokens=7))
    bus.publish(RequestFirstToken(request_id="x", ttft_s=0.2))
    metrics = PrometheusMetrics(CollectorRegistry(), MODEL, max_model_len=64)
    bus.subscribe(metrics)
    bus.publish(RequestFinished(request_id="x", reason="stop", prompt_tokens=7, output_tokens=5, ttft_s=0.2))
    f = parse(metrics)
    assert sample_value(f, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 7
    assert sample_value(f, "vllm:generation_tokens", "vllm:generation_tokens_total") == 5


def test_registries_are_independent() -> None:
    a = PrometheusMetrics(CollectorRegistry(), "a")
    b = PrometheusMetrics(CollectorRegistry(), "b", engine_index="1")
    bus, clock = new_bus()
    bus.subscribe(a)
    run_script(bus, clock)
    fb = parse(b)
    assert sample_value(fb, "vllm:generation_tokens", "vllm:generation_tokens_total", engine="1") == 0
    assert sample_value(parse(a), "vllm:generation_tokens", "vllm:generation_tokens_total", engine="0") == 8


def test_driver_run_counts_agree_with_the_driver_result() -> None:
    driver = pytest.importorskip("engine.sim.driver")
    from engine.core.scheduler import SchedulerConfig

    prefix = list(range(100, 132))  # two shared full blocks
    requests = [
        driver.DriverRequest(
            f"d{i}", prefix + [1000 + i] * (5 + i % 7), output_tokens=20 + (i * 7) % 25, arrival_step=i // 3
        )
        for i in range(24)
    ]
    # 16 blocks for 8 running requests that grow: preemptions (12 in this run)
    config = SchedulerConfig(num_blocks=16, block_size=16, max_num_seqs=8, max_num_batched_tokens=128,
                             max_model_len=256)  # fmt: skip
    step_clock = {"now": 0.0}
    bus = EventBus(clock=lambda: step_clock["now"])
    metrics = PrometheusMetrics(CollectorRegistry(), MODEL, max_model_len=256)
    bus.subscribe(metrics)

    def advance(_sched, _out) -> None:
        step_clock["now"] += 1.0

    result = driver.run_driver(requests, config, bus=bus, on_step=advance)
    assert result.completed and result.finished == len(requests)
    f = parse(metrics)
    assert (
        sample_value(f, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 24
    )
    assert sample_value(f, "vllm:generation_tokens", "vllm:generation_tokens_total") == sum(
        r.output_tokens for r in requests
    )
    assert sample_value(f, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == sum(
        len(r.prompt_token_ids) for r in requests
    )
    assert sample_value(f, "vllm:num_preemptions", "vllm:num_preemptions_total") == result.preemptions
    assert result.preemptions > 0, "the pool was meant to be small enough to preempt"
    assert (
        sample_value(f, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
        == result.prefix_query_tokens
    )
    assert (
        sample_value(f, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == result.prefix_hit_tokens
    )
    assert sample_value(f, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count") == result.steps
    assert sample_value(f, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum") == (
        result.num_prefill_tokens + result.num_decode_tokens
    )
    assert sample_value(f, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 24
    assert sample_value(f, "vllm:num_requests_running", "vllm:num_requests_running") == 0
    assert sample_value(f, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == 0
    assert metrics.tokens.num_live == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=2e3, allow_nan=False), max_size=80))
def test_observe_many_is_observe_of_each_value(latencies: list[float]) -> None:
    """The batched observe behind the inter-token latency histograms renders the same
    buckets and count as prometheus_client's observe of each value (the sum to rounding),
    including values on a bucket's bound and past the last finite one."""
    buckets = (0.01, 0.025, 0.05, 0.1, 1.0, 2.5)
    latencies = [*latencies, 0.05, 2.5, 0.0]  # on bounds: `le` includes the bound
    one_by_one, batched = CollectorRegistry(), CollectorRegistry()
    single = Histogram("itl", "d", ["m"], registry=one_by_one, buckets=buckets).labels("x")
    many = Histogram("itl", "d", ["m"], registry=batched, buckets=buckets).labels("x")
    for value in latencies:
        single.observe(value)
    observe_many(many, latencies)

    def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
        return {(s.name, s.labels.get("le", "")): s.value for f in registry.collect() for s in f.samples
                if not s.name.endswith("_created")}

    expected, got = samples(one_by_one), samples(batched)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key
