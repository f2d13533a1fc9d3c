"""A hybrid KV cache in the simulator: ``engine simulate --layer-pattern 5:1`` runs the
hybrid manager, its recording names the groups, ``engine replay --verify`` holds for it,
the KV events name each group's spec, and the window frees blocks while requests run.

The Llama-3.1-8B workload shares no prefix. The Gemma 3 270M ones share one: there a sliding
window can cut a request's first hit short of (or down from) what the full-attention groups
held, and replay rebuilds that longer sharing from the step event's ``prefix_lookups``
(engine/sim/replay.py's ``_WindowShares``); checked on a fresh recording and on
tests/data/monitor_hybrid.jsonl, which stopped at step 154 before."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.cli import main
from engine.config import EngineConfig
from engine.core.single_type_kv_cache import SlidingWindowManager
from engine.events import EngineConfigEvent, EventBus, JsonlSink, StepEvent, read_events
from engine.events.exporters.kv_events import BlockRemoved, BlockStored, KVEventFold
from engine.events.folds.block_table import fold_step_events
from engine.sim.replay import Replayer, load_recording, window_cut_shares
from engine.sim.simulate import Simulation, build_setup
from engine.sim.workload import WorkloadSpec, generate_workload
from tests.paths import DATA

WINDOW = 512
# tests/data/monitor_hybrid.jsonl's command (tests/monitor/hybrid_fixtures.py) without its seed
GEMMA_SHARED_PREFIX = (  # noqa: SIM905 - as a person types it
    "simulate --model gemma-3-270m --layer-pattern 5:1 --sliding-window 128 --num-gpu-blocks-override 384 "
    "--max-model-len 2048 --max-num-seqs 8 --max-num-batched-tokens 512 --num-prompts 16 "
    "--random-input-len 100:600 --random-output-len 40:160 --arrival poisson --request-rate 0.25 "
    "--arrival-unit step --shared-prefix-fraction 0.5 --shared-prefix-len 128"
).split()


@pytest.fixture(scope="module")
def hybrid_recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-3.1-8B's 32 layers laid out as Gemma 3's five sliding then one full, on a pool
    small enough to preempt, with KV events recorded."""
    engine = EngineConfig(max_model_len=8192, max_num_batched_tokens=2048,
                          kv_events_config={"enable_kv_cache_events": True, "publisher": "null"})
    setup = build_setup(engine=engine, num_gpu_blocks_override=1500, layer_pattern="5:1", sliding_window=WINDOW)
    assert len(setup.scheduler.kv_cache_groups) == 7  # 27 sliding layers in groups of 5 (6 groups), 5 full
    path = tmp_path_factory.mktemp("hybrid") / "hybrid.jsonl"
    bus = EventBus()
    sink = JsonlSink(path, config=setup.recording_config())
    bus.subscribe(sink)
    spec = WorkloadSpec(40, (200, 2500), (200, 800), arrival="poisson", rate=30.0, unit="s",
                        shared_prefix_fraction=0.0, seed=7)
    sim = Simulation(setup, bus, stats_interval=1.0)
    assert sum(isinstance(m, SlidingWindowManager) for m in sim.scheduler.kv.coordinator.managers) == 6
    result = sim.run(generate_workload(spec))
    sink.close()
    assert result.finished == 40 and result.preemptions > 0
    return path


def test_replay_verifies_a_hybrid_recording(hybrid_recording: Path) -> None:
    rec = load_recording(hybrid_recording)
    replayer = Replayer(rec)
    assert len(replayer.scheduler.kv.groups) == 7  # engine.config's groups: the same manager
    report = replayer.run()
    assert report.ok, replayer.render_divergence(report.divergence)  # type: ignore[arg-type]


@pytest.mark.parametrize("recording", ["fresh", "committed"])
def test_replay_rebuilds_sharing_a_sliding_window_cut_short(recording: str, tmp_path: Path) -> None:
    """Shared-prefix requests whose first hit a window cut short (to 0 here) still share the
    prefix: replay gives them its tokens, so the window groups' blocks they write, or find
    held already, are the recorded ones. Before, replay took their prompts as unshared and
    stopped at the first such admission (step 154 of the committed recording)."""
    path = DATA / "monitor_hybrid.jsonl"
    if recording == "fresh":
        path = tmp_path / "shared.jsonl"
        assert main([*GEMMA_SHARED_PREFIX, "--workload-seed", "2", "--events", str(path)]) == 0
    replayer = Replayer(load_recording(path))
    assert window_cut_shares(replayer.steps), "no window cut a first hit short: the test checks nothing"
    report = replayer.run()
    assert report.ok, replayer.render_divergence(report.divergence)  # type: ignore[arg-type]
    assert report.steps_replayed == report.steps_recorded


def test_the_window_frees_blocks_of_running_requests_and_the_fold_keeps_them_apart(hybrid_recording: Path) -> None:
    events = read_events(hybrid_recording).events
    steps = [e for e in events if isinstance(e, StepEvent)]
    window_freed = [b for s in steps for blocks in s.freed_by_window.values() for b in blocks]
    assert window_freed, "no block ever left a window"
    for s in steps:  # a block left by the window is never also freed by a finish in that step
        for rid, blocks in s.freed_by_window.items():
            assert not set(blocks) & set(s.freed.get(rid, ()))
        for rid, counts in s.allocated_groups.items():
            assert sum(counts) == len(s.allocated[rid]) and len(counts) == 7
    state = fold_step_events(events)
    assert state.tables == {} and state.group_tables == {}
    assert state.window_freed  # some free blocks were last released by a window


def test_kv_events_name_each_groups_spec(hybrid_recording: Path) -> None:
    events = read_events(hybrid_recording).events
    config = next(e for e in events if isinstance(e, EngineConfigEvent))
    kinds = [g["kind"] for g in config.config["kv_cache_groups"]]
    assert kinds == ["sliding_window"] * 6 + ["full_attention"]
    fold = KVEventFold(clock=lambda: 0.0)
    stored: list[BlockStored] = []
    removed: list[BlockRemoved] = []
    for event in events:
        batch = fold.apply(event)
        if batch is not None:
            stored += [e for e in batch.events if isinstance(e, BlockStored)]
            removed += [e for e in batch.events if isinstance(e, BlockRemoved)]
    assert {e.group_idx for e in stored} == set(range(7))
    for e in stored:
        sliding = e.group_idx != 6
        assert e.kv_cache_spec_kind == ("sliding_window" if sliding else "full_attention")
        assert e.kv_cache_spec_sliding_window == (WINDOW if sliding else None)
    assert removed and all(e.group_idx is not None for e in removed)
