"""One model-free run under KV pressure, folded into the Prometheus families, for the
tests of vLLM's newest metrics and of the Grafana dashboard (which takes the names
/metrics serves from it).

The real scheduler with the driver's fixed-token executor, the priority policy and a
18-block pool: two waves of requests, each wave sharing a 2-block prefix, with
mixed priorities, so the run preempts for both reasons (kv_full and priority), hits
the prefix cache, and evicts the first wave's cached blocks for the second's. The
bus clock is the scheduler's step count times STEP_S, so every time is exact.
The run starts as the engine does: ``engine.config`` (a preset's model summary)
and phase C's weights, which size the MFU estimates.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from engine.budget.memory import bytes_per_kv_token, weights_bytes
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.events import EngineConfigEvent, Event, EventBus, StartupPhase
from engine.events.exporters.iteration_details import IterationDetailsLog
from engine.events.exporters.metrics import PrometheusMetrics
from engine.events.phase_data import LoadWeightsData
from engine.modelspec.presets import MODEL_PRESETS
from engine.sim.driver import DriverRequest, run_driver

MODEL = "llama-3.1-8b"
SERVED_NAME = "kvscope-test"
STEP_S = 0.05
BLOCK_SIZE = 16
NUM_BLOCKS = 18


@dataclass(frozen=True)
class PreemptingRun:
    metrics: PrometheusMetrics  # with --kv-cache-metrics
    events: list[Event]
    iteration_lines: list[str]
    weights_bytes: int
    bytes_per_kv_token: int
    num_parameters: int


def requests() -> list[DriverRequest]:
    first, second = list(range(1000, 1032)), list(range(2000, 2032))  # two 2-block prefixes
    requests = []
    for i in range(10):
        prefix = first if i < 5 else second
        requests.append(DriverRequest(f"r{i}", prefix + [i] * (9 + 5 * (i % 3)), output_tokens=60 + 8 * (i % 4),
                                      arrival_step=i % 5 + (100 if i >= 5 else 0), priority=(i * 7) % 3))
    return requests


CONFIG = SchedulerConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=6, max_num_batched_tokens=64,
                         max_model_len=1024, policy="priority")


def new_scheduler() -> Scheduler:
    """The run's scheduler on a bus whose clock is its step count times STEP_S (a step
    event's ``t`` is the end of its step: the count has already moved on)."""
    holder: list[Scheduler] = []
    scheduler = Scheduler(CONFIG, EventBus(clock=lambda: holder[0].step_index * STEP_S if holder else 0.0))
    holder.append(scheduler)
    return scheduler


@functools.cache
def preempting_run() -> PreemptingRun:
    model = MODEL_PRESETS[MODEL]
    weights, kv_bytes = weights_bytes(model, "bfloat16"), bytes_per_kv_token(model, "auto", model_dtype="bfloat16")
    scheduler = new_scheduler()
    bus = scheduler.bus
    assert bus is not None
    metrics = PrometheusMetrics(CollectorRegistry(), SERVED_NAME, kv_cache_metrics=True)
    events: list[Event] = []
    lines: list[str] = []
    for subscriber in (metrics, events.append, IterationDetailsLog(lines.append)):
        bus.subscribe(subscriber)
    summary = {**model.summary(), "bytes_per_kv_token": kv_bytes}
    bus.publish(EngineConfigEvent(config={"tensor_parallel_size": 1, "block_size": BLOCK_SIZE,
                                          "max_model_len": 1024, "enable_prefix_caching": True,
                                          "scheduling_policy": "priority"}, model=summary))
    bus.publish(StartupPhase(phase="C", name="load_weights", status="end", duration_s=0.0,
                             data=LoadWeightsData(weights_bytes=weights).to_dict()))
    result = run_driver(requests(), CONFIG, scheduler=scheduler, step_time_s=STEP_S)
    assert result.completed
    return PreemptingRun(metrics, events, lines, weights, kv_bytes, model.num_parameters)
