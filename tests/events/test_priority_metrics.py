"""Priority in the metrics (engine/events/exporters/priority_metrics.py, vLLM PR#58078's shapes): under
``--scheduling-policy priority`` the finished-request families carry the bucketed ``priority``
label and ``vllm:request_priority`` holds the raw priorities; ``vllm:scheduler_policy_info``
names the policy in force either way. Driven by a real priority-scheduled run."""

from __future__ import annotations

import os
import subprocess
import sys

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from engine.core.scheduler import SchedulerConfig
from engine.events import EngineConfigEvent, EventBus
from engine.events.exporters.metrics import PrometheusMetrics
from engine.events.exporters.priority_metrics import priority_bucket
from engine.sim.driver import DriverRequest, run_driver

PRIORITIES = (-7, -1, 0, 0, 1, 3, -2, 9)
LABELS = {"model_name": "m", "engine": "0"}


def run(policy: str) -> PrometheusMetrics:
    metrics = PrometheusMetrics(CollectorRegistry(), "m", max_model_len=512, scheduling_policy=policy)
    bus = EventBus(clock=lambda: 0.0)
    bus.subscribe(metrics)
    bus.publish(EngineConfigEvent(config={"block_size": 16, "scheduling_policy": policy}))
    requests = [DriverRequest(f"r{i}", [i * 100 + k for k in range(20 + i)], 3 + i, arrival_step=i, priority=p)
                for i, p in enumerate(PRIORITIES)]
    config = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_model_len=512, policy=policy)
    assert run_driver(requests, config, bus=bus).completed
    return metrics


def value(metrics: PrometheusMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {**LABELS, **labels}) or 0.0


def test_priority_buckets() -> None:
    assert [priority_bucket(p) for p in (-9, -2, -1, 0, 1, 2, 50)] == ["<-1", "<-1", "-1", "0", "1", ">1", ">1"]


def test_finished_request_families_carry_the_bucketed_priority() -> None:
    metrics = run("priority")
    expected = {bucket: sum(priority_bucket(p) == bucket for p in PRIORITIES) for bucket in ("<-1", "-1", "0", "1", ">1")}
    for bucket, count in expected.items():
        assert value(metrics, "vllm:request_success_total", finished_reason="length", priority=bucket) == count
        assert value(metrics, "vllm:e2e_request_latency_seconds_count", priority=bucket) == count
        assert value(metrics, "vllm:time_to_first_token_seconds_count", priority=bucket) == count
        assert value(metrics, "vllm:request_generation_tokens_count", priority=bucket) == count
    assert value(metrics, "vllm:request_priority_count") == len(PRIORITIES)
    for bound in ("-2.0", "0.0", "5.0"):  # cumulative buckets (no _sum: a histogram with negative buckets has none)
        assert value(metrics, "vllm:request_priority_bucket", le=bound) == sum(p <= float(bound) for p in PRIORITIES)
    assert value(metrics, "vllm:scheduler_policy_info", policy="priority") == 1
    assert value(metrics, "vllm:scheduler_policy_info", policy="fcfs") == 0
    # the token counters carry no priority; the per-request sums over every bucket still equal them
    generated = sum(value(metrics, "vllm:request_generation_tokens_sum", priority=b) for b in expected)
    assert generated == value(metrics, "vllm:generation_tokens_total") == sum(3 + i for i in range(len(PRIORITIES)))
    # /metrics parses, with no series left without its priority
    text = metrics.render().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name.startswith("vllm:e2e_request_latency_seconds")]
    assert samples and all("priority" in s.labels for s in samples)


def test_fcfs_has_no_priority_label_and_says_its_policy() -> None:
    metrics = run("fcfs")
    assert value(metrics, "vllm:request_success_total", finished_reason="length") == len(PRIORITIES)
    assert value(metrics, "vllm:e2e_request_latency_seconds_count") == len(PRIORITIES)
    assert metrics.registry.get_sample_value("vllm:request_priority_count", LABELS) is None
    assert value(metrics, "vllm:scheduler_policy_info", policy="fcfs") == 1
    assert value(metrics, "vllm:scheduler_policy_info", policy="priority") == 0


def test_the_policy_series_come_in_one_order_whatever_the_hash_seed() -> None:
    """/metrics bytes must not depend on PYTHONHASHSEED (a scrape diff, a golden file)."""
    script = ("from prometheus_client import CollectorRegistry, generate_latest\n"
              "from engine.events.exporters.priority_metrics import scheduler_policy_info\n"
              "r = CollectorRegistry(); scheduler_policy_info(r, (), ())('priority')\n"
              "print(generate_latest(r).decode())")
    outputs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("0", "1", "2", "3")}
    assert len(outputs) == 1
    (text,) = outputs
    assert text.index('policy="fcfs"} 0.0') < text.index('policy="priority"} 1.0')
