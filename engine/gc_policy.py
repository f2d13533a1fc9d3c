"""Garbage collection during startup.

``import torch`` and the startup phases create about 190,000 long-lived objects.
With CPython's default thresholds that triggers some 400 young and three full
collections, each full one walking every object torch has made so far: 0.3-0.45 s of
a 2.5-3.5 s warm start on a 2-core AVX2 Zen 3 (measured with ``gc.callbacks``). The
entry points (:mod:`engine.llm`, :mod:`engine.cli.main`) call :func:`defer_collections`
before anything imports torch, which makes young collections 14x rarer (no full one
runs); :func:`restore_collections`, at the end of phase G, puts the thresholds back.
Collection is never turned off: a process that imports kvscope and never starts an
engine only collects less often.

At the end of startup (phase G) :func:`freeze_startup_heap` collects once and freezes what
is left, as vLLM's ``freeze_gc_heap`` does: a full collection during serving then skips the
objects startup made. Unfrozen, one walked ~200,000 of them in ~145 ms (SmolLM2, 2-core Zen 4),
a whole step stalled whenever CPython's gen-2 rule fired. A closed engine thaws the heap
(:func:`thaw_heap`), so what it leaves in cycles can be collected.
"""

from __future__ import annotations

import gc

# Allocations between young collections while starting (CPython's default is 700).
STARTUP_GEN0_THRESHOLD = 10_000

_saved: tuple[int, int, int] | None = None


def defer_collections() -> None:
    """Collect young objects less often until :func:`restore_collections` (idempotent)."""
    global _saved
    if _saved is None:
        _saved = gc.get_threshold()
        gc.set_threshold(max(STARTUP_GEN0_THRESHOLD, _saved[0]), _saved[1], _saved[2])


def restore_collections() -> None:
    """The thresholds as they were before :func:`defer_collections` (a no-op otherwise)."""
    global _saved
    if _saved is not None:
        gc.set_threshold(*_saved)
        _saved = None


def freeze_startup_heap() -> None:
    """Collect every generation, then freeze the survivors (the permanent generation, which
    collections skip). Collecting first matters: ``gc.freeze`` keeps what it finds, and garbage
    frozen in a cycle would never be reclaimed."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Back into the oldest generation: after an engine closes, its cycles can be collected."""
    gc.unfreeze()
