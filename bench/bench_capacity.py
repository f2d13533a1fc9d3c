"""``engine capacity`` against the real engine on this CPU, for ``make bench``.

1. Start the bundled SmolLM2-135M once; warm it up and time one request alone.
2. Record a run (``--events``, as a user would): the bench workload's lengths (bench/workloads.py,
   batch-64's draws, ``--scale``d) at Poisson arrivals of ``--record-load`` requests per solo
   request's lifetime.
3. Predict: fit the step cost to the recording and search the highest rate that meets the SLO
   (engine capacity's code path, timed: the "compute time").
4. Measure: drive the same engine with the recorded trace at ``--rates`` x the prediction, folding
   each run's latencies with the same code, and take the live maximum where the SLO's worst
   objective crosses its limit (interpolated in log rate between the last point that met it and
   the first that did not).

Reports the prediction's error (target within ±15 %) and the compute time as a share of the live
sweep's (target ≤ 5 %). The SLO defaults to TTFT p90 at most ``SOLO_TTFT_MULTIPLE`` x the solo
request's TTFT, over 64 requests: loose enough that it breaks where requests start to queue (where the
TTFT climbs steeply with the rate, so the crossing is decided by throughput, the fit's strength) and
tight enough that the whole trace at once breaks it, so the rate found is bounded. At 2x over 24
requests the crossing sat where a TTFT of ~0.13 s was decided by two or three requests' first steps,
and two quiet runs disagreed with each other more than with the prediction (-25 % and > +67 %).
Run: ``python -m bench.bench_capacity [--scale 0.125 --requests 10 --rates 0.7,1.4]``."""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.machine import header_lines
from bench.workloads import make_workloads
from engine.config import EngineConfig
from engine.events import Event, EventBus, JsonlSink, StartupPhase
from engine.events.startup_records import EngineConfigEvent
from engine.sim.capacity import Objective, RunFold, parse_slo, scaled, search_capacity
from engine.sim.capacity_setup import Overrides, this_machine
from engine.sim.replay import load_recording
from engine.sim.step_fit import fit_recording
from engine.sim.trace_recording import read_recording_trace
from engine.sim.traces import arrival_rate, poisson_arrivals
from engine.sim.workload import VocabTokenIds, WorkloadRequest

