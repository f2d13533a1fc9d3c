"""Property test: random arrivals, steps, aborts and stop tokens over tiny pools.

After every operation the pool and scheduler invariants hold, no step exceeds the
token budget or max_num_seqs, the folded step events equal the block table, and
at the end every block is free. The default run is small; the 10^5-operation run
is marked slow.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.core.policy import POLICIES
from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.step_events import publish_step_event
from engine.events import EventBus, StepEvent
from engine.events.folds.block_table import BlockTableState

STOP = 0
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [1, 2, 3, 4, 13, 14]]


class SchedulerMachine(RuleBasedStateMachine):
    sched: Scheduler
    fold: BlockTableState

    @initialize(
        num_blocks=st.integers(3, 24),
        block_size=st.sampled_from([1, 2, 4]),
        max_num_seqs=st.integers(1, 5),
        budget=st.integers(1, 24),
        threshold=st.sampled_from([0, 0, 3]),
        decode_step=st.sampled_from([0, 0, 2, 6]),
        policy=st.sampled_from(sorted(POLICIES)),
        caching=st.booleans(),
    )
    def setup(
        self, num_blocks: int, block_size: int, max_num_seqs: int, budget: int, threshold: int, decode_step: int,
        policy: str, caching: bool,
    ) -> None:
        self.config = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=64,
            enable_prefix_caching=caching,
            long_prefill_token_threshold=threshold,
            max_decode_step_tokens=decode_step,
            policy=policy,
        )
        self.bus = EventBus(clock=lambda: 0.0)
        self.sched = Scheduler(self.config, self.bus)
        self.fold = BlockTableState()
        self.bus.subscribe(self._on_event)
        self.counter = 0
        self.now = 0.0

    def _on_event(self, event: object) -> None:
        self.fold.apply_event(event)
        if isinstance(event, StepEvent):
            assert self.fold.tables == self.sched.block_table()
            assert self.fold.cached == self.sched.kv.pool.cached_block_ids()

    @rule(
        prefix=st.integers(-1, len(PREFIXES) - 1),
        suffix=st.lists(st.integers(1, 40), max_size=10),
        max_tokens=st.integers(1, 12),
        priority=st.integers(0, 3),
    )
    def arrive(self, prefix: int, suffix: list[int], max_tokens: int, priority: int) -> None:
        prompt = (PREFIXES[prefix] if prefix >= 0 else []) + suffix
        if not prompt:
            prompt = [41]
        req = Request(f"r{self.counter}", prompt, max_tokens, stop_token_ids=[STOP], priority=priority, arrival_time=self.now)
        self.counter += 1
        accepted = self.sched.add_request(req, self.now)
        assert accepted == (self.sched.rejection_reason(req) is None or req.request_id in self.sched.requests)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(stop_mask=st.integers(0, 2**8 - 1), token=st.integers(1, 40))
    def step(self, stop_mask: int, token: int) -> None:
        self.now += 1.0
        decoding = sum(r.num_computed_tokens >= r.num_prompt_tokens for r in self.sched.running)
        out = self.sched.schedule(self.now)
        assert out.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        bound = self.config.max_decode_step_tokens
        if bound and decoding:  # a step with decodes: at most its bound, or one token per decoding request
            assert out.total_num_scheduled_tokens <= max(bound, decoding)
        assert len(out.scheduled) <= self.config.max_num_seqs
        if self.config.long_prefill_token_threshold:
            assert all(s.num_tokens <= self.config.long_prefill_token_threshold for s in out.scheduled)
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        assert all(len(s.block_ids) * self.config.block_size >= s.start_position + s.num_tokens for s in out.scheduled)
        sampled = {
            s.request_id: [STOP if (stop_mask >> (i % 8)) & 1 else token]
            for i, s in enumerate(out.scheduled)
            if s.samples
        }
        self.sched.update_from_output(out, sampled, self.now)
        publish_step_event(self.bus, out)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        assert self.sched.abort(rid, self.now)

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "sched"):
            self.sched.check_integrity()

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        # run to completion: every accepted request must finish (no livelock)
        for _ in range(5000):
            if not self.sched.has_unfinished():
                break
            self.step(0, 5)
        assert not self.sched.has_unfinished(), "requests never finished"
        pool = self.sched.kv.pool
        assert pool.num_free == pool.num_blocks and all(c == 0 for c in pool.ref_cnt)
        assert self.fold.tables == {}
        pool.check_integrity([])


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class LongSchedulerMachine(SchedulerMachine):
    pass


@pytest.mark.slow
def test_scheduler_machine_1e5_operations() -> None:
    """1,000 examples x 100 steps = 10^5 random operations."""
    test_case = LongSchedulerMachine.TestCase
    test_case.settings = settings(
        max_examples=1000, stateful_step_count=100, deadline=None, suppress_health_check=list(HealthCheck)
    )
    test_case("runTest").runTest()
