"""``engine bench-scheduler``: scheduler steps per second, no model.

Two traces, the ones vLLM's own V1 scheduler was timed on (its ``schedule()`` +
``update_from_output()`` only):

- ``decode-256``: 27,635 blocks of 16, prefix caching on, 256 requests with
  distinct random 1,000-token prompts and unbounded outputs; the 32 prefill steps
  run untimed, then 600 decode steps are timed (vLLM: median 328 steps/s).
- ``seed-60``: the background's 60 requests (default_rng(0); prompts 500-3,000,
  answers 150-400) run to completion, 386 steps (vLLM: median 1,862 steps/s).

Each trace runs with events off, with a subscriber that drops every event, and
with a JSONL sink writing to a temporary file; the median over ``--repeats`` is
printed. A timed step is schedule + the fixed "sampled" token + update + step
event.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from engine.cli.program import Subparsers
from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.errors import UserError
from engine.events import Event, EventBus, JsonlSink
from engine.sim.driver import background_workload, driver_step

TRACES = ("decode-256", "seed-60")
SINKS = ("off", "null", "jsonl")
VLLM_STEPS_PER_S = {"decode-256": 328.0, "seed-60": 1862.0}
TARGET_STEPS_PER_S = {"decode-256": 1000.0, "seed-60": 5600.0}

DECODE_CONFIG = SchedulerConfig(
    num_blocks=27_635, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=32_768
)
SEED60_CONFIG = SchedulerConfig(num_blocks=27_635, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192)


def _decode_256_requests() -> list[Request]:
    import numpy as np

    rng = np.random.default_rng(0)
    # "unbounded" outputs: far more than the timed window produces
    return [Request(f"r{i}", rng.integers(0, 49152, 1000).tolist(), 16_000, ignore_eos=True) for i in range(256)]


def time_decode_256(bus: EventBus | None, decode_steps: int = 600) -> tuple[int, float]:
    """(timed steps, seconds) for the decode-256 trace."""
    sched = Scheduler(DECODE_CONFIG, bus)
    for req in _decode_256_requests():
        sched.add_request(req, 0.0)
    step = 0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or sched.num_waiting:
        driver_step(sched, bus, float(step))
        step += 1
    start = time.perf_counter()
    for _ in range(decode_steps):
        driver_step(sched, bus, float(step))
        step += 1
    elapsed = time.perf_counter() - start
    assert sched.num_running == 256, "decode-256 must keep all 256 requests running"
    return decode_steps, elapsed


def time_seed_60(bus: EventBus | None) -> tuple[int, float]:
    """(steps, seconds) for the seed-60 trace run to completion."""
    # the step loop itself, not run_driver: its tally would publish events in the "off" mode
    sched = Scheduler(SEED60_CONFIG, bus)
    for spec in background_workload(60, (500, 3000), (150, 400)):
        sched.add_request(Request(spec.request_id, spec.prompt_token_ids, spec.output_tokens, ignore_eos=True), 0.0)
    steps = finished = 0
    start = time.perf_counter()
    while sched.has_unfinished():
        finished += len(driver_step(sched, bus, float(steps))[1])
        steps += 1
    elapsed = time.perf_counter() - start
    assert finished == 60
    return steps, elapsed


RUNNERS: dict[str, Callable[[EventBus | None], tuple[int, float]]] = {
    "decode-256": time_decode_256,
    "seed-60": time_seed_60,
}


def _drop(_: Event) -> None:
    return None


def measure(trace: str, sink: str, repeats: int) -> dict[str, Any]:
    """Median steps/s of ``trace`` with events ``off`` | ``null`` | ``jsonl``."""
    rates: list[float] = []
    steps = 0
    for _ in range(repeats):
        bus: EventBus | None = None
        jsonl: JsonlSink | None = None
        path = None
        if sink != "off":
            bus = EventBus()
            if sink == "null":
                bus.subscribe(_drop)
            else:
                fd, path = tempfile.mkstemp(suffix=".jsonl", prefix="kvscope-bench-")
                os.close(fd)
                jsonl = JsonlSink(path)
                bus.subscribe(jsonl)
        try:
            steps, elapsed = RUNNERS[trace](bus)
        finally:
            if jsonl is not None:
                jsonl.close()
            if path is not None:
                os.unlink(path)
        rates.append(steps / elapsed)
    return {
        "trace": trace,
        "events": sink,
        "steps": steps,
        "repeats": repeats,
        "median_steps_per_s": statistics.median(rates),
        "median_ms_per_step": 1000.0 / statistics.median(rates),
        "vllm_steps_per_s": VLLM_STEPS_PER_S[trace],
        "target_steps_per_s": TARGET_STEPS_PER_S[trace],
    }


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "bench-scheduler",
        help="scheduler steps per second on fixed traces (no model)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", choices=(*TRACES, "all"), default="all", help="which trace (default: both)")
    p.add_argument("--repeats", type=int, default=5, help="runs per configuration; the median is printed (default 5)")
    p.add_argument("--events", choices=(*SINKS, "all"), default="all", help="event sink (default: all three)")
    p.add_argument("--json", action="store_true", help="print one JSON object per line instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise UserError(f"--repeats {args.repeats}: use 1 or more")
    traces = TRACES if args.trace == "all" else (args.trace,)
    sinks = SINKS if args.events == "all" else (args.events,)
    for trace in traces:
        for sink in sinks:
            row = measure(trace, sink, args.repeats)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"{trace:<11} events={sink:<5} {row['steps']:>4} steps  "
                    f"median {row['median_steps_per_s']:>8,.0f} steps/s ({row['median_ms_per_step']:.3f} ms/step)  "
                    f"vLLM {row['vllm_steps_per_s']:,.0f}  target {row['target_steps_per_s']:,.0f}",
                    flush=True,
                )
    return 0