MODEL = "smollm2-135m"
TARGET_ERROR = 0.15
TARGET_COMPUTE_SHARE = 0.05
DEFAULT_RATES = "0.6,0.8,1.0,1.25,1.6"
SOLO_TTFT_MULTIPLE = 5.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64, help="requests per run (default 64)")
    p.add_argument("--scale", type=float, default=0.25, help="multiplies the workload's lengths (default 0.25)")
    p.add_argument("--record-load", type=float, default=2.0,
                   help="the recording's arrivals per solo request's lifetime (default 2)")
    p.add_argument("--rates", default=DEFAULT_RATES, help=f"live rates, x the prediction (default {DEFAULT_RATES})")
    p.add_argument("--slo", default=None,
                   help=f"engine capacity's --slo (default: TTFT p90 <= {SOLO_TTFT_MULTIPLE:g}x the solo TTFT)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def bench_requests(n: int, scale: float, seed: int) -> list[WorkloadRequest]:
    """The first ``n`` of batch-64's lengths (prompts 64-512, outputs 64-256, x ``scale``)."""
    batch = next(w for w in make_workloads(seed, scale) if w.name == "batch-64")
    return [WorkloadRequest(f"b{i}", len(p), o) for i, (p, o) in enumerate(zip(batch.prompts, batch.outputs,
                                                                               strict=True)) if i < n]


def drive(engine: Any, requests: Sequence[WorkloadRequest], ids: VocabTokenIds, realtime: bool = True) -> float:
    """Feed ``requests`` at their arrival times, each added between steps but received (its TTFT
    counted from) at its own arrival, as the server's requests are; the run's wall seconds."""
    from engine.core.sampling_params import SamplingParams

    pending = sorted(requests, key=lambda r: r.arrival_time)
    began, bus_began = time.monotonic(), engine.bus.now()
    index = 0
    while index < len(pending) or engine.has_unfinished():
        elapsed = time.monotonic() - began
        while index < len(pending) and (not realtime or pending[index].arrival_time <= elapsed):
            req = pending[index]
            params = SamplingParams(temperature=0.0, max_tokens=req.output_tokens, ignore_eos=True)
            engine.add_request(ids.prompt(req), params, arrival_time=bus_began + req.arrival_time if realtime else None)
            index += 1
        if engine.has_unfinished():
            engine.step()
        elif index < len(pending):
            time.sleep(min(0.05, max(0.0, pending[index].arrival_time - elapsed)))
    return time.monotonic() - began


def folded_run(engine: Any, requests: Sequence[WorkloadRequest], ids: VocabTokenIds,
               realtime: bool = True) -> tuple[RunFold, float]:
    """Drive ``requests`` through the engine, folded as engine capacity folds its simulations."""
    fold = RunFold()
    engine.bus.subscribe(fold)
    try:
        wall = drive(engine, requests, ids, realtime)
    finally:
        engine.bus.unsubscribe(fold)
    return fold, wall


def record(engine: Any, startup: list[Event], requests: list[WorkloadRequest], ids: VocabTokenIds,
           path: Path) -> float:
    """The recorded run: startup's events first (the pool, the flags), then the run's."""
    sink = JsonlSink(path, config=engine.config.to_dict())
    for ev in startup:
        sink(ev)
    engine.bus.subscribe(sink)
    try:
        wall = drive(engine, requests, ids)
    finally:
        engine.bus.unsubscribe(sink)
        sink.close()
    return wall


def predict(path: Path, slo: Sequence[Objective]) -> dict[str, Any]:
    """engine capacity --trace PATH --hardware this, timed."""
    began = time.perf_counter()
    rec = load_recording(path)
    trace = read_recording_trace(path)
    fit = fit_recording(rec.events)
    dep = this_machine(rec, fit, Overrides())
    search = search_capacity(dep.setup, trace.requests, trace.rate, slo)
    return {"rate": search.max_rate, "compute_s": time.perf_counter() - began, "simulations": search.runs,
            "bounded": search.best is not None and search.broke is not None,
            "fit": fit, "trace": trace, "recorded_rate": trace.rate}


def worst_ratio(fold: RunFold, slo: Sequence[Objective]) -> float:
    """The SLO's worst objective as a share of its limit (> 1: broken)."""
    return max(o.measure(fold.values(o.metric)) / o.limit_s for o in slo)


def live_max_rate(points: list[tuple[float, float]]) -> tuple[float, str]:
    """Where the worst-objective ratio crosses 1 over (rate, ratio) points, interpolated in log rate."""
    points = sorted(points)
    ok = [p for p in points if p[1] <= 1.0]
    if not ok:
        return points[0][0], "below the lowest rate run (an upper bound)"
    last = ok[-1]
    above = [p for p in points if p[0] > last[0] and p[1] > 1.0]
    if not above:
        return last[0], "above the highest rate run (a lower bound)"
    (r0, q0), (r1, q1) = last, above[0]
    w = (1.0 - q0) / (q1 - q0) if q1 != q0 else 0.0
    return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0))), "interpolated"


