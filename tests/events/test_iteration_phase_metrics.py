"""Phase-aware iteration histograms (engine/events/exporters/iteration_phase_metrics.py, vLLM
PR#53550's shapes): per model-running step, the requests and tokens of each phase under a
``phase`` label, a mixed step recording both phases and an empty step neither. Checked on a
hand-built step sequence and on the step events of a real scheduler run (chunked prefills
beside decodes), read back through /metrics' text and prometheus_client's parser."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from engine.core.scheduler import SchedulerConfig
from engine.events import EventBus, StepEvent
from engine.events.exporters.metrics import ITERATION_TOKENS_BUCKETS, PrometheusMetrics
from engine.sim.driver import DriverRequest, run_driver

FAMILIES = ("vllm:iteration_requests", "vllm:iteration_tokens_by_phase")


def scraped(text: str) -> dict[tuple[str, str, str], float]:
    """(family, sample suffix, phase) -> value, from the /metrics text as a scraper reads it."""
    values: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in FAMILIES:
            continue
        assert family.type == "histogram"
        for s in family.samples:
            assert s.labels["engine"] == "0"
            suffix = s.name[len(family.name):]
            if suffix in ("_count", "_sum"):
                values[(family.name, suffix, s.labels["phase"])] = s.value
    return values


def expected(steps: list[StepEvent]) -> dict[tuple[str, str, str], float]:
    """What the histograms should hold, counted from the step events' rows."""
    values = {(f, suffix, phase): 0.0 for f in FAMILIES for suffix in ("_count", "_sum")
              for phase in ("prefill", "decode")}
    for step in steps:
        for phase in ("prefill", "decode"):
            rows = [row[0] for row in step.scheduled.values() if row[1] == phase]
            if not rows:
                continue
            assert sum(rows) == (step.num_prefill_tokens if phase == "prefill" else step.num_decode_tokens)
            values[("vllm:iteration_requests", "_count", phase)] += 1
            values[("vllm:iteration_requests", "_sum", phase)] += len(rows)
            values[("vllm:iteration_tokens_by_phase", "_count", phase)] += 1
            values[("vllm:iteration_tokens_by_phase", "_sum", phase)] += sum(rows)
    return values


def step(index: int, rows: dict[str, list[Any]]) -> StepEvent:
    prefill = sum(n for n, kind in rows.values() if kind == "prefill")
    decode = sum(n for n, kind in rows.values() if kind == "decode")
    return StepEvent(index=index, scheduled=rows, num_prefill_tokens=prefill, num_decode_tokens=decode)


def test_hand_built_steps_record_their_phases() -> None:
    metrics = PrometheusMetrics(CollectorRegistry(), "m")
    steps = [
        step(0, {"a": [100, "prefill"], "b": [28, "prefill"]}),  # prefill only
        step(1, {"a": [1, "decode"], "b": [1, "decode"]}),  # decode only
        step(2, {"a": [1, "decode"], "b": [1, "decode"], "c": [60, "prefill"]}),  # mixed: both
        step(3, {}),  # nothing ran the model: not recorded
    ]
    for event in steps:
        metrics(event)
    got = scraped(metrics.render().decode())
    assert got == expected(steps)
    assert got[("vllm:iteration_requests", "_count", "prefill")] == 2
    assert got[("vllm:iteration_requests", "_sum", "prefill")] == 3
    assert got[("vllm:iteration_tokens_by_phase", "_sum", "prefill")] == 188
    assert got[("vllm:iteration_requests", "_count", "decode")] == 2
    assert got[("vllm:iteration_requests", "_sum", "decode")] == 4
    assert got[("vllm:iteration_tokens_by_phase", "_sum", "decode")] == 4
    reg = metrics.registry
    labels = {"model_name": "m", "engine": "0", "phase": "prefill"}
    # prefill requests per step 2 and 1; tokens 128 and 60: vllm:iteration_tokens_total's buckets
    assert reg.get_sample_value("vllm:iteration_requests_bucket", {**labels, "le": "1.0"}) == 1
    assert reg.get_sample_value("vllm:iteration_requests_bucket", {**labels, "le": "8.0"}) == 2
    assert reg.get_sample_value("vllm:iteration_tokens_by_phase_bucket", {**labels, "le": "64.0"}) == 1
    assert reg.get_sample_value("vllm:iteration_tokens_by_phase_bucket", {**labels, "le": "128.0"}) == 2
    text = metrics.render().decode()
    les = [s.labels["le"] for f in text_string_to_metric_families(text) if f.name == "vllm:iteration_requests"
           for s in f.samples if s.name.endswith("_bucket") and s.labels["phase"] == "decode"]
    assert les == [str(float(b)) for b in ITERATION_TOKENS_BUCKETS] + ["+Inf"]


def test_a_scheduler_run_matches_its_step_events() -> None:
    metrics = PrometheusMetrics(CollectorRegistry(), "m", max_model_len=512)
    steps: list[StepEvent] = []
    bus = EventBus(clock=lambda: 0.0)
    bus.subscribe(metrics)
    bus.subscribe(lambda e: steps.append(e) if isinstance(e, StepEvent) else None)
    requests = [DriverRequest(f"r{i}", [i * 1000 + k for k in range(40 + 30 * i)], 6, arrival_step=2 * i)
                for i in range(5)]
    config = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_model_len=512,
                             max_num_batched_tokens=48)
    assert run_driver(requests, config, bus=bus).completed
    got = scraped(metrics.render().decode())
    assert got == expected(steps)
    phases = [{row[1] for row in s.scheduled.values()} for s in steps]
    assert {"prefill", "decode"} in phases and {"decode"} in phases and {"prefill"} in phases
    # every model step is in exactly one phase count or both; the phase token sums add to the total
    total = metrics.registry.get_sample_value("vllm:iteration_tokens_total_sum", {"model_name": "m", "engine": "0"})
    assert got[("vllm:iteration_tokens_by_phase", "_sum", "prefill")] + \
        got[("vllm:iteration_tokens_by_phase", "_sum", "decode")] == total
