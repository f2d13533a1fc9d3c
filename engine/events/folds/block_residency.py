"""KV block residency, folded from ``step`` events: vLLM's ``--kv-cache-metrics``
histograms (``vllm:kv_block_lifetime_seconds``, ``vllm:kv_block_idle_before_evict_seconds``,
``vllm:kv_block_reuse_gap_seconds``) with vLLM's meaning, for every block rather
than vLLM's 1 % sample (``vllm/v1/core/kv_cache_metrics.py``):

- a block is *born* when a request gets it fresh from the free queue;
- it is *accessed* each time a prefix-cache hit hands it to a request (vLLM's
  ``touch``); being born is not an access;
- when its cached contents are *evicted* (the block is taken for reuse) the fold
  observes its lifetime (eviction - birth), its idle time (eviction - last access,
  or birth when never hit) and every gap between consecutive accesses (vLLM keeps the
  last four accesses per sampled block; kvscope keeps them all);
- with ``age_at_hit`` (sglang PR#38559's "age at hit"), each prefix-cache hit observes the
  block's age since its last access, or its birth when never hit: the traffic's reuse
  time. Its counterpart at eviction is ``idle_before_evict``, the same clock read when the
  content is dropped; an eviction-age curve right of the hit-age curve means evictions land
  on content the traffic had finished with.

The step event says all of this without engine state: ``evicted`` blocks lose their
content, and an ``allocated`` block is a hit when it was cached before the step
(``cached``, not evicted since), or is held by a request that keeps it through the step
(only a hit can hand out a block in use: its content was registered in this schedule,
say, when the holder's chunk filled it), or was already handed out this step (a
prefix registered and shared within one schedule); otherwise it came fresh from the
free queue (a block freed by a preemption this step and handed out again is fresh
unless still cached). A block that never held a hash is simply born again on its next
allocation, as in vLLM. Holders are folded from ``allocated`` and ``freed``.
Times are the step's start (``t - duration_s``: allocation and eviction happen when
the step is scheduled) on the bus clock.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

from engine.events.step_records import StepEvent

Observe = Callable[[float], None]


class BlockResidency:
    """Feeds ``lifetime``, ``idle_before_evict`` and ``reuse_gap`` with seconds as
    step events are applied (:meth:`apply`)."""

    __slots__ = ("_accesses", "_age_at_hit", "_birth", "_cached", "_holders", "_idle", "_lifetime", "_reuse_gap")

    def __init__(self, lifetime: Observe, idle_before_evict: Observe, reuse_gap: Observe,
                 age_at_hit: Observe | None = None) -> None:
        self._lifetime = lifetime
        self._idle = idle_before_evict
        self._reuse_gap = reuse_gap
        self._age_at_hit = age_at_hit
        self._birth: dict[int, float] = {}  # block id -> when it was last handed out fresh
        self._accesses: dict[int, list[float]] = {}  # block id -> its prefix hits since birth
        self._cached: set[int] = set()  # blocks holding prefix-cache content now
        self._holders: dict[int, int] = {}  # block id -> requests holding it (absent: none)

    def apply(self, event: StepEvent) -> None:
        now = event.t - event.duration_s
        cached = self._cached
        birth = self._birth
        accesses = self._accesses
        for block in event.evicted:
            cached.discard(block)
            born = birth.pop(block, None)
            hits = accesses.pop(block, None)
            if born is None:  # born before this fold started listening
                continue
            self._lifetime(now - born)
            self._idle(now - (hits[-1] if hits else born))
            if hits:
                for earlier, later in pairwise(hits):
                    self._reuse_gap(later - earlier)
        holders = self._holders
        freed_now = {block for blocks in event.freed.values() for block in blocks} if event.freed else ()
        handed_out: set[int] = set()
        for blocks in event.allocated.values():
            for block in blocks:
                if block in cached or block in handed_out or (block in holders and block not in freed_now):
                    hits = accesses.get(block)
                    if self._age_at_hit is not None:
                        last = hits[-1] if hits else birth.get(block)
                        if last is not None:  # else born before this fold started listening
                            self._age_at_hit(now - last)
                    if hits is None:
                        accesses[block] = [now]
                    else:
                        hits.append(now)
                else:  # a block with hits was cached, so its eviction already dropped them
                    birth[block] = now
                    handed_out.add(block)
        for blocks in event.allocated.values():
            for block in blocks:
                holders[block] = holders.get(block, 0) + 1
        for blocks in event.freed.values():
            for block in blocks:
                left = holders.get(block, 0) - 1
                if left > 0:
                    holders[block] = left
                else:
                    holders.pop(block, None)
        cached.update(event.cached)
