"""Property test of the hybrid KV cache manager: random arrivals, steps, aborts and stop
tokens over tiny pools shared by mixed groups (full attention and sliding windows).

After every step: no block is in two places (two tables, or a table and the free list:
the pool's reference counts equal the tables'), a sliding-window group of every
scheduled request holds no real block wholly before its window, every prefix hit is
served by every group (a full group's blocks hold the prefix from position 0, a window
group's the blocks inside the window before the hit's end), and the folded step events
equal the per-group tables. At the end every block is free. The default run is small;
the long run is marked slow.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.core.kv_cache import KVCacheManager, cdiv
from engine.core.kv_cache_groups import FULL, KVCacheGroup, KVCacheSpec
from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.step_events import publish_step_event
from engine.events import Event, EventBus, StepEvent
from engine.events.folds.block_table import BlockTableState

STOP = 0
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [1, 2, 3, 4, 13, 14]]
# (window or None) per group: sliding-only, the Gemma shape (windows then full), a mix of windows
PATTERNS = [(3,), (2, None), (4, 4, None), (None, 5), (3, 6, None), (1, None)]


class HybridMachine(RuleBasedStateMachine):
    sched: Scheduler
    fold: BlockTableState

    @initialize(
        pattern=st.sampled_from(PATTERNS),
        num_blocks=st.integers(8, 40),
        block_size=st.sampled_from([1, 2, 4]),
        max_num_seqs=st.integers(1, 5),
        budget=st.integers(1, 16),
        caching=st.booleans(),
    )
    def setup(self, pattern: tuple[int | None, ...], num_blocks: int, block_size: int, max_num_seqs: int,
              budget: int, caching: bool) -> None:
        groups = tuple(KVCacheGroup(KVCacheSpec(w) if w else FULL, (i,)) for i, w in enumerate(pattern))
        self.config = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=budget, max_model_len=48, enable_prefix_caching=caching,
                                      kv_cache_groups=groups)
        self.bus = EventBus(clock=lambda: 0.0)
        self.sched = Scheduler(self.config, self.bus)
        kv = self.sched.kv
        assert isinstance(kv, KVCacheManager)
        self.kv = kv
        self.fold = BlockTableState()
        self.bus.subscribe(self._on_event)
        lookup = kv.get_computed_blocks

        def checked_lookup(req: Request) -> tuple[list[list[int]] | None, int]:
            hits, hit_tokens = lookup(req)
            self._check_hit(req, hits, hit_tokens)
            return hits, hit_tokens

        kv.get_computed_blocks = checked_lookup  # type: ignore[method-assign]
        self.counter = 0
        self.now = 0.0
        self.folded_step = -1

    def _check_hit(self, req: Request, hits: list[list[int]] | None, hit_tokens: int) -> None:
        """A hit never exceeds what every group can serve."""
        if hits is None:
            assert hit_tokens == 0
            return
        bs = self.config.block_size
        assert hit_tokens % bs == 0 and hit_tokens < len(req.token_ids)
        maps = self.kv.pool.cached_block_maps
        for g, (spec, table) in enumerate(zip(self.kv.specs, hits, strict=True)):
            assert len(table) == hit_tokens // bs
            first_needed = 0
            if spec.sliding_window is not None:
                first_needed = max(0, hit_tokens // bs - cdiv(spec.sliding_window - 1, bs))
            for pos in range(first_needed, len(table)):
                assert maps[g].get(req.block_hashes[pos]) == table[pos], f"group {g} cannot serve position {pos}"

    def _on_event(self, event: Event) -> None:
        self.fold.apply_event(event)
        if isinstance(event, StepEvent):
            self.folded_step = event.index

    def _check_fold(self) -> None:
        """The bus stops a subscriber that raises, so the fold is compared here."""
        null = self.kv.pool.null_block
        expected = {rid: [[b for b in table if b != null] for table in r.block_tables]
                    for rid, r in self.sched.requests.items() if any(r.block_tables)}
        assert self.fold.group_tables == expected
        assert self.fold.tables == self.sched.block_table()
        assert self.fold.cached == self.kv.pool.cached_block_ids()

    @rule(prefix=st.integers(-1, len(PREFIXES) - 1), suffix=st.lists(st.integers(1, 40), max_size=12),
          max_tokens=st.integers(1, 14))
    def arrive(self, prefix: int, suffix: list[int], max_tokens: int) -> None:
        prompt = (PREFIXES[prefix] if prefix >= 0 else []) + suffix or [41]
        req = Request(f"r{self.counter}", prompt, max_tokens, stop_token_ids=[STOP], arrival_time=self.now)
        self.counter += 1
        self.sched.add_request(req, self.now)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(stop_mask=st.integers(0, 2**8 - 1), token=st.integers(1, 40))
    def step(self, stop_mask: int, token: int) -> None:
        self.now += 1.0
        out = self.sched.schedule(self.now)
        assert out.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        bs = self.config.block_size
        for s in out.scheduled:
            tables = s.block_tables
            assert len(tables) == len(self.kv.groups)
            assert all(len(t) * bs >= s.start_position + s.num_tokens for t in tables)
            # the window invariant, as the forward pass reads the tables
            assert self.kv.window_violations(s.request, s.start_position) == []
        sampled = {s.request_id: [STOP if (stop_mask >> (i % 8)) & 1 else token]
                   for i, s in enumerate(out.scheduled) if s.samples}
        self.sched.update_from_output(out, sampled, self.now)
        publish_step_event(self.bus, out)
        assert self.folded_step == out.step_index and not self.bus.failed_sinks
        self._check_fold()

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        assert self.sched.abort(rid, self.now)
        assert not self.bus.failed_sinks

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "sched"):
            self.sched.check_integrity()

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        for _ in range(5000):
            if not self.sched.has_unfinished():
                break
            self.step(0, 5)
        assert not self.sched.has_unfinished(), "requests never finished"
        pool = self.kv.pool
        assert pool.num_free == pool.num_usable
        assert all(c == 0 for b, c in enumerate(pool.ref_cnt) if b != pool.null_block)
        assert self.fold.tables == {} and self.fold.group_tables == {}
        pool.check_integrity([])


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(
    max_examples=30, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class LongHybridMachine(HybridMachine):
    pass


@pytest.mark.slow
def test_hybrid_machine_long_run() -> None:
    test_case = LongHybridMachine.TestCase
    test_case.settings = settings(max_examples=500, stateful_step_count=100, deadline=None,
                                  suppress_health_check=list(HealthCheck))
    test_case("runTest").runTest()
