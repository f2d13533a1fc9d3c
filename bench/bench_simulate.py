"""``engine simulate`` at scale for ``make bench``: 10,000 requests (the
background's draws: prompts 500-3,000, answers 150-400) on the H100 preset with
Llama-3.1-8B, events on (step and request events to a JSONL file), then off.
Prints steps per second of wall time; the target is under 60 s per run."""

from __future__ import annotations

import json
import os
import tempfile
import time

from engine.events import EventBus, JsonlSink
from engine.sim.simulate import Simulation, build_setup
from engine.sim.workload import WorkloadSpec, generate_workload

NUM_REQUESTS = 10_000
TARGET_S = 60.0


def run_once(events: bool) -> dict[str, object]:
    setup = build_setup()
    workload = generate_workload(WorkloadSpec(NUM_REQUESTS, (500, 3000), (150, 400)))
    bus = sink = path = None
    if events:
        fd, path = tempfile.mkstemp(suffix=".jsonl", prefix="kvscope-bench-sim-")
        os.close(fd)
        bus = EventBus()
        sink = JsonlSink(path, config=setup.recording_config())
        bus.subscribe(sink)
    start = time.perf_counter()
    try:
        result = Simulation(setup, bus, stats_interval=10.0 if events else 0.0).run(workload)
    finally:
        if sink is not None:
            sink.close()
    wall = time.perf_counter() - start
    size = os.path.getsize(path) if path else 0
    if path:
        os.unlink(path)
    assert result.completed and result.finished == NUM_REQUESTS
    return {
        "bench": "simulate-10k-h100",
        "events": "jsonl" if events else "off",
        "steps": result.steps,
        "wall_s": round(wall, 2),
        "steps_per_s": round(result.steps / wall, 1),
        "simulated_s": round(result.sim_seconds, 2),
        "output_tokens_per_simulated_s": round(result.output_throughput, 1),
        "preemptions": result.preemptions,
        "recording_mb": round(size / 2**20, 1),
        "target_wall_s": TARGET_S,
        "within_target": wall < TARGET_S,
    }


def main() -> int:
    for events in (True, False):
        print(json.dumps(run_once(events)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
