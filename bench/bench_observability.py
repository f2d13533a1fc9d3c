"""The price of observability: decode tok/s and ITL p99 of the real engine with each
signal family on and off, in interleaved pairs, in one run.

The engine is the bundled SmolLM2-135M (``--dtype auto``), 16 requests of 32 fresh random
prompt tokens decoding 64 tokens each (``--requests``, ``--prompt-len``, ``--output-len``).
Each family is what the server or a flag subscribes to the engine's bus, built as they
build it and fed the startup's events first (so Prometheus's MFU counters move):

- ``jsonl``: the ``--events`` recording into a file;
- ``events-sse``: ``/events``: the view fold (``/debug/state``, the stream's snapshot) and
  the hub, with one client draining its queue on an event loop of its own;
- ``prometheus``: ``/metrics``'s families, their token usage read from the run's view, as the
  server reads it (alone, the family folds that view; with ``events-sse``, whichever sees an
  event first folds it); ``prometheus+residency``: with ``--kv-cache-metrics``,
  every block's residency (vLLM samples 1 %);
- ``kv-events``: ``--kv-events-config``: block contents recorded by the scheduler, folded and
  published on a loopback PUB socket nobody reads;
- ``otlp``: ``--otlp-traces-endpoint``: spans exported over OTLP/HTTP to a receiver in this
  process that answers 200 (with ``perfetto``, ``forward-pass`` and ``per-request``, one request
  fold for the four, the server's ``/debug/requests`` fold, as ``engine serve`` shares it);
- ``perfetto``: ``--trace-out`` (the file is written when the run ends, outside the timing);
- ``forward-pass``: ``--forward-pass-metrics-port``;
- ``per-request``: the request lifecycle fold behind ``/debug/requests`` and per-request metrics;
- ``all``: every family at once; ``all off`` has no subscriber at all.

Each pair runs the family off and on (order alternating). Two clocks: wall seconds, and the
process's CPU seconds (every thread: the engine's, torch's and the sinks' own), which other
load on a shared machine does not inflate; the verdict reads the CPU clock. Beside them,
what the family's sinks cost directly: engine-thread microseconds inside them per step plus
the CPU of the threads they started. Targets: all on costs <= 1 % of decode tok/s and
<= 2 % of ITL p99.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.bench_sinks import _thread_cpu_ns
from bench.machine import cpu_isa, header_lines, load_average
from bench.workloads import percentile
from engine.events.deferred_delivery import DEFERRED_THREAD
from engine.events.exporters.observers import delivered_deferred

# torch's OpenMP threads sleep at their barriers rather than spin: a spinning thread's CPU
# seconds grow with every preemption on a shared machine (pairs read 0.2-7x apart), a
# sleeping one's do not. Set before torch loads (this module imports it only in main).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
TOK_PER_S_GOAL = 0.99  # all on / all off, decode tok/s
ITL_P99_GOAL = 1.02  # all on / all off, ITL p99
COST_GOAL = 0.01  # the sinks' own CPU per step, as a share of an all-off decode step's CPU
Sink = Callable[[Any], None]


# ---------------------------------------------------------------------- the families
@dataclass(slots=True)
class Signal:
    """One family's sinks, subscribed for a run and closed after it."""

    sinks: dict[str, Sink]
    closers: list[Callable[[], None]] = field(default_factory=list)
    # what finishes the run's work on the sinks' own threads, inside the timing
    flushers: list[Callable[[], Any]] = field(default_factory=list)
    record_contents: bool = False  # the scheduler records block contents (KV cache events)

    def close(self) -> None:
        for close in self.closers:
            close()


