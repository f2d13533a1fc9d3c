"""vLLM's newest families (issue 18 part 4) after a real model-free run that preempts
for both reasons, hits and evicts the prefix cache (tests/preempting_run.py): /metrics
is parsed with prometheus_client's own parser and every value is held to what the
run's events say."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from engine.events import EngineConfigEvent, RequestFinished, RequestPreempted, StartupPhase, StepEvent
from engine.events.exporters.metrics import KV_CACHE_RESIDENCY_BUCKETS, PrometheusMetrics
from engine.events.phase_data import KvCacheData
from tests.paths import DATA
from tests.preempting_run import SERVED_NAME, PreemptingRun, preempting_run

RESIDENCY = ("vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds",
             "vllm:kv_block_reuse_gap_seconds")


@pytest.fixture(scope="module")
def run() -> PreemptingRun:
    return preempting_run()


@pytest.fixture(scope="module")
def families(run: PreemptingRun) -> dict:
    return {f.name: f for f in text_string_to_metric_families(run.metrics.render().decode())}


def value(families: dict, sample: str, **labels: str) -> float:
    family = sample.removesuffix("_total").removesuffix("_sum").removesuffix("_count")
    for s in families[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            assert s.labels["model_name"] == SERVED_NAME and s.labels["engine"] == "0", s.labels
            return s.value
    raise AssertionError(f"no sample {sample} {labels}")


def test_preemptions_by_reason_count_each_preempted_event_and_sum_to_the_total(run, families) -> None:
    reasons = Counter(e.reason for e in run.events if isinstance(e, RequestPreempted))
    assert reasons["kv_full"] > 0 and reasons["priority"] > 0, reasons  # the run exercises both
    assert families["vllm:num_preemptions_by_reason"].type == "counter"
    for reason in ("kv_full", "priority"):
        assert value(families, "vllm:num_preemptions_by_reason_total", reason=reason) == reasons[reason]
    steps = [e for e in run.events if isinstance(e, StepEvent)]
    assert value(families, "vllm:num_preemptions_total") == sum(len(s.preempted) for s in steps) == reasons.total()


def test_per_request_preemptions_and_prefill_tokens_follow_the_finished_events(run, families) -> None:
    finished = [e for e in run.events if isinstance(e, RequestFinished)]
    assert value(families, "vllm:request_num_preemptions_count") == len(finished)
    assert value(families, "vllm:request_num_preemptions_sum") == sum(e.num_preemptions for e in finished)
    assert any(e.num_preemptions for e in finished)
    prefilled = [e for e in finished if e.ttft_s is not None]
    computed = sum(e.prompt_tokens - e.prefix_hit_tokens for e in prefilled)
    hits = sum(e.prefix_hit_tokens for e in prefilled)
    assert hits > 0
    assert value(families, "vllm:request_prefill_kv_computed_tokens_sum") == computed
    assert value(families, "vllm:request_prefill_kv_computed_tokens_count") == len(prefilled)
    assert value(families, "vllm:prompt_tokens_cached_total") == hits
    assert value(families, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == hits
    assert value(families, "vllm:prompt_tokens_by_source_total", source="local_compute") == computed
    # a local hit stops one token short of the prompt, so no cached token is ever recomputed
    assert value(families, "vllm:prompt_tokens_recomputed_total") == 0


def test_mfu_estimates_are_the_roofline_of_each_step_event(run, families) -> None:
    steps = [e for e in run.events if isinstance(e, StepEvent)]
    tokens = [s.num_prefill_tokens + s.num_decode_tokens for s in steps]
    assert all(s.kv_tokens_read >= n for s, n in zip(steps, tokens, strict=True))
    busy = [(s, n) for s, n in zip(steps, tokens, strict=True) if n]
    flops = sum(2.0 * run.num_parameters * n for _s, n in busy)
    read = sum(run.weights_bytes + s.kv_tokens_read * run.bytes_per_kv_token for s, _n in busy)
    write = sum(n * run.bytes_per_kv_token for _s, n in busy)
    assert value(families, "vllm:estimated_flops_per_gpu_total") == pytest.approx(flops, rel=1e-12)
    assert value(families, "vllm:estimated_read_bytes_per_gpu_total") == pytest.approx(read, rel=1e-12)
    assert value(families, "vllm:estimated_write_bytes_per_gpu_total") == pytest.approx(write, rel=1e-12)


def test_block_residency_observes_every_evicted_block(run, families) -> None:
    evicted = sum(len(e.evicted) for e in run.events if isinstance(e, StepEvent))
    assert evicted > 0
    for name in RESIDENCY:
        family = families[name]
        assert family.type == "histogram"
        bounds = [float(s.labels["le"]) for s in family.samples if s.name == f"{name}_bucket"][:-1]
        assert bounds == list(KV_CACHE_RESIDENCY_BUCKETS)
    assert value(families, "vllm:kv_block_lifetime_seconds_count") == evicted  # every block born in the run
    assert value(families, "vllm:kv_block_idle_before_evict_seconds_count") == evicted
    # idle ends at the same eviction but starts at the last hit, never before birth
    assert 0 < value(families, "vllm:kv_block_idle_before_evict_seconds_sum") < value(
        families, "vllm:kv_block_lifetime_seconds_sum")
    assert value(families, "vllm:kv_block_reuse_gap_seconds_count") > 0  # the shared prefixes were hit again


def test_residency_families_exist_only_with_kv_cache_metrics(run) -> None:
    plain = PrometheusMetrics(CollectorRegistry(), SERVED_NAME)
    for event in run.events:
        plain(event)
    names = {f.name for f in text_string_to_metric_families(plain.render().decode())}
    assert not names & set(RESIDENCY)
    assert "vllm:estimated_flops_per_gpu" in names and "vllm:num_preemptions_by_reason" in names


def test_iteration_details_lines_are_vllms_and_count_every_computed_token(run) -> None:
    steps = [e for e in run.events if isinstance(e, StepEvent)]
    busy = [s for s in steps if s.num_prefill_tokens + s.num_decode_tokens]
    assert len(run.iteration_lines) == len(busy)
    assert run.iteration_lines[0] == (
        f"Iteration(0): 1 context requests, {busy[0].num_prefill_tokens} context tokens, 0 generation requests, "
        "0 generation tokens, iteration elapsed time: 0.00 ms")
    total = 0
    for i, line in enumerate(run.iteration_lines):
        head, rest = line.split(": ", 1)
        assert head == f"Iteration({i})"
        words = rest.replace(",", "").split()
        total += int(words[3]) + int(words[9])
    assert total == sum(s.num_prefill_tokens + s.num_decode_tokens for s in busy)


def real_vllm_samples() -> dict[str, set[str]]:
    """Sample name -> label names in a real vLLM 0.32 /metrics (tests/data/vllm-0.32-cpu)."""
    out: dict[str, set[str]] = {}
    text = (DATA / "vllm-0.32-cpu" / "metrics-3.txt").read_text()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def test_families_real_vllm_serves_have_its_sample_names_labels_and_buckets(families) -> None:
    real = real_vllm_samples()
    ours = {s.name: s for f in families.values() for s in f.samples}
    for family in ("vllm:estimated_flops_per_gpu", "vllm:estimated_read_bytes_per_gpu",
                   "vllm:estimated_write_bytes_per_gpu", "vllm:request_num_preemptions",
                   "vllm:request_prefill_kv_computed_tokens", "vllm:prompt_tokens_cached"):
        names = {s.name for s in families[family].samples if not s.name.endswith("_created")}
        assert names <= set(real), (family, names - set(real))
        for name in names:
            assert set(ours[name].labels) == real[name], name
    text = (DATA / "vllm-0.32-cpu" / "metrics-3.txt").read_text()
    real_bounds = sorted({float(m) for m in re.findall(r'vllm:request_num_preemptions_bucket\{[^}]*le="([\d.]+)"', text)})
    ours_bounds = [float(s.labels["le"]) for s in families["vllm:request_num_preemptions"].samples
                   if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
    assert ours_bounds == real_bounds
    # every cache_config_info label kvscope sets is one of vLLM's CacheConfig fields (or engine)
    assert set(ours["vllm:cache_config_info"].labels) <= real["vllm:cache_config_info"]


def test_cache_config_info_reports_the_pool_size_and_concurrency_phase_e_measured() -> None:
    metrics = PrometheusMetrics(CollectorRegistry(), SERVED_NAME)
    metrics(EngineConfigEvent(config={"block_size": 32, "kv_cache_memory_bytes": 2**30}))
    metrics(StartupPhase(phase="E", name="kv_cache", status="end",
                         data=KvCacheData(num_blocks=728, block_size=32, kv_cache_tokens=23296,
                                          max_concurrency=22.75).to_dict()))
    [info] = [s for f in text_string_to_metric_families(metrics.render().decode()) if f.name == "vllm:cache_config_info"
              for s in f.samples]
    assert info.value == 1.0
    # the same values real vLLM 0.32 serves for this pool (tests/data/vllm-0.32-cpu/metrics-3.txt)
    assert {k: info.labels[k] for k in ("block_size", "num_gpu_blocks", "kv_cache_size_tokens",
                                        "kv_cache_max_concurrency", "kv_cache_memory_bytes")} == {
        "block_size": "32", "num_gpu_blocks": "728", "kv_cache_size_tokens": "23296",
        "kv_cache_max_concurrency": "22.75", "kv_cache_memory_bytes": "1073741824"}
