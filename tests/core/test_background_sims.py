"""The background's Part 5 simulations, run through the real scheduler.

Same workload draws as the background (numpy default_rng(0)); token ids are
random (default_rng(123)) so prompts share no prefix.
"""

from __future__ import annotations

import pytest

from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sim.driver import background_workload, run_driver


def test_sixty_requests_on_the_h100_pool() -> None:
    cfg = SchedulerConfig(num_blocks=27_635, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192)
    result = run_driver(background_workload(60, (500, 3000), (150, 400)), cfg)
    assert result.completed and result.finished == 60
    assert result.preemptions == 0
    assert result.peak_running == 60
    # background: 386 steps, peak pool use 26.1 %
    assert result.steps == 386
    assert round(result.peak_blocks_used / cfg.num_blocks * 100, 1) == 26.1


@pytest.mark.slow  # ~7 s; tests/sim/test_simulate.py runs the same forty requests through the simulator
def test_forty_long_requests_on_a_small_pool_preempt_but_all_finish() -> None:
    cfg = SchedulerConfig(
        num_blocks=20_000, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=32_768
    )
    over: list[int] = []

    def check(sched: Scheduler, out: SchedulerOutput) -> None:
        pool = sched.kv.pool
        if not 0 <= pool.num_free <= pool.num_blocks or out.total_num_scheduled_tokens > 8192:
            over.append(out.step_index)
        if out.preempted_req_ids or out.step_index % 5000 == 0:
            sched.check_integrity()

    result = run_driver(background_workload(40, (4000, 6000), (14000, 15000)), cfg, on_step=check)
    assert result.completed and result.finished == 40
    assert result.preemptions > 0
    assert result.peak_blocks_used == cfg.num_blocks  # pinned at 100 %, never beyond
    assert over == []
