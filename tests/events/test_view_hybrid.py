"""EngineView over a hybrid KV cache (issue 31): per request its blocks by group, per
block its group and whether a window (not a finish) released it, in the snapshot too,
and a resumed request's prefix hit read from a full-attention group's table.

Ground truth is the real scheduler of a simulated run: a bus subscriber compares the
view with ``Scheduler.requests`` after every step event."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.events import Event, EventBus, StepEvent
from engine.events.folds.view import EngineView
from engine.sim.simulate import Simulation, build_setup
from engine.sim.workload import WorkloadSpec, generate_workload
from tests.monitor.hybrid_fixtures import hybrid_state_at


def _run(layer_pattern: str | None, check: Any) -> tuple[list[Event], Simulation]:
    """Llama-3.1-8B's 32 layers (``layer_pattern`` 5:1: six sliding groups, one full) on a
    small pool: preemptions, shared prefixes, a 96-token window; ``check(sim, view, event)``
    after every step event."""
    engine = EngineConfig(max_model_len=2048, max_num_batched_tokens=512, max_num_seqs=8)
    kwargs: dict[str, Any] = {"layer_pattern": layer_pattern, "sliding_window": 96} if layer_pattern else {}
    setup = build_setup("llama-3.1-8b", engine=engine, num_gpu_blocks_override=300 if layer_pattern else 200,
                        **kwargs)
    bus = EventBus()
    sim = Simulation(setup, bus)
    view = EngineView()
    events: list[Event] = []

    def on_event(event: Event) -> None:
        events.append(event)
        view.apply(event)
        if isinstance(event, StepEvent):
            check(sim, view, event)

    bus.subscribe(on_event)
    spec = WorkloadSpec(24, (100, 700), (50, 200), arrival="poisson", rate=1.0, unit="step",
                        shared_prefix_fraction=0.5, shared_prefix_tokens=96, seed=3)
    result = sim.run(generate_workload(spec))
    assert result.finished == 24 and result.preemptions >= 2, "the workload no longer preempts"
    return events, sim


def _check_against_scheduler(sim: Simulation, view: EngineView, event: StepEvent) -> None:
    sched = sim.scheduler
    for rid, req in sched.requests.items():
        mine = view.requests.get(rid)
        if mine is None or mine.state != "running":
            continue
        assert mine.computed_tokens == req.num_computed_tokens, (event.index, rid)
        null = sched.kv.pool.null_block  # a window group's: stands where a window freed
        real = [[b for b in table if b != null] for table in req.block_tables]
        assert mine.group_blocks == real, (event.index, rid)  # one list with one group
        assert mine.blocks == [b for table in real for b in table]
        for g, table in enumerate(real):
            for b in table:
                assert view.block_groups[b] == g
    ref_cnt = sched.kv.pool.ref_cnt
    for b in view.window_freed:  # a block the map would draw as left by the window is free in the pool
        assert ref_cnt[b] == 0 or view.block_owners.get(b), (event.index, b)


def test_hybrid_view_matches_the_scheduler_after_every_step() -> None:
    events, _ = _run("5:1", _check_against_scheduler)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert any(s.resumed for s in steps), "no resumption: the hit estimate went untested"
    assert any(s.freed_by_window for s in steps)


def test_full_attention_view_is_unchanged_and_writes_no_group_entries() -> None:
    events, _ = _run(None, _check_against_scheduler)
    view = EngineView().fold(events[: len(events) // 2])
    snap = view.snapshot()
    assert "window_freed" not in snap and view.kv_cache_groups == []
    assert all("group_blocks" not in r for r in snap["requests"].values())


def test_snapshot_carries_groups_and_window_frees_and_resumes_the_fold() -> None:
    events, _ = _run("5:1", lambda *a: None)
    positions = [i for i, e in enumerate(events) if isinstance(e, StepEvent)]
    whole = EngineView().fold(events)
    for cut in positions[len(positions) // 4 :: max(1, len(positions) // 6)]:
        view = EngineView().fold(events[: cut + 1])
        step = events[cut]
        assert isinstance(step, StepEvent)
        plain = hybrid_state_at(events, step.index)
        window = plain.window_freed
        assert {rid: r.group_blocks for rid, r in view.requests.items() if r.group_blocks} == plain.tables
        assert view.window_freed == window and view.block_groups == plain.groups()
        snap = json.loads(json.dumps(view.snapshot()))
        assert snap.get("window_freed", []) == [[b, g] for b, g in sorted(window.items())]
        loaded = EngineView.from_snapshot(snap)
        assert loaded.snapshot() == snap
        assert loaded.block_groups == view.block_groups
        loaded.fold(events[cut + 1 :])  # a late subscriber folds on from the snapshot
        assert loaded.window_freed == whole.window_freed and loaded.finished == whole.finished


def test_a_snapshot_without_group_entries_loads_as_one_group() -> None:
    state = {"version": 1, "requests": {"r1": {"state": "running", "blocks": [3, 4]}}, "cached": [3]}
    view = EngineView.from_snapshot(state)
    assert view.requests["r1"].group_blocks == [[3, 4]] and view.block_groups == {3: 0, 4: 0}
    assert view.window_freed == {} and view.snapshot()["requests"]["r1"].get("group_blocks") is None
    assert view.block_owners == {3: {"r1"}, 4: {"r1"}}


@pytest.mark.parametrize("counts, expected", [([2, 2, 4], 48), ([1, 1, 1], 0)])
def test_a_resumed_hit_is_read_from_the_full_attention_group(counts: list[int], expected: int) -> None:
    """A resumed request with 16 new tokens: the full group (index 2) holds ceil((hit + 16) / 16)
    blocks while the windows hold fewer (null before them); reading the flat list's length
    would make the hit (8 * 16 - 16) = 112 tokens."""
    view = EngineView()
    view.config = {"block_size": 16, "kv_cache_groups": [
        {"kind": "sliding_window", "sliding_window": 32, "layers": [0]},
        {"kind": "sliding_window", "sliding_window": 32, "layers": [1]},
        {"kind": "full_attention", "sliding_window": None, "layers": [2]}]}
    view.requests["r"] = view._request("r")
    blocks = list(range(10, 10 + sum(counts)))
    view.apply(StepEvent(index=0, scheduled={"r": [16, "prefill"]}, resumed=["r"], allocated={"r": blocks},
                         allocated_groups={"r": counts}))
    assert view.requests["r"].computed_tokens == expected + 16


def test_a_window_release_is_forgotten_once_a_finish_or_an_allocation_releases_or_takes_the_block() -> None:
    """Block 5 is shared by a and b (group 0, a prefix hit): a's window lets it go while b
    still holds it, then b's finish frees it, so its last release is a finish; block 6 left
    a's window and is taken again by c."""
    view = EngineView()
    view.config = {"block_size": 16, "kv_cache_groups": [
        {"kind": "sliding_window", "sliding_window": 32, "layers": [0]},
        {"kind": "full_attention", "sliding_window": None, "layers": [1]}]}
    for rid in "abc":
        view._request(rid)
    view.apply(StepEvent(index=0, scheduled={"a": [48, "prefill"], "b": [48, "prefill"]},
                         allocated={"a": [5, 6, 7, 8, 9, 10], "b": [5, 11, 12, 13, 14, 15]},
                         allocated_groups={"a": [3, 3], "b": [3, 3]}))
    assert view.requests["b"].group_blocks == [[5, 11, 12], [13, 14, 15]] and view.block_groups[13] == 1
    view.apply(StepEvent(index=1, scheduled={"a": [1, "decode"]}, freed_by_window={"a": [5, 6]},
                         freed_by_window_groups={"a": [2, 0]}))
    assert view.requests["a"].group_blocks == [[7], [8, 9, 10]]
    assert view.window_freed == {5: 0, 6: 0} and view.block_owners[5] == {"b"}
    view.apply(StepEvent(index=2, scheduled={"c": [16, "prefill"]}, freed={"b": [5, 11, 12, 13, 14, 15]},
                         finished={"b": "length"}, allocated={"c": [6, 16]}, allocated_groups={"c": [1, 1]}))
    assert view.window_freed == {}
    assert view.block_groups == {7: 0, 8: 1, 9: 1, 10: 1, 6: 0, 16: 1}
