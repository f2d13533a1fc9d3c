"""The block residency fold on hand-made step events, where every time is known
(birth, prefix hits, also on a block shared within the step that registered it,
eviction, a block born again, a block freed by a preemption and handed out fresh),
and against vLLM's collector written over the real block pool's own operations."""

from __future__ import annotations

from itertools import pairwise

import pytest

from engine.events import StepEvent
from engine.events.folds.block_residency import BlockResidency
from engine.sim.driver import run_driver
from tests.preempting_run import CONFIG, STEP_S, new_scheduler, requests


def step(t: float, allocated=None, cached=(), evicted=(), freed=None, duration_s: float = 0.0) -> StepEvent:
    return StepEvent(allocated=allocated or {}, cached=list(cached), evicted=list(evicted), freed=freed or {},
                     duration_s=duration_s, t=t)


def test_lifetime_idle_and_reuse_gaps_of_hand_made_steps() -> None:
    lifetimes: list[float] = []
    idles: list[float] = []
    gaps: list[float] = []
    fold = BlockResidency(lifetimes.append, idles.append, gaps.append)
    # t=1: a's prefill gets blocks 0, 1 (both cached at once) and b, admitted later in the
    # same schedule, shares block 0: a hit on a block registered this step
    fold.apply(step(1.5, {"a": [0, 1], "b": [0, 2]}, cached=[0, 1], duration_s=0.5))
    fold.apply(step(3.0, {"c": [0, 1, 3]}))  # hits on 0 and 1; 3 is born
    fold.apply(step(7.0, {"d": [0]}))  # a third hit on block 0
    fold.apply(step(8.0, freed={"a": [0, 1], "b": [0, 2], "c": [0, 1, 3], "d": [0]}))  # all finish: cached-free
    fold.apply(step(10.0, {"e": [0, 1]}, evicted=[0, 1]))  # both evicted and handed out fresh
    assert lifetimes == pytest.approx([10.0 - 1.0, 10.0 - 1.0])
    assert idles == pytest.approx([10.0 - 7.0, 10.0 - 3.0])
    assert gaps == pytest.approx([3.0 - 1.0, 7.0 - 3.0])  # block 0's hits at 1, 3, 7; block 1 was hit once
    fold.apply(step(12.0, cached=[0], freed={"e": [0, 1]}))
    fold.apply(step(15.0, {"f": [0]}, evicted=[0]))  # born again at 10: no hit since, idle = lifetime
    assert lifetimes[-1] == pytest.approx(5.0) and idles[-1] == pytest.approx(5.0)


def test_holders_tell_a_hit_on_a_block_in_use_from_a_block_reused_after_a_preemption() -> None:
    lifetimes: list[float] = []
    idles: list[float] = []
    gaps: list[float] = []
    fold = BlockResidency(lifetimes.append, idles.append, gaps.append)
    fold.apply(step(1.0, {"a": [4]}))  # a's partial block
    # a's next chunk fills block 4 (registered in this schedule) and b, admitted after, hits it
    fold.apply(step(2.0, {"a": [5], "b": [4]}, cached=[4]))
    # v holds block 7 (never full); it is preempted and 7 goes fresh to w in the same step
    fold.apply(step(3.0, {"v": [7]}))
    fold.apply(step(4.0, {"w": [7]}, freed={"v": [7]}))
    fold.apply(step(9.0, {"x": [4, 7]}, evicted=[4], freed={"a": [4, 5], "b": [4], "w": [7]}))
    assert lifetimes == pytest.approx([9.0 - 1.0])  # block 4 was born once, at 1, and hit at 2
    assert idles == pytest.approx([9.0 - 2.0])
    fold.apply(step(10.0, cached=[7]))
    fold.apply(step(12.0, {"y": [7]}, evicted=[7]))
    assert lifetimes[-1] == pytest.approx(12.0 - 9.0)  # 7 was born again at 4 and at 9, not hit at 4


def test_a_block_born_before_the_fold_listened_is_not_observed() -> None:
    lifetimes: list[float] = []
    fold = BlockResidency(lifetimes.append, lifetimes.append, lifetimes.append)
    fold.apply(step(4.0, {"a": [5]}, evicted=[9]))
    assert lifetimes == []


def test_the_fold_agrees_with_the_pools_own_births_hits_and_evictions() -> None:
    """vLLM's collector, written here over the real block pool's operations (fresh
    blocks, prefix-hit touches, evictions) during a run that preempts for both
    reasons and evicts shared prefixes, observes exactly what the fold of the run's
    step events observes."""
    scheduler = new_scheduler()
    pool = scheduler.kv.pool
    expected: dict[str, list[float]] = {"lifetime": [], "idle": [], "gap": []}
    state: dict[int, tuple[float, list[float]]] = {}  # block -> (birth, hits)

    def now() -> float:  # the step being scheduled ends at the next count, as its event's t
        return (scheduler.step_index + 1) * STEP_S

    get_new_blocks, touch, evict = pool.get_new_blocks, pool.touch, pool._evict

    def fresh(n: int) -> list[int]:
        blocks = get_new_blocks(n)
        for block in blocks:
            state[block] = (now(), [])
        return blocks

    def hit(blocks) -> None:  # type: ignore[no-untyped-def]
        blocks = list(blocks)
        touch(blocks)
        for block in blocks:
            if block in state:
                state[block][1].append(now())

    def evicted(block: int, block_hash: int) -> None:
        evict(block, block_hash)
        born, hits = state.pop(block)
        expected["lifetime"].append(now() - born)
        expected["idle"].append(now() - (hits[-1] if hits else born))
        expected["gap"].extend(b - a for a, b in pairwise(hits))

    pool.get_new_blocks, pool.touch, pool._evict = fresh, hit, evicted  # type: ignore[method-assign]
    observed: dict[str, list[float]] = {"lifetime": [], "idle": [], "gap": []}
    fold = BlockResidency(observed["lifetime"].append, observed["idle"].append, observed["gap"].append)
    assert scheduler.bus is not None
    scheduler.bus.subscribe(lambda event: fold.apply(event) if isinstance(event, StepEvent) else None)
    assert run_driver(requests(), CONFIG, scheduler=scheduler, step_time_s=STEP_S).completed
    assert len(expected["lifetime"]) > 20 and expected["gap"]
    for kind, values in expected.items():
        assert sorted(observed[kind]) == pytest.approx(sorted(values)), kind
