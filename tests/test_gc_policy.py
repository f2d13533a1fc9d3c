"""engine/gc_policy.py: collections are deferred while starting, never turned off,
and the thresholds come back exactly."""

from __future__ import annotations

import gc

import pytest

from engine.gc_policy import STARTUP_GEN0_THRESHOLD, defer_collections, restore_collections


def test_deferring_raises_only_the_young_threshold_and_restoring_puts_it_back() -> None:
    restore_collections()  # importing engine.llm or engine.cli.main deferred them already
    before = gc.get_threshold()
    try:
        defer_collections()
        defer_collections()  # idempotent: the second call must not save the raised values
        assert gc.get_threshold() == (max(STARTUP_GEN0_THRESHOLD, before[0]), before[1], before[2])
        assert gc.isenabled()
        restore_collections()
        assert gc.get_threshold() == before
        restore_collections()  # nothing deferred: a no-op
        assert gc.get_threshold() == before
    finally:
        gc.set_threshold(*before)


def test_an_engine_start_restores_the_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry points defer collection before torch loads; phase G's end restores it."""
    from engine.llm import LLM
    from engine.model.plan import setting

    monkeypatch.setenv(setting.PLAN_ENV, "off")  # the thresholds, not the plan: a short start

    restore_collections()
    default = gc.get_threshold()
    defer_collections()
    llm = LLM(load_format="dummy", max_model_len=256, kv_cache_memory_bytes=1 << 24, stats_interval=0.0,
              max_num_batched_tokens=64)
    assert llm.engine is not None
    assert gc.get_threshold() == default


def test_a_started_engine_serves_on_a_frozen_heap_and_thaws_it_when_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Phase G collects and freezes what startup made (vLLM's freeze_gc_heap), so a full
    collection while serving skips it; closing the engine thaws it for collection."""
    from engine.llm import LLM
    from engine.model.plan import setting

    monkeypatch.setenv(setting.PLAN_ENV, "off")
    gc.unfreeze()
    llm = LLM(load_format="dummy", max_model_len=256, kv_cache_memory_bytes=1 << 24, stats_interval=0.0,
              max_num_batched_tokens=64)
    try:
        assert gc.get_freeze_count() > 10_000  # torch's and the engine's objects, not a handful
        assert gc.get_count()[0] < 10_000  # just collected: the young generation starts near empty
        from engine.core.sampling_params import SamplingParams

        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids) == 2
    finally:
        llm.close()
    assert gc.get_freeze_count() == 0
