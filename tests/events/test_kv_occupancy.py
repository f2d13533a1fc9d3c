"""KV occupancy by token slots (engine/events/folds/kv_occupancy.py), folded from events, against
the scheduler's own state step by step: every group's held blocks and filled slots (each
block's slots up to its holders' computed tokens), the partly filled blocks, and
``vllm:kv_cache_token_usage_perc``; full attention and a hybrid pool (a sliding window)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from engine.core.kv_cache_groups import FULL, KVCacheGroup, KVCacheSpec
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.events import EngineConfigEvent, EventBus
from engine.events.exporters.metrics import PrometheusMetrics
from engine.events.folds.view import EngineView
from engine.sim.driver import DriverRequest, run_driver

BLOCK = 16


def truth(sched: Scheduler) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """Per group (distinct blocks held, filled slots), and partly filled block -> filled slots,
    from the scheduler's requests: a block's slot is filled when a holder computed its position."""
    null = sched.kv.pool.null_block
    groups: list[dict[int, int]] = []
    for req in sched.requests.values():
        for g, table in enumerate(req.block_tables):
            while len(groups) <= g:
                groups.append({})
            for i, block in enumerate(table):
                if block == null:
                    continue
                filled = max(0, min(BLOCK, req.num_computed_tokens - i * BLOCK))
                groups[g][block] = max(groups[g].get(block, 0), filled)
    partial = {b: f for blocks in groups for b, f in blocks.items() if f < BLOCK}
    return [(len(blocks), sum(blocks.values())) for blocks in groups], partial


def workload() -> list[DriverRequest]:
    shared = list(range(500, 548))  # three blocks every other request shares: prefix hits
    return [DriverRequest(f"r{i}", (shared if i % 2 else []) + [i * 50 + k for k in range(17 + 9 * (i % 7))],
                          output_tokens=3 + i % 11, arrival_step=i // 3) for i in range(40)]


HYBRID = (KVCacheGroup(KVCacheSpec(32), (0,)), KVCacheGroup(FULL, (1,)))


@pytest.mark.parametrize("groups", [(), HYBRID], ids=["full", "sliding+full"])
def test_occupancy_folded_from_events_is_the_schedulers(groups: tuple[KVCacheGroup, ...]) -> None:
    config = SchedulerConfig(num_blocks=48, block_size=BLOCK, max_num_seqs=6, max_num_batched_tokens=40,
                             max_model_len=256, kv_cache_groups=groups)
    bus = EventBus(clock=lambda: 0.0)
    view = EngineView()
    metrics = PrometheusMetrics(CollectorRegistry(), "m", max_model_len=256)
    bus.subscribe(view.apply)
    bus.subscribe(metrics)
    bus.publish(EngineConfigEvent(config={"block_size": BLOCK}))
    checked = {"steps": 0, "partial": 0}

    def check(sched: Scheduler, out: SchedulerOutput) -> None:
        per_group, partial = truth(sched)
        occupancy = view.occupancy
        got = [(g.blocks, g.filled) for g in occupancy.groups]
        assert got[:len(per_group)] == per_group and all(g == (0, 0) for g in got[len(per_group):]), out.step_index
        assert occupancy.partial == partial
        total = 48 * BLOCK
        filled = sum(f for _, f in per_group)
        gauge = metrics.registry.get_sample_value("vllm:kv_cache_token_usage_perc", {"model_name": "m", "engine": "0"})
        assert gauge == pytest.approx(filled / total)
        assert occupancy.token_usage == pytest.approx(filled / total)
        checked["steps"] += 1
        checked["partial"] += bool(partial)

    result = run_driver(workload(), config, bus=bus, on_step=check)
    assert result.completed
    assert checked["steps"] > 50 and checked["partial"] > 20  # the property was exercised


def test_short_prompts_fill_far_fewer_slots_than_the_blocks_say() -> None:
    """vLLM PR#57336's shape: 17-token prompts in 16-token blocks hold two blocks each while
    filling just over one, so the block gauge reads far above the token gauge."""
    config = SchedulerConfig(num_blocks=64, block_size=BLOCK, max_num_seqs=16, max_num_batched_tokens=512,
                             max_model_len=256)
    bus = EventBus(clock=lambda: 0.0)
    view = EngineView()
    bus.subscribe(view.apply)
    bus.publish(EngineConfigEvent(config={"block_size": BLOCK}))
    seen: list[tuple[float, float]] = []

    def check(sched: Scheduler, out: SchedulerOutput) -> None:
        occupancy = view.occupancy
        seen.append((occupancy.block_usage, occupancy.token_usage))

    requests = [DriverRequest(f"r{i}", [i * 100 + k for k in range(17)], output_tokens=2) for i in range(16)]
    run_driver(requests, config, bus=bus, on_step=check)
    block_usage, token_usage = seen[0]  # after the prefill step: 16 requests x 2 blocks, 17 tokens each
    assert block_usage == pytest.approx(32 / 64)
    assert token_usage == pytest.approx(16 * 17 / (64 * BLOCK))
    assert view.occupancy.filled == 0 and view.occupancy.fill == 1.0  # all finished: nothing held
