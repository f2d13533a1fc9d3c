"""The stall detector on a real engine (the bundled SmolLM2, in this process) whose forward
the test slows by moving an injected clock (engine/heartbeat.py, engine/serve/stall.py):
a prefill far longer than the profile run's step is no stall, a decode step longer than
ten times the longest step seen is one: ``engine.stalled`` names rank 0, the forward and the
request, ``/health``'s body says the same, and the dump beside the recording holds the
engine thread's stack (in the test's own slowed forward), the last step event and the
request's blocks; the step's end publishes ``engine.recovered``. No sleeps: the clock moves
only when the test says."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.events import EventBus, read_events
from engine.events.engine_records import EngineRecovered, EngineStalled
from engine.heartbeat import Beat, Heartbeat
from engine.llm_engine import LLMEngine
from engine.modelspec.presets import bundled_gguf_path
from engine.serve.shared_folds import LockedView
from engine.serve.stall import FLOOR_S, CoreWatch, StallDetector, derived_limit
from engine.stacks import thread_stacks

pytestmark = pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")

PROFILE_STEP_S = 2.0  # as if phase D's worst-case step took 2 s: the limit starts at 10 x 2 s
PREFILL_S = 15.0  # the prefill: 7.5 x the profile's step, under the limit of 20 s
HANG_S = 200.0  # a decode step: over 10 x the longest step seen (the prefill's 15 s)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _beat(**fields: Any) -> Beat:
    base = dict(steps=0, last_beat=0.0, step_started=None, phase="idle", waiting=0, running=0, scheduled=0,
                last_step_s=0.0, longest_step_s=0.0, expected_step_s=0.0, pid=1)
    return Beat(**{**base, **fields})  # type: ignore[arg-type]


def test_the_default_limit_is_ten_of_the_longest_step_and_never_under_the_floor() -> None:
    assert derived_limit(_beat(expected_step_s=0.4)) == FLOOR_S
    assert derived_limit(_beat(expected_step_s=5.0)) == 50.0
    assert derived_limit(_beat(expected_step_s=5.0, longest_step_s=12.0)) == 120.0


def test_a_slowed_forward_trips_the_detector_and_a_long_prefill_does_not(tmp_path: Path) -> None:
    clock = Clock()
    bus = EventBus()
    view = LockedView()
    bus.subscribe(view)
    path = tmp_path / "run.jsonl"
    config = EngineConfig(model="smollm2-135m", events_path=str(path), max_model_len=512,
                          kv_cache_memory_bytes=32 * 2**20, max_num_batched_tokens=512, max_num_seqs=4,
                          stats_interval=0.0)
    engine = LLMEngine(config, bus=bus, heartbeat=Heartbeat(clock=clock))
    try:
        engine.heartbeat.set_expected_step(PROFILE_STEP_S)
        core = CoreWatch(0, engine.heartbeat, lambda: 0, view.snapshot, bus.publish, thread_stacks, str(path))
        bus.subscribe(core.last_step)
        detector = StallDetector([core], None, clock=clock, floor_s=1.0)
        off = StallDetector([core], 0.0, clock=clock)  # --stall-timeout 0
        delays: list[float] = []
        seen: list[tuple[Beat, list[Any], dict[str, Any] | None]] = []
        real = engine.runner.execute

        def slowed_forward(batch: Sequence[Any]) -> dict[str, int]:
            out = real(batch)
            clock.t += delays.pop(0)
            assert off.check() == []
            seen.append((engine.heartbeat.read(), detector.check(), detector.health()))  # as its thread would, mid-step
            return out

        engine.runner.execute = slowed_forward  # type: ignore[method-assign]
        rid = engine.add_request(list(range(100, 300)), SamplingParams(max_tokens=3, ignore_eos=True))

        delays.append(PREFILL_S)
        engine.step()  # the whole 200-token prompt in one step
        beat, events, health = seen[-1]
        assert beat.in_step and beat.phase == "forward" and beat.scheduled == 1
        assert events == [] and health is None  # 15 s against a limit of 10 x 2 s
        assert engine.heartbeat.read().longest_step_s == pytest.approx(PREFILL_S)
        assert detector.check() == []

        delays.append(HANG_S)
        engine.step()  # a decode step that does not come back for 200 s
        beat, events, health = seen[-1]
        assert [type(e) for e in events] == [EngineStalled]
        stalled = events[0]
        assert (stalled.rank, stalled.phase, stalled.requests) == (0, "forward", [rid])
        assert stalled.stalled_s == pytest.approx(HANG_S) and stalled.limit_s == pytest.approx(10 * PREFILL_S)
        assert stalled.last_step == 0  # the prefill's step finished; the decode's did not
        assert health is not None and health["error"] == "engine_stalled" and health["rank"] == 0
        assert health["phase"] == "forward" and [r["id"] for r in health["requests"]] == [rid]
        dump = json.loads(Path(stalled.dump or "").read_text())
        assert Path(stalled.dump or "").parent == tmp_path  # beside the recording
        assert any("slowed_forward" in stack for stack in dump["stacks"].values())
        assert dump["last_step"]["index"] == 0 and dump["last_step"]["type"] == "step"
        assert dump["requests"][rid]["state"] == "running" and dump["requests"][rid]["blocks"]

        recovered = detector.check()  # the step came back
        assert [type(e) for e in recovered] == [EngineRecovered] and detector.health() is None
        assert recovered[0].stalled_s == pytest.approx(HANG_S)
        # the stalled step is no yardstick: the limit stays 10 x the prefill
        assert engine.heartbeat.read().longest_step_s == pytest.approx(PREFILL_S)
    finally:
        engine.close()
    kinds = [e.type for e in read_events(path).events]
    assert kinds.index("engine.stalled") < kinds.index("engine.recovered")
