"""The block residency fold on hand-made step events, where every time is known:
birth, prefix hits (also a block shared within the step that registered it),
eviction, and a block born again after it lost its content."""

from __future__ import annotations

import pytest

from engine.events import StepEvent
from engine.events.block_residency import BlockResidency


def step(t: float, allocated=None, cached=(), evicted=(), duration_s: float = 0.0) -> StepEvent:
    return StepEvent(allocated=allocated or {}, cached=list(cached), evicted=list(evicted), duration_s=duration_s, t=t)


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
    fold.apply(step(10.0, {"e": [0, 1]}, evicted=[0, 1]))  # both evicted and handed out fresh
    assert lifetimes == pytest.approx([10.0 - 1.0, 10.0 - 1.0])
    assert idles == pytest.approx([10.0 - 7.0, 10.0 - 3.0])
    assert gaps == pytest.approx([3.0 - 1.0, 7.0 - 3.0])  # block 0's hits at 1, 3, 7; block 1 was hit once
    fold.apply(step(12.0, cached=[0]))
    fold.apply(step(15.0, {"f": [0]}, evicted=[0]))  # born again at 10: no hit since, idle = lifetime
    assert lifetimes[-1] == pytest.approx(5.0) and idles[-1] == pytest.approx(5.0)


def test_a_block_born_before_the_fold_listened_is_not_observed() -> None:
    lifetimes: list[float] = []
    fold = BlockResidency(lifetimes.append, lifetimes.append, lifetimes.append)
    fold.apply(step(4.0, {"a": [5]}, evicted=[9]))
    assert lifetimes == []