class Context:
    """What the families build from: the engine, its startup's events, a folder, the OTLP receiver."""

    def __init__(self, llm: Any, startup_events: list[Any], folder: Path) -> None:
        self.llm = llm
        self.startup_events = startup_events
        self.folder = folder
        self._otlp: subprocess.Popen[str] | None = None
        self._otlp_port = 0
        self.runs = 0
        self._shared: dict[str, tuple[int, Any]] = {}

    def view(self) -> Any:
        """The run's ``/debug/state`` view: the server's metrics fold their token usage through it."""
        from engine.serve.shared_folds import LockedView

        return self._run_shared("view", LockedView)

    def lifecycle(self) -> Any:
        """The run's ``/debug/requests`` fold: the server's OTLP and Perfetto exporters read it."""
        from engine.serve.shared_folds import LockedLifecycle

        return self._run_shared("lifecycle", LockedLifecycle)

    def _run_shared(self, name: str, make: Callable[[], Any]) -> Any:
        run, fold = self._shared.get(name, (0, None))
        if run != self.runs:
            run, fold = self._shared[name] = (self.runs, make())
        return fold

    def otlp_url(self) -> str:
        """A receiver in a process of its own, as a collector is: its CPU is not the engine's."""
        if self._otlp is None:
            self._otlp = subprocess.Popen([sys.executable, "-c", _RECEIVER], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True)
            assert self._otlp.stdout is not None
            self._otlp_port = int(self._otlp.stdout.readline())
        return f"http://127.0.0.1:{self._otlp_port}/v1/traces"

    def close(self) -> None:
        if self._otlp is not None:
            self._otlp.kill()
            self._otlp.wait()


