"""Monitor benchmark: block-map redraw on a 27,635-block pool and seek time on a
100,000-step recording. Targets: ≥ 10 redraws/s, ≤ 200 ms per seek. Printed,
not asserted (run: python -m bench.bench_monitor [--steps N])."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from engine.events import Event, EventBus
from monitor.app import MonitorApp
from monitor.state import Timeline
from monitor.synthetic import SyntheticEngine
from monitor.widgets.block_map import BlockMap

H100_BLOCKS = 27_635


def synthetic_events(steps: int, num_blocks: int, **kwargs: float) -> list[Event]:
    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    engine = SyntheticEngine(bus, num_blocks=num_blocks, **kwargs)  # type: ignore[arg-type]
    engine.startup()
    for _ in range(steps):
        engine.step()
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
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--seeks", type=int, default=40)
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    big = synthetic_events(1200, H100_BLOCKS, arrival_rate=20.0, max_num_seqs=256, token_budget=8192)
    big_timeline = Timeline(big, checkpoint_every=500)
    big_timeline.seek(len(big_timeline) - 40)
    used = big_timeline.view.kv_used
    print(f"27,635-block pool: {used:,} blocks in use at the start, built in {time.perf_counter() - t0:.1f} s")
    per_redraw, per_cell = asyncio.run(redraw_rate(big_timeline, (160, 50)))
    print(f"block map redraw: {per_redraw * 1000:.1f} ms median ({1 / per_redraw:.1f} redraws/s; target ≥ 10), "
          f"{per_cell} block(s) per cell")

    t0 = time.perf_counter()
    events = synthetic_events(args.steps, 4096, arrival_rate=0.8, max_num_seqs=64, token_budget=2048)
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


if __name__ == "__main__":
    main()
