"""Step events: folding their block deltas rebuilds the manager's table exactly."""

from __future__ import annotations

import random
from pathlib import Path

from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.step_events import build_step_event, publish_step_event
from engine.events import Event, EventBus, JsonlSink, StepEvent, read_events
from engine.events.folds.block_table import BlockTableState, fold_step_events


def _run_with_fold_check(seed: int, sink: JsonlSink | None = None) -> tuple[int, int, Scheduler]:
    """Prefix-sharing requests on a tiny pool with aborts between steps; after every
    step the fold of the events must equal the scheduler's table and cached set."""
    rng = random.Random(seed)
    bus = EventBus(clock=lambda: 0.0)
    fold = BlockTableState()
    mismatches: list[int] = []
    cfg = SchedulerConfig(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=20, max_model_len=80)
    sched = Scheduler(cfg, bus)

    def on_event(event: Event) -> None:
        fold.apply_event(event)
        if isinstance(event, StepEvent):
            if fold.tables != sched.block_table() or fold.cached != sched.kv.pool.cached_block_ids():
                mismatches.append(event.index)
            assert event.kv_blocks_used == cfg.num_blocks - sched.kv.pool.num_free

    bus.subscribe(on_event)
    if sink is not None:
        bus.subscribe(sink)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((4, 8, 12)))] for _ in range(3)]
    counter = preemptions = evictions = 0
    for step in range(400):
        for _ in range(rng.choice((0, 0, 1, 2))):
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
            sched.add_request(Request(f"r{counter}", prompt, rng.randrange(1, 30)), float(step))
            counter += 1
        if sched.requests and rng.random() < 0.05:
            sched.abort(rng.choice(sorted(sched.requests)), float(step))
        if not sched.has_unfinished():
            continue
        out = sched.schedule(float(step))
        sched.update_from_output(out, {s.request_id: [rng.randrange(1000)] for s in out.scheduled if s.samples}, float(step))
        preemptions += len(out.preempted_req_ids)
        evictions += len(out.evicted)
        publish_step_event(bus, out, {"duration_s": 0.001})
    assert mismatches == []
    # aborts after the last step are folded from their request.finished events
    assert fold.tables == sched.block_table()
    return preemptions, evictions, sched


def test_fold_matches_the_manager_after_every_step() -> None:
    totals = [_run_with_fold_check(seed) for seed in range(3)]
    # the workload really exercised the hard paths
    assert sum(p for p, _, _ in totals) > 0
    assert sum(e for _, e, _ in totals) > 0


def test_fold_of_a_jsonl_recording(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path)
    _, _, sched = _run_with_fold_check(7, sink)
    sink.close()
    recording = read_events(path)
    steps = [e for e in recording.events if isinstance(e, StepEvent)]
    assert steps and [e.index for e in steps] == sorted(e.index for e in steps)
    state = fold_step_events(recording.events)
    assert state.tables == sched.block_table()
    assert state.cached == sched.kv.pool.cached_block_ids()
    assert state.num_blocks == 24


def test_step_event_content() -> None:
    cfg = SchedulerConfig(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    sched = Scheduler(cfg)
    sched.add_request(Request("a", list(range(10)), 1), 0.0)
    out = sched.schedule(0.0)
    sched.update_from_output(out, {}, 0.0)
    event = build_step_event(out, {"schedule_s": 0.5, "forward_s": 1.5})
    assert event.scheduled == {"a": [8, "prefill"]}
    assert event.allocated == {"a": [0, 1]} and event.cached == [0, 1]
    assert event.new == ["a"] and event.num_running == 1 and event.kv_blocks_used == 2
    assert (event.schedule_s, event.forward_s, event.sample_s) == (0.5, 1.5, 0.0)
    assert event.prefix_queries_tokens == 10 and event.prefix_hits_tokens == 0
    out = sched.schedule(1.0)
    sched.update_from_output(out, {"a": [3]}, 1.0)
    event = build_step_event(out)
    assert event.scheduled == {"a": [2, "prefill"]} and event.finished == {"a": "length"}
    assert event.allocated == {"a": [2]} and event.freed == {"a": [0, 1, 2]}
    assert event.num_running == 0 and event.kv_blocks_used == 0 and event.kv_blocks_cached_free == 2
