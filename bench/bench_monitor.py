"""Monitor benchmark: block-map redraw on a 27,635-block pool and seek time on a
100,000-step recording. Targets: ≥ 10 redraws/s, ≤ 200 ms per seek. Printed,
not asserted (run: python -m bench.bench_monitor [--steps N]).

The event streams are ``engine simulate``'s: the real scheduler and KV cache
manager under the roofline cost model (llama-3.1-8b on an H100 preset), with
Poisson arrivals per step, collected in memory from an :class:`EventBus`."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from engine.config import EngineConfig
from engine.events import Event, EventBus
from engine.sim.simulate import build_setup, simulate
from engine.sim.workload import WorkloadSpec, generate_workload
from monitor.app import MonitorApp
from monitor.state import Timeline
from monitor.widgets.block_map import BlockMap

H100_BLOCKS = 27_635  # the background's worked example: llama-3.1-8b on an 80 GB H100 at utilization 0.92
MODEL = "llama-3.1-8b"
GPU = "h100-80gb"


def simulated_events(steps: int, num_blocks: int, *, max_num_seqs: int, max_num_batched_tokens: int,
                     rate: float, prompt_range: tuple[int, int], output_range: tuple[int, int],
                     seed: int = 7) -> list[Event]:
    """Every event of a ``steps``-step simulation on a ``num_blocks``-block pool:
    startup phases A-G, then ``rate`` arrivals per step (a third of them sharing
    a 512-token prefix), run until ``steps`` steps or the workload is done."""
    engine = EngineConfig(model=MODEL, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=8192)
    setup = build_setup(MODEL, GPU, engine, num_gpu_blocks_override=num_blocks)
    spec = WorkloadSpec(num_requests=int(rate * steps) + max_num_seqs, prompt_range=prompt_range,
                        output_range=output_range, arrival="poisson", unit="step", rate=rate,
                        shared_prefix_fraction=1 / 3, shared_prefix_tokens=512, seed=seed)
    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    simulate(setup, generate_workload(spec), bus, max_steps=steps)
    return events


async def redraw_rate(timeline: Timeline, size: tuple[int, int], rounds: int = 30) -> tuple[float, int]:
    """Seconds per full redraw (rebuild cells + render every visible line) while stepping."""
    app = MonitorApp(timeline=timeline)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        block_map = app.query_one(BlockMap)
        block_map.blocks_per_cell = 1  # worst case: one cell per block, scrolled view
        times = []
        for _ in range(rounds):
            view = timeline.step_forward()
            start = time.perf_counter()
            block_map.update_view(view)
            for y in range(block_map.size.height):
                block_map.render_line(y)
            times.append(time.perf_counter() - start)
        return statistics.median(times), block_map.effective_blocks_per_cell


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000, help="steps of the seek recording (default 100,000)")
    parser.add_argument("--seeks", type=int, default=40)
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    big = simulated_events(1200, H100_BLOCKS, max_num_seqs=256, max_num_batched_tokens=8192, rate=1.0,
                           prompt_range=(500, 3000), output_range=(150, 400))
    big_timeline = Timeline(big, checkpoint_every=500)
    big_timeline.seek(len(big_timeline) - 40)
    used = big_timeline.view.kv_used
    print(f"27,635-block pool: {used:,} blocks in use at the start, built in {time.perf_counter() - t0:.1f} s")
    per_redraw, per_cell = asyncio.run(redraw_rate(big_timeline, (160, 50)))
    print(f"block map redraw: {per_redraw * 1000:.1f} ms median ({1 / per_redraw:.1f} redraws/s; target ≥ 10), "
          f"{per_cell} block(s) per cell")

    t0 = time.perf_counter()
    events = simulated_events(args.steps, 4096, max_num_seqs=64, max_num_batched_tokens=2048, rate=0.7,
                              prompt_range=(100, 1200), output_range=(8, 160))
    made = time.perf_counter() - t0
    t0 = time.perf_counter()
    timeline = Timeline(events, checkpoint_every=500)
    indexed = time.perf_counter() - t0
    print(f"{len(timeline):,}-step recording ({len(events):,} events, 4,096-block pool): "
          f"generated in {made:.1f} s, checkpointed in {indexed:.1f} s")
    rng = random.Random(0)
    seeks = []
    for _ in range(args.seeks):
        target = rng.randrange(len(timeline))
        start = time.perf_counter()
        timeline.seek(target)
        seeks.append(time.perf_counter() - start)
    print(f"seek: median {statistics.median(seeks) * 1000:.1f} ms, max {max(seeks) * 1000:.1f} ms "
          f"over {args.seeks} random seeks (target ≤ 200 ms)")

    from bench.bench_fleet import report as fleet_report  # 8 replicas polled, KV events while drawing

    fleet_report()


if __name__ == "__main__":
    main()