# An OTLP/HTTP receiver that reads each export and answers 200; prints its port. It exits when its
# stdin closes, so a bench killed before close() leaves no receiver behind.
_RECEIVER = """
import os, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
class Accept(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = ThreadingHTTPServer(("127.0.0.1", 0), Accept)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def _jsonl(ctx: Context) -> Signal:
    from engine.events import JsonlSink

    sink = JsonlSink(ctx.folder / f"run{ctx.runs}.jsonl")
    return Signal({"jsonl": sink}, [sink.close])


def _events_sse(ctx: Context) -> Signal:
    from engine.serve.host import EventHub

    hub, view, loop = EventHub(), ctx.view(), asyncio.new_event_loop()
    client = hub.connect(loop)

    async def drain() -> None:
        while await client.next_batch() is not None:
            pass

    thread = threading.Thread(target=loop.run_until_complete, args=(drain(),), daemon=True)
    thread.start()

    def close() -> None:
        hub.disconnect(client)
        client.post(None)
        thread.join(10)
        loop.close()

    return Signal({"view": view, "hub": hub}, [close])


def _prometheus(residency: bool) -> Callable[[Context], Signal]:
    def build(ctx: Context) -> Signal:
        from prometheus_client import CollectorRegistry

        from engine.events.exporters.metrics import PrometheusMetrics

        metrics = PrometheusMetrics(CollectorRegistry(), "smollm2", max_model_len=ctx.llm.engine.config.max_model_len,
                                    kv_cache_metrics=residency, shared_view=ctx.view())
        return Signal({"metrics": metrics})

    return build


def _kv_events(ctx: Context) -> Signal:
    from engine.events.exporters.kv_events_config import KVEventsConfig
    from engine.events.exporters.kv_publisher import KVEventsSink

    sink = KVEventsSink(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*"))
    return Signal({"kv-events": sink}, [sink.close], [sink.flush], record_contents=True)


def _otlp(ctx: Context) -> Signal:
    from engine.events.exporters.otel import OtlpTraceSink, span_exporter

    sink = OtlpTraceSink(span_exporter(ctx.otlp_url(), "http/protobuf"), wall_start_unix=time.time(),
                         shared_requests=ctx.lifecycle())
    return Signal({"otlp": sink}, [sink.close], [sink.provider.force_flush])  # the run's spans exported


def _perfetto(ctx: Context) -> Signal:
    from engine.events.exporters.perfetto import PerfettoTrace

    sink = PerfettoTrace(ctx.folder / f"run{ctx.runs}.trace.json", ctx.lifecycle())
    return Signal({"perfetto": sink}, [sink.close])


def _forward_pass(ctx: Context) -> Signal:
    from bench.bench_server import free_port
    from engine.events.exporters.forward_pass import ForwardPassPublisher

    sink = ForwardPassPublisher(free_port(), shared_requests=ctx.lifecycle())
    return Signal({"forward-pass": sink}, [sink.close])


def _per_request(ctx: Context) -> Signal:
    return Signal({"per-request": ctx.lifecycle()})


FAMILIES: dict[str, Callable[[Context], Signal]] = {
    "jsonl": _jsonl, "events-sse": _events_sse, "prometheus": _prometheus(False),
    "prometheus+residency": _prometheus(True), "kv-events": _kv_events, "otlp": _otlp, "perfetto": _perfetto,
    "forward-pass": _forward_pass, "per-request": _per_request,
}
ALL_FAMILIES = ("jsonl", "events-sse", "prometheus+residency", "kv-events", "otlp", "perfetto", "forward-pass",
                "per-request")  # prometheus+residency holds prometheus


def _all(ctx: Context) -> Signal:
    signals = [FAMILIES[name](ctx) for name in ALL_FAMILIES]
    return Signal({f"{n}/{k}": s for n, sig in zip(ALL_FAMILIES, signals, strict=True) for k, s in sig.sinks.items()},
                  [c for sig in signals for c in sig.closers], [f for sig in signals for f in sig.flushers],
                  any(sig.record_contents for sig in signals))


# ---------------------------------------------------------------------- one run
def _timed(sinks: list[Sink], spent: dict[str, float], name: str, on_flusher: list[float]) -> Sink:
    """``sinks`` called in order with each event, the CPU seconds of the thread that delivers
    inside them added to ``spent[name]``, and also to ``on_flusher[0]`` when that thread is the
    bus's flusher (whose whole CPU the run counts with the sinks' threads) (CPU, not wall: a
    preemption by another process while inside would be charged to the sinks). One clock read
    around them all: a CPU-clock read is a system call (~0.9 µs on Zen 4), and one pair per sink
    per event was ~10 % of what all signals cost."""
    clock = time.thread_time

    def call(event: Any) -> None:
        start = clock()
        for sink in sinks:
            sink(event)
        took = clock() - start
        spent[name] += took
        if threading.current_thread().name == DEFERRED_THREAD:
            on_flusher[0] += took

    return call


def _delivery_groups(sinks: dict[str, Sink]) -> dict[str, tuple[list[Sink], bool]]:
    """The family's sinks as the server subscribes them: the recording as events are published,
    the others deferred (in batches at most 0.05 s late: engine/events/deferred_delivery.py), each
    kind as one timed group named by its sinks -> (its sinks, deferred)."""
    groups: dict[str, tuple[list[Sink], bool]] = {}
    for deferred in (False, True):
        members = {name: sink for name, sink in sinks.items() if delivered_deferred(sink) == deferred}
        if members:
            groups["+".join(members)] = (list(members.values()), deferred)
    return groups


@dataclass(slots=True)
class Run:
    decode_tokens: int = 0
    decode_wall_s: float = 0.0
    decode_cpu_s: float = 0.0
    itl_wall_s: list[float] = field(default_factory=list)
    itl_cpu_s: list[float] = field(default_factory=list)
    in_sinks_s: float = 0.0  # engine-thread seconds inside the family's sinks
    sink_threads_s: float = 0.0  # CPU seconds of the threads the family's sinks started
    by_sink: dict[str, float] = field(default_factory=dict)  # engine-thread seconds per delivery group
    steps: int = 0
    decode_steps: int = 0

    def tok_per_s(self, clock: str) -> float:
        return self.decode_tokens / (self.decode_cpu_s if clock == "cpu" else self.decode_wall_s)

    def itl_p99(self, clock: str) -> float:
        return percentile(self.itl_cpu_s if clock == "cpu" else self.itl_wall_s, 99)


def _record_contents(llm: Any, on: bool) -> None:
    """vLLM's enable_kv_cache_events on the live scheduler: the step events say what each
    cached block holds (the KV events family's cost at the source)."""
    manager = llm.engine.scheduler.kv
    manager.record_block_contents = manager.pool.record_contents = on
    deltas = manager.pool.deltas  # the record in progress (between runs: only frees) takes contents too
    deltas.stored, deltas.evicted_hashes = ([], []) if on else (None, None)


@dataclass(slots=True)
class Cost:
    """What a subscribed family's sinks took, known when it is unsubscribed."""

    in_sinks_s: float = 0.0  # engine-thread seconds inside the sinks
    sink_threads_s: float = 0.0  # CPU seconds of the threads the sinks started
    by_sink: dict[str, float] = field(default_factory=dict)


@contextlib.contextmanager
def subscribed(ctx: Context, family: str | None) -> Iterator[Cost]:
    """``family``'s sinks (None: none; "all": every family) on the engine's bus for the
    block; after it, their threads' work flushed and the sinks closed."""
    ctx.runs += 1
    threads_before = set(_thread_cpu_ns())
    signal = (_all(ctx) if family == "all" else FAMILIES[family](ctx)) if family else Signal({})
    for event in ctx.startup_events:  # as sinks subscribed before startup saw them, in the bus's order
        for sink in signal.sinks.values():
            sink(event)
    groups = _delivery_groups(signal.sinks)
    bus, spent, cost, on_flusher = ctx.llm.engine.bus, dict.fromkeys(groups, 0.0), Cost(), [0.0]
    subscribers = [bus.subscribe(_timed(sinks, spent, name, on_flusher), deferred=deferred)
                   for name, (sinks, deferred) in groups.items()]
    _record_contents(ctx.llm, signal.record_contents)
    # the bus's flusher thread (started by a deferred subscription) counts with the sinks' threads:
    # its deliveries are in ``spent`` already, its waiting and waking are not
    threads_start = _thread_cpu_ns()
    try:
        yield cost
        for flush in signal.flushers:
            flush()
        cost.sink_threads_s = sum(ns - threads_start.get(tid, 0) for tid, ns in _thread_cpu_ns().items()
                                  if tid not in threads_before) / 1e9 - on_flusher[0]
        cost.in_sinks_s = sum(spent.values())
        cost.by_sink = dict(spent)
    finally:
        for subscriber in subscribers:
            bus.unsubscribe(subscriber)
        _record_contents(ctx.llm, False)
        signal.close()


def run_once(ctx: Context, family: str | None, requests: int, prompt_len: int, output_len: int) -> Run:
    """One workload with ``family``'s sinks subscribed (None: all off); fresh prompts each run,
    so no run finds another's blocks cached."""
    with subscribed(ctx, family) as cost:
        run = _decode(ctx.llm.engine, random.Random(ctx.runs), requests, prompt_len, output_len)
    run.in_sinks_s, run.sink_threads_s, run.by_sink = cost.in_sinks_s, cost.sink_threads_s, cost.by_sink
    return run


def _decode(engine: Any, rng: random.Random, requests: int, prompt_len: int, output_len: int) -> Run:
    """The workload stepped through, each step timed on both clocks."""
    from engine.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for _ in range(requests):
        engine.add_request([rng.randrange(1000, 40000) for _ in range(prompt_len)], params)
    run = Run()
    last: dict[str, tuple[float, float]] = {}  # request id -> (wall, CPU) at its latest token
    wall, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        outs = engine.step()
        now_wall, now_cpu = time.perf_counter(), time.process_time()
        run.steps += 1
        if len(last) == requests:  # every request has its first token: a decode step
            run.decode_tokens += sum(len(o.new_token_ids) for o in outs)
            run.decode_steps += 1
            run.decode_wall_s += now_wall - wall
            run.decode_cpu_s += now_cpu - cpu
        for out in outs:
            if out.new_token_ids and out.request_id in last:
                then_wall, then_cpu = last[out.request_id]
                run.itl_wall_s.append((now_wall - then_wall) / len(out.new_token_ids))
                run.itl_cpu_s.append((now_cpu - then_cpu) / len(out.new_token_ids))
            if out.new_token_ids:
                last[out.request_id] = (now_wall, now_cpu)
        wall, cpu = now_wall, now_cpu
    return run


# ---------------------------------------------------------------------- pairs and report
@dataclass(slots=True)
class Pairs:
    family: str
    off: list[Run] = field(default_factory=list)
    on: list[Run] = field(default_factory=list)

    def ratios(self, what: str, clock: str) -> list[float]:
        key: Callable[[Run], float] = (lambda r: r.tok_per_s(clock)) if what == "tok/s" else (lambda r: r.itl_p99(clock))
        return [key(b) / key(a) for a, b in zip(self.off, self.on, strict=True)]

    def median(self, what: str, clock: str) -> float:
        return statistics.median(self.ratios(what, clock))

    def by_sink_us_per_step(self) -> dict[str, float]:
        """Engine-thread µs per step inside each sink, and in the sinks' threads (median run)."""
        names = {name for r in self.on for name in r.by_sink}
        out = {name: statistics.median(r.by_sink.get(name, 0.0) / r.steps for r in self.on) * 1e6 for name in names}
        return {**out, "sink threads": statistics.median(r.sink_threads_s / r.steps for r in self.on) * 1e6}

    def cost_share(self) -> float:
        """The sinks' own cost per step over an all-off decode step's CPU: the floor under the
        tok/s ratio that a shared machine's noise does not move."""
        step_us = statistics.median(r.decode_cpu_s / r.decode_steps for r in self.off if r.decode_steps) * 1e6
        return self.cost_us_per_step() / step_us

    def cost_us_per_step(self) -> float:
        """The sinks' own cost: engine-thread time inside them plus their threads' CPU, per step."""
        return statistics.median((r.in_sinks_s + r.sink_threads_s) / r.steps for r in self.on) * 1e6


def measure(ctx: Context, families: list[str], pairs: int, all_pairs: int, **workload: int) -> list[Pairs]:
    results = [Pairs(f) for f in families]
    for pair in range(max(pairs, all_pairs)):
        for p in results:
            if pair >= (all_pairs if p.family == "all" else pairs):
                continue
            for on in ((False, True) if pair % 2 == 0 else (True, False)):
                run = run_once(ctx, p.family if on else None, **workload)
                (p.on if on else p.off).append(run)
            print(f"pair {pair} {p.family}: on/off tok/s (CPU) {p.ratios('tok/s', 'cpu')[-1]:.4f}", flush=True)
    return results


def table(results: list[Pairs]) -> list[str]:
    lines = ["| family | decode tok/s off / on (CPU) | on/off tok/s, CPU: median (per pair) | on/off tok/s, wall | "
             "ITL p99 ms off / on (CPU) | on/off ITL p99, CPU | on/off ITL p99, wall | sinks' own cost µs/step |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for p in results:
        off_tps = statistics.median(r.tok_per_s("cpu") for r in p.off)
        on_tps = statistics.median(r.tok_per_s("cpu") for r in p.on)
        off_itl = statistics.median(r.itl_p99("cpu") for r in p.off) * 1e3
        on_itl = statistics.median(r.itl_p99("cpu") for r in p.on) * 1e3
        per_pair = ", ".join(f"{r:.3f}" for r in p.ratios("tok/s", "cpu"))
        lines.append(f"| {p.family} | {off_tps:,.1f} / {on_tps:,.1f} | {p.median('tok/s', 'cpu'):.4f} ({per_pair}) | "
                     f"{p.median('tok/s', 'wall'):.4f} | {off_itl:.2f} / {on_itl:.2f} | "
                     f"{p.median('itl', 'cpu'):.4f} | {p.median('itl', 'wall'):.4f} | {p.cost_us_per_step():,.0f} |")
    return lines


def median_interval(ratios: list[float], level: float = 0.9, resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap ``level`` interval of the median of ``ratios`` (seeded: the same run reads the
    same interval): how far the pairs' noise leaves the median from the truth."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * (resamples - 1))], medians[int((1 - tail) * (resamples - 1))]


def judged(median: float, interval: tuple[float, float], goal: float, higher: bool) -> str:
    """pass or MISS when the whole interval says so; otherwise the noise decides nothing, and
    the verdict says so beside the median's side."""
    meets = (lambda v: v >= goal) if higher else (lambda v: v <= goal)
    if meets(interval[0]) and meets(interval[1]):
        return "pass"
    if not meets(interval[0]) and not meets(interval[1]):
        return "MISS"
    return f"unresolved: the interval spans the target (the median {'passes' if meets(median) else 'misses'})"


def verdict(results: list[Pairs]) -> list[str]:
    every = next((p for p in results if p.family == "all"), None)
    lines = ["| target | measured (median of interleaved pairs, CPU clock; its 90% bootstrap interval; wall beside) "
             "| verdict |", "|---|---|---|"]
    for name, what, goal, higher in ((f"all signals on: decode tok/s >= {TOK_PER_S_GOAL}x all off", "tok/s",
                                      TOK_PER_S_GOAL, True),
                                     (f"all signals on: ITL p99 <= {ITL_P99_GOAL}x all off", "itl", ITL_P99_GOAL, False)):
        if every is None:
            lines.append(f"| {name} | n/a: the all family did not run | n/a |")
            continue
        cpu, wall = every.median(what, "cpu"), every.median(what, "wall")
        interval = median_interval(every.ratios(what, "cpu"))
        lines.append(f"| {name} | {cpu:.4f} [{interval[0]:.4f}, {interval[1]:.4f}] (wall {wall:.4f}; "
                     f"{len(every.on)} pairs) | {judged(cpu, interval, goal, higher)} |")
    if every is not None:
        share = every.cost_share()
        lines.append(f"| all signals on: the sinks' own CPU <= {COST_GOAL:.0%} of a decode step's | {share:.2%} "
                     f"({every.cost_us_per_step():,.0f} µs a step, engine thread and the sinks' threads) | "
                     f"{'pass' if share <= COST_GOAL else 'MISS'} |")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="interleaved off/on pairs per family")
    parser.add_argument("--all-pairs", type=int, default=30,
                        help="pairs of the all-on family, the verdict's (a pair scatters by about 8 percent on a "
                             "shared host; 30 pairs narrow the median's interval to about 4 points)")
    parser.add_argument("--families", default=",".join([*FAMILIES, "all"]))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", default=None, help="also write the raw numbers here")
    return parser.parse_args(argv)


def start_engine(threads: int) -> tuple[Any, list[Any]]:
    """The engine, and the events its startup published (each family is fed them first)."""
    from engine.events import EventBus
    from engine.llm import LLM

    bus, startup_events = EventBus(), list[Any]()
    # the subscriber itself, not a fresh ``startup_events.append``: the bus unsubscribes by
    # identity, and a collector left on would feed every family each earlier run's events
    collect = bus.subscribe(startup_events.append)
    llm = LLM(bus=bus, threads=threads, stats_interval=0.0, kv_cache_memory_bytes=1 << 28, max_model_len=1024,
              dtype="auto")
    bus.unsubscribe(collect)
    return llm, startup_events


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.logs import configure_logging

    configure_logging(level="warning", stream=sys.stderr)  # keep stdout the report
    print("\n".join(["## Machine", "", *header_lines(args.threads), ""]), flush=True)
    llm, startup_events = start_engine(args.threads)
    workload = {"requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len}
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Context(llm, startup_events, Path(tmp))
        try:
            run_once(ctx, None, **workload)  # first-call costs out of the numbers
            run_once(ctx, "all", **workload)
            results = measure(ctx, args.families.split(","), args.pairs, args.all_pairs, **workload)
        finally:
            ctx.close()
            llm.close()
    dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
    print("\n".join(["## The price of observability", "", f"<!-- isa: {cpu_isa()} -->", "",
                     f"SmolLM2-135M {dtype}, {args.threads} threads, {args.requests} requests x {args.prompt_len} "
                     f"prompt + {args.output_len} output tokens; {args.pairs} pairs a family ({args.all_pairs} for all); "
                     f"load average at the end {load_average()}.", "", *table(results), "",
                     "## Verdict", "", *verdict(results)]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({p.family: {"cpu_tok_ratios": p.ratios("tok/s", "cpu"),
                                                           "wall_tok_ratios": p.ratios("tok/s", "wall"),
                                                           "cpu_itl_ratios": p.ratios("itl", "cpu"),
                                                           "cost_us_per_step": p.cost_us_per_step(),
                                                           "us_per_step_by_sink": p.by_sink_us_per_step()}
                                               for p in results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
