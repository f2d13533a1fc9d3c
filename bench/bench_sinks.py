"""Per-event cost of each event sink, printed (not asserted).

Records the events of two model-free driver runs once, then replays them into
each sink alone, timing direct calls (the bus fan-out itself is not included):

- ``decode-256``: 256 requests decoding together (step events with 256 entries,
  the worst case for per-request folding);
- ``seed-60``: the background's 60-request workload on a pool small enough to
  preempt.

Sinks: a no-op baseline, :class:`engine.events.exporters.metrics.PrometheusMetrics` (``metrics``:
as a recording without ``engine.config`` feeds it; ``metrics-all``: sized by a
llama-3.1-8b ``engine.config`` and phase C, so the MFU counters move, and with
``kv_cache_metrics``, so every block's residency is folded),
:class:`engine.events.exporters.stats.StatsReporter` (10 s interval on a bus nobody else hears),
:class:`engine.events.JsonlSink` into memory, for comparison,
:class:`engine.events.exporters.otel.OtlpTraceSink` (the SDK's span building and batch
processor; the exporter discards, so no network is timed),
:class:`engine.events.exporters.perfetto.PerfettoTrace` (the fold; the file is written once at
the end, not timed) and :class:`engine.events.folds.request_record.RequestFold`
(every request's life, as the server keeps it for /debug/requests and per-request
metrics). Output: one JSON line per (trace, sink) with events/s, ns per
event, µs per step event (the whole stream's time minus the time of the stream
without step events) and the whole stream's µs per generated token; then, per
exporter (and the KV cache events sink, :class:`engine.events.exporters.kv_publisher.KVEventsSink`,
with block contents recorded), the driver's steps/s with it subscribed and without, in ``--pairs``
interleaved runs of seed-60 (order alternating; process CPU time, so other load on
a shared machine does not count), the median of the pairs' ratios and best against best.
Last (``--engine-pairs``, 0 to skip): the issue's real goal, every sink on together
(JSONL, metrics-all, stats, OTLP, Perfetto, KV cache events on a PUB socket) against all
off on the real engine (the bundled model, 16 requests decoding 64 tokens), interleaved,
at each of ``--engine-threads``, with the cost bound of :func:`engine_pairs`.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry

from engine.budget.memory import bytes_per_kv_token, weights_bytes
from engine.core.scheduler import SchedulerConfig
from engine.events import (
    EngineConfigEvent,
    Event,
    EventBus,
    JsonlSink,
    RequestFinished,
    StartupPhase,
    StepEvent,
)
from engine.events.exporters.metrics import PrometheusMetrics
from engine.events.exporters.perfetto import PerfettoTrace
from engine.events.exporters.stats import StatsReporter
from engine.events.folds.request_record import RequestFold
from engine.events.phase_data import LoadWeightsData
from engine.modelspec.presets import MODEL_PRESETS
from engine.sim.driver import DriverRequest, background_workload, run_driver

Sink = Callable[[Event], None]


def record(requests: list[DriverRequest], config: SchedulerConfig, step_time_s: float) -> list[Event]:
    events: list[Event] = []
    now = {"t": 0.0}
    bus = EventBus(clock=lambda: now["t"])
    bus.subscribe(events.append)

    def advance(_sched: object, _out: object) -> None:
        now["t"] += step_time_s

    run_driver(requests, config, bus=bus, on_step=advance)
    return events


def traces() -> dict[str, list[Event]]:
    decode = [DriverRequest(f"d{i}", [1 + i % 97] * 32, output_tokens=200) for i in range(256)]
    return {
        "decode-256": record(decode, SchedulerConfig(num_blocks=8192, max_num_seqs=256), step_time_s=0.05),
        "seed-60": record(
            background_workload(60, (500, 3000), (150, 400)),
            SchedulerConfig(num_blocks=2000, max_num_seqs=64, max_num_batched_tokens=4096),
            step_time_s=0.05,
        ),
    }


def _noop(_event: Event) -> None:
    return None


def _otlp_sink() -> Sink:
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from engine.events.exporters.otel import OtlpTraceSink

    class Discard(SpanExporter):
        def export(self, spans: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    return OtlpTraceSink(Discard(), wall_start_unix=time.time())


def _metrics_all() -> Sink:
    """Every family of issue 18 part 4 live: the MFU roofline sized as a real startup
    sizes it, and the block residency fold on."""
    metrics = PrometheusMetrics(CollectorRegistry(), "bench", max_model_len=4096, kv_cache_metrics=True)
    model = MODEL_PRESETS["llama-3.1-8b"]
    metrics(EngineConfigEvent(config={"tensor_parallel_size": 1},
                              model={**model.summary(), "bytes_per_kv_token": bytes_per_kv_token(model)}))
    metrics(StartupPhase(phase="C", name="load_weights", status="end",
                         data=LoadWeightsData(weights_bytes=weights_bytes(model)).to_dict()))
    assert metrics.mfu.roofline is not None
    return metrics


def sink_factories() -> dict[str, Callable[[], Sink]]:
    return {
        "none": lambda: _noop,
        "metrics": lambda: PrometheusMetrics(CollectorRegistry(), "bench", max_model_len=4096),
        "metrics-all": _metrics_all,
        "stats": lambda: StatsReporter(EventBus(), 10.0, log=None),
        "jsonl": lambda: JsonlSink(io.StringIO()),
        "otlp": _otlp_sink,
        "perfetto": PerfettoTrace,
        "lifecycle": RequestFold,
    }


# the sinks of issue 18 parts 2-4 and issue 33's lifecycle fold, measured on the step loop too
EXPORTERS = ("otlp", "perfetto", "metrics-all", "lifecycle")


def _kv_events_sink() -> Sink:
    """vLLM's KV cache events on a loopback PUB socket nobody subscribes to: the fold,
    the queue and the publisher thread's encoding and sends (ZMQ drops them unread)."""
    from engine.events.exporters.kv_events_config import KVEventsConfig
    from engine.events.exporters.kv_publisher import KVEventsSink

    return KVEventsSink(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*"))


def steps_per_s_interleaved(make: Callable[[], Sink], pairs: int, kv_cache_events: bool = False) -> dict[str, object]:
    """The driver's steps/s on seed-60 without and with ``make()``'s sink on its bus,
    ``pairs`` times, alternating which runs first so drift hits both sides.
    ``kv_cache_events``: the runs with the sink also record block contents in the step
    events (vLLM's enable_kv_cache_events), part of what that sink costs."""
    requests = background_workload(60, (500, 3000), (150, 400))
    config = SchedulerConfig(num_blocks=2000, max_num_seqs=64, max_num_batched_tokens=4096)

    def run(with_sink: bool) -> float:
        bus = EventBus()
        sink = make() if with_sink else None
        if sink is not None:
            bus.subscribe(sink)
        run_config = dataclasses.replace(config, enable_kv_cache_events=True) if sink and kv_cache_events else config
        start = time.process_time()  # this process's CPU seconds: other load on the machine does not count
        result = run_driver(requests, run_config, bus=bus)
        flush = getattr(sink, "flush", None)  # a sink's own thread finishes the run's work inside the timing
        if flush is not None:
            flush()
        elapsed = time.process_time() - start
        close = getattr(sink, "close", None)
        if close is not None:
            close()
        return result.steps / elapsed

    off: list[float] = []
    on: list[float] = []
    for pair in range(pairs):
        for with_sink in ((False, True) if pair % 2 == 0 else (True, False)):
            (on if with_sink else off).append(run(with_sink))
    ratios = [b / a for a, b in zip(off, on, strict=True)]
    return {"steps_per_s_off": round(statistics.median(off)), "steps_per_s_on": round(statistics.median(on)),
            "median_ratio": round(statistics.median(ratios), 4), "best_ratio": round(max(on) / max(off), 4),
            "pairs": pairs, "clock": "process CPU time"}


def time_sink(make: Callable[[], Sink], events: list[Event], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        sink = make()
        start = time.perf_counter()
        for event in events:
            sink(event)
        best = min(best, time.perf_counter() - start)
        close = getattr(sink, "close", None)  # the OTLP sink's processor thread ends
        if close is not None:
            close()
    return best


def measure(repeats: int = 3) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for trace, events in traces().items():
        steps = [e for e in events if isinstance(e, StepEvent)]
        others = [e for e in events if not isinstance(e, StepEvent)]
        output_tokens = sum(e.output_tokens for e in events if isinstance(e, RequestFinished))
        for name, make in sink_factories().items():
            total = time_sink(make, events, repeats)
            # step cost = whole stream minus the stream without steps (state stays realistic)
            on_steps = max(0.0, total - time_sink(make, others, repeats))
            rows.append(
                {
                    "trace": trace,
                    "sink": name,
                    "events": len(events),
                    "step_events": len(steps),
                    "other_events": len(others),
                    "events_per_s": round(len(events) / total) if total > 0 else None,
                    "ns_per_event": round(total / len(events) * 1e9),
                    "us_per_step_event": round(on_steps / len(steps) * 1e6, 2),
                    "us_per_output_token": round(total / output_tokens * 1e6, 3),
                }
            )
    return rows


def _all_sinks() -> dict[str, Sink]:
    sinks = {name: make() for name, make in sink_factories().items() if name not in ("none", "metrics")}
    return {**sinks, "kv-events": _kv_events_sink()}


def _timed(sink: Sink, spent: dict[str, float], name: str) -> Sink:
    """``sink`` with the engine-thread seconds it takes added to ``spent[name]``."""
    clock = time.perf_counter

    def call(event: Event) -> None:
        start = clock()
        sink(event)
        spent[name] += clock() - start

    return call


def _thread_cpu_ns() -> dict[int, int]:
    """Each thread of this process -> its CPU nanoseconds so far (Linux schedstat: exact,
    not the 10 ms ticks of /proc/.../stat)."""
    out: dict[int, int] = {}
    with os.scandir("/proc/self/task") as tasks:
        for task in tasks:
            try:
                with open(f"{task.path}/schedstat") as f:
                    out[int(task.name)] = int(f.read().split()[0])
            except (OSError, ValueError, IndexError):  # the thread ended meanwhile
                continue
    return out


def _call_each(sinks: Iterable[Sink], method: str) -> None:
    """``method`` (flush, close) of every sink that has one."""
    for sink in sinks:
        call = getattr(sink, method, None)
        if call is not None:
            call()


def _new_threads_cpu_s(threads_before: set[int], threads_start: dict[int, int]) -> float:
    """CPU seconds of the threads started since ``threads_before`` was read (the sinks' own)."""
    return sum(ns - threads_start.get(tid, 0) for tid, ns in _thread_cpu_ns().items()
               if tid not in threads_before) / 1e9


class EngineSinkRuns:
    """One warmed real engine generating the same prompts again and again, with every sink
    subscribed or none; the runs with sinks record what the sinks cost (``spent_on``: each
    sink's share of the run, ``bounds``: the step loop's speed had all of it been taken)."""

    def __init__(self, threads: int, requests: int, output_len: int) -> None:
        from engine.core.sampling_params import SamplingParams
        from engine.events.exporters.kv_events_config import KVEventsConfig
        from engine.llm import LLM

        self.llm = LLM(threads=threads, stats_interval=0.0, kv_cache_memory_bytes=1 << 28, max_model_len=1024,
                       kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
        self.prompts = [" ".join(f"word{i}-{j}" for j in range(24)) for i in range(requests)]
        self.params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        # warm: one-off allocations, and the prompts' blocks cached as in every run after
        self.llm.generate(self.prompts, self.params)
        self.spent_on: dict[str, list[float]] = {}
        self.bounds: list[float] = []

    def run(self, with_sinks: bool) -> tuple[float, float]:
        """One generate: steps per wall second and per process CPU second."""
        steps = [0]

        def count(event: Event) -> None:
            if isinstance(event, StepEvent):
                steps[0] += 1

        bus = self.llm.engine.bus
        threads_before = set(_thread_cpu_ns())
        named = _all_sinks() if with_sinks else {}
        spent = dict.fromkeys(named, 0.0)
        subscribed = [_timed(sink, spent, name) for name, sink in named.items()] + [count]
        for sink in subscribed:
            bus.subscribe(sink)
        threads_start = _thread_cpu_ns()
        wall, cpu = time.perf_counter(), time.process_time()
        self.llm.generate(self.prompts, self.params)
        _call_each(named.values(), "flush")  # a sink's own thread finishes the run's work inside the timing
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        sink_threads_s = _new_threads_cpu_s(threads_before, threads_start)
        for sink in subscribed:
            bus.unsubscribe(sink)
        _call_each(named.values(), "close")
        self._record_cost(spent, sink_threads_s if with_sinks else None, wall)
        return steps[0] / wall, steps[0] / cpu

    def _record_cost(self, spent: dict[str, float], sink_threads_s: float | None, wall: float) -> None:
        for name, seconds in spent.items():
            self.spent_on.setdefault(name, []).append(seconds / wall)
        if sink_threads_s is not None:
            self.spent_on.setdefault("sink threads", []).append(sink_threads_s / wall)
            self.bounds.append(1.0 - (sum(spent.values()) + sink_threads_s) / wall)


def engine_pairs(pairs: int, threads: int = 2, requests: int = 16, output_len: int = 64) -> dict[str, object]:
    """The real engine's steps/s with every sink subscribed and with none, ``pairs``
    times, alternating which runs first. Block contents are recorded in both (vLLM's
    enable_kv_cache_events, with no publisher of the engine's own), so a pair differs
    only by the sinks.

    Three readings of the same runs: steps per wall second (what a user sees), steps per
    process CPU second (every thread of the process, the sinks' own publisher and exporter
    threads included) and, in the runs with sinks, what the sinks themselves cost: the
    engine-thread seconds inside each sink plus the CPU seconds of the threads the sinks
    started (the OTLP batch processor, the KV events publisher, ZMQ's I/O threads).
    ``cost_bounds``: per run with sinks, one minus those seconds over the run's wall time,
    the step loop's speed if every one of them had been taken from it. On a shared 2-core
    machine both on/off ratios move with the machine's speed, by up to 15 % from one run
    to the next at either thread count, far more than the effect; the bound does not."""
    runs = EngineSinkRuns(threads, requests, output_len)
    off: list[tuple[float, float]] = []
    on: list[tuple[float, float]] = []
    for pair in range(pairs):
        for with_sinks in ((False, True) if pair % 2 == 0 else (True, False)):
            (on if with_sinks else off).append(runs.run(with_sinks))
    wall_ratios = [b[0] / a[0] for a, b in zip(off, on, strict=True)]
    cpu_ratios = [b[1] / a[1] for a, b in zip(off, on, strict=True)]
    share = {name: statistics.median(values) for name, values in runs.spent_on.items()}
    bounds = runs.bounds
    return {"threads": threads, "requests": requests, "output_len": output_len, "pairs": pairs,
            "steps_per_wall_s_off": round(statistics.median(a for a, _ in off), 2),
            "steps_per_wall_s_on": round(statistics.median(b for b, _ in on), 2),
            "wall_ratios": [round(r, 4) for r in wall_ratios], "wall_median_ratio": round(statistics.median(wall_ratios), 4),
            "cpu_ratios": [round(r, 4) for r in cpu_ratios], "cpu_median_ratio": round(statistics.median(cpu_ratios), 4),
            "share_of_run_in_sinks": {name: round(v, 5) for name, v in share.items()},
            "cost_bounds": [round(b, 4) for b in bounds], "cost_bound_min": round(min(bounds), 4),
            "goal": ">= 0.99"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=5, help="interleaved with/without runs per exporter")
    parser.add_argument("--engine-pairs", type=int, default=7, help="all sinks on/off pairs on the real engine")
    parser.add_argument("--engine-threads", type=int, nargs="+", default=[1, 2],
                        help="torch threads of the real-engine pairs, one series per value")
    args = parser.parse_args(argv)
    for row in measure(args.repeats):
        print(json.dumps(row))
    for name in EXPORTERS:
        print(json.dumps({"trace": "seed-60", "sink": name, **steps_per_s_interleaved(sink_factories()[name],
                                                                                  args.pairs)}))
    # not in the per-event table: its facts exist only in runs that record block contents
    print(json.dumps({"trace": "seed-60", "sink": "kv-events",
                      **steps_per_s_interleaved(_kv_events_sink, args.pairs, kv_cache_events=True)}))
    if args.engine_pairs:
        for threads in args.engine_threads:
            print(json.dumps({"trace": "engine 16x64 tokens", "sink": "all on vs all off",
                              **engine_pairs(args.engine_pairs, threads=threads)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
