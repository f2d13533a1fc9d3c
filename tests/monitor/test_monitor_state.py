"""EngineView folding, snapshots and Timeline seeking on real recordings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.events import EventBus, SnapshotEvent, StepEvent, read_events
from engine.events.folds.view import EngineView
from monitor.state import Timeline
from tests.monitor_fixtures import SAMPLE, owners_at, record_driver_run


@pytest.fixture(scope="module")
def driver_events(tmp_path_factory: pytest.TempPathFactory) -> list:
    path = record_driver_run(tmp_path_factory.mktemp("mon") / "driver.jsonl")
    return read_events(path).events


@pytest.mark.parametrize("source", ["sample", "driver"])
def test_view_agrees_with_step_counts_every_step(source: str, driver_events: list) -> None:
    events = read_events(SAMPLE).events if source == "sample" else driver_events
    view = EngineView()
    steps = 0
    for event in events:
        view.apply(event)
        if isinstance(event, StepEvent):
            steps += 1
            assert len(view.block_owners) == event.kv_blocks_used, event.index
            assert len(view.running) == event.num_running, event.index
            assert len(view.waiting) == event.num_waiting, event.index
    assert steps > 50
    assert view.preemptions > 0, "fixtures must exercise preemption"
    assert any(len(o) > 1 for o in owners_at(events, 10**9).values()) or view.finished > 0


def test_driver_run_has_shared_prefix_blocks_and_preemptions(driver_events: list) -> None:
    steps = [e for e in driver_events if isinstance(e, StepEvent)]
    assert any(e.preempted for e in steps)
    shared = [owners_at(driver_events, e.index) for e in steps[::5]]
    assert any(len(o) > 1 for snap in shared for o in snap.values())


def test_seek_equals_a_linear_fold_and_the_independent_fold(driver_events: list) -> None:
    timeline = Timeline(driver_events, checkpoint_every=7)
    for position in (0, 6, 7, 8, 30, len(timeline) - 1, 13, 2):
        view = timeline.seek(position)
        index = timeline.step_indices[position]
        linear = EngineView().fold(driver_events[: timeline.step_positions[position] + 1])
        assert view.step == index
        assert view.snapshot() == linear.snapshot()
        expected = owners_at(driver_events, index)
        assert {b: frozenset(o) for b, o in view.block_owners.items()} == expected


def test_step_forward_matches_seek() -> None:
    timeline = Timeline(read_events(SAMPLE).events, checkpoint_every=50)
    timeline.seek(120)
    for _ in range(15):
        timeline.step_forward()
    forward = timeline.view.snapshot()
    assert timeline.seek(135).snapshot() == forward


def test_snapshot_round_trips_through_json_and_a_snapshot_event() -> None:
    events = read_events(SAMPLE).events
    view = EngineView().fold(events[: len(events) // 2])
    state = json.loads(json.dumps(view.snapshot()))
    restored = EngineView.from_snapshot(state)
    assert restored.snapshot() == view.snapshot()
    via_event = EngineView()
    via_event.apply(SnapshotEvent(state=state))
    assert via_event.block_owners == view.block_owners
    # Folding on from the snapshot gives the same end state as never stopping.
    rest = events[len(events) // 2 :]
    assert restored.fold(rest).snapshot() == view.fold(rest).snapshot()


def test_snapshot_rejects_a_newer_version() -> None:
    with pytest.raises(ValueError, match="newer"):
        EngineView.from_snapshot({"version": 99})


def test_startup_phases_and_memory_ledger_from_sample() -> None:
    view = EngineView().fold(e for e in read_events(SAMPLE).events if not isinstance(e, StepEvent))
    # A simulated startup: every phase ends except F, skipped with its reason (no CUDA graphs).
    assert [view.phases[p].status for p in "ABCDEFG"] == ["end"] * 5 + ["skipped", "end"]
    assert "CUDA graphs" in (view.phases["F"].reason or "")
    assert view.ledger["num_blocks"] == 384
    assert view.ledger["weights_bytes"] > 0 and view.ledger["kv_pool_bytes"] > 0
    assert view.phases["C"].memory_delta == view.ledger["weights_bytes"]


def test_timeline_navigation_targets(tmp_path: Path) -> None:
    timeline = Timeline(read_events(SAMPLE).events, checkpoint_every=50)
    first = timeline.next_preemption()
    assert first is not None
    assert timeline.seek(first).series["preempted"][-1] > 0
    arrival = timeline.next_arrival()
    assert arrival is not None and arrival > 0
    assert timeline.position_of_index(10**9) == len(timeline) - 1
    bus = EventBus()  # an empty recording still gives a view
    assert Timeline([]).view.step is None and bus.has_subscribers is False


def test_computed_and_generated_tokens_are_the_schedulers_own_every_step() -> None:
    """vLLM counts prefix-cache hits as computed (num_computed_tokens); so does the
    view, on first admission and on resumption after a preemption."""
    from engine.core.scheduler import SchedulerConfig
    from engine.events import EngineConfigEvent
    from engine.sim.driver import DriverRequest, run_driver

    config = SchedulerConfig(num_blocks=36, max_num_seqs=8, max_num_batched_tokens=96)
    shared = list(range(100, 164))  # 4 full blocks every request starts with
    requests = [
        DriverRequest(f"r{i:02d}", shared + [i] * (10 + 7 * (i % 5)), output_tokens=40 + 9 * (i % 4), arrival_step=i)
        for i in range(24)
    ]
    bus = EventBus()
    view = EngineView()
    bus.subscribe(view.apply)
    bus.publish(EngineConfigEvent(config={"block_size": config.block_size}))
    checked = {"hits": 0, "resumed_hits": 0, "steps": 0}

    def compare(sched, out) -> None:  # type: ignore[no-untyped-def]
        checked["steps"] += 1
        for rid, req in sched.requests.items():
            shown = view.requests[rid]
            assert (shown.computed_tokens, shown.generated_tokens) == (
                req.num_computed_tokens, req.num_output_tokens), (out.step_index, rid)
            if shown.prefix_hit_tokens and shown.state == "running":
                checked["hits"] += 1
        for item in out.scheduled:
            rid = item.request.request_id
            if rid in out.resumed_req_ids and rid in view.requests:
                checked["resumed_hits"] += view.requests[rid].computed_tokens > item.num_tokens

    run_driver(requests, config, bus=bus, on_step=compare)
    assert checked["steps"] > 50 and checked["hits"] > 0
    assert checked["resumed_hits"] > 0, "a resumption must start from its prefix hits"
    assert view.preemptions > 0