def start(threads: int) -> tuple[Any, list[Event]]:
    from engine.llm_engine import LLMEngine

    startup: list[Event] = []
    bus = EventBus()
    keep = lambda ev: startup.append(ev) if isinstance(ev, EngineConfigEvent | StartupPhase) else None  # noqa: E731
    bus.subscribe(keep)
    engine = LLMEngine(EngineConfig(model=MODEL, num_threads=threads, stats_interval=0.0, max_model_len=1024,
                                    kv_cache_memory_bytes=256 << 20, max_num_seqs=32), bus=bus)
    bus.unsubscribe(keep)
    return engine, startup


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for line in header_lines(args.threads):
        print(line, flush=True)
    engine, startup = start(args.threads)
    ids = VocabTokenIds.for_engine(engine, seed=args.seed)
    requests = bench_requests(args.requests, args.scale, args.seed)
    mean = [WorkloadRequest("solo", int(np.mean([r.prompt_tokens for r in requests])),
                            int(np.mean([r.output_tokens for r in requests])))]
    folded_run(engine, mean, ids, realtime=False)  # warm-up: first shapes, allocator
    solo, solo_s = folded_run(engine, mean, ids, realtime=False)
    slo = parse_slo(args.slo or f"ttft_p90={SOLO_TTFT_MULTIPLE * max(solo.ttft.values()) * 1e3:.0f}ms")
    rec_rate = args.record_load / solo_s
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recorded.jsonl"
        rec_s = record(engine, startup, poisson_arrivals(requests, rec_rate, args.seed), ids, path)
        pred = predict(path, slo)
    print(json.dumps({"bench": "capacity-recording", "solo_s": round(solo_s, 3), "record_rate": round(rec_rate, 4),
                      "recorded_rate": round(pred["recorded_rate"], 4), "record_wall_s": round(rec_s, 1),
                      "slo": args.slo or {o.key: o.limit_s for o in slo}, "fit_r2": round(pred["fit"].r2, 3),
                      "fit": pred["fit"].formula()}), flush=True)
    if pred["bounded"]:
        sweep(engine, ids, pred, slo, [float(f) for f in args.rates.split(",")])
    else:
        print(json.dumps({"bench": "capacity", "verdict": "unbounded: the SLO holds with the whole trace at once, or "
                          "breaks even at the lowest rate; give a tighter or looser --slo", "predicted_rate":
                          pred["rate"]}), flush=True)
    engine.close()
    return 0


def sweep(engine: Any, ids: VocabTokenIds, pred: dict[str, Any], slo: Sequence[Objective],
          factors: list[float]) -> None:
    """The live sweep around the prediction and the verdict."""
    trace = pred["trace"]
    points: list[tuple[float, float]] = []
    live_s = 0.0
    for factor in factors:
        scale = factor * pred["rate"] / trace.rate
        requests = scaled(trace.requests, scale)
        fold, wall = folded_run(engine, requests, ids)
        live_s += wall
        rate = arrival_rate(requests)
        points.append((rate, worst_ratio(fold, slo)))
        print(json.dumps({"bench": "capacity-live", "factor": factor, "rate": round(rate, 4), "wall_s": round(wall, 1),
                          **{o.key + "_s": round(o.measure(fold.values(o.metric)), 4) for o in slo},
                          "meets_slo": points[-1][1] <= 1.0}), flush=True)
    live, how = live_max_rate(points)
    error = pred["rate"] / live - 1
    share = pred["compute_s"] / live_s
    print(json.dumps({"bench": "capacity", "predicted_rate": round(pred["rate"], 4), "live_rate": round(live, 4),
                      "live_rate_is": how, "error": round(error, 3), "within_error_target": abs(error) <= TARGET_ERROR,
                      "simulations": pred["simulations"], "compute_s": round(pred["compute_s"], 2),
                      "live_sweep_s": round(live_s, 1), "compute_share": round(share, 4),
                      "within_time_target": share <= TARGET_COMPUTE_SHARE}), flush=True)
    print(f"predicted {pred['rate']:.3g} req/s, live {live:.3g} req/s ({how}): error {error * 100:+.1f} % "
          f"(target ±{TARGET_ERROR * 100:.0f} %); prediction {pred['compute_s']:.2f} s = {share * 100:.2f} % of the "
          f"live sweep's {live_s:.0f} s (target ≤ {TARGET_COMPUTE_SHARE * 100:.0f} %)", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
