"""Bounded torch profiles (engine/profiling.py) on a real engine's steps: unique trace names,
a step or time limit that stops the profile by itself, and the default cap for a profile
nobody stops. The steps are driven here, one ``engine.step()`` at a time; time is an
injected clock."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import profiling
from engine.core.sampling_params import SamplingParams
from engine.errors import UserError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.profiling import ProfileLimits, TorchProfiler


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(load_format="dummy", max_model_len=256, kv_cache_memory_bytes=1 << 24, stats_interval=0.0,
             dtype="float32") as engine:
        yield engine


def _steps_until_stopped(engine: LLMEngine, profiler: TorchProfiler, max_tokens: int = 12) -> int:
    """Steps one request through, one step at a time; the number of steps after which the
    profiler stopped (0: it was still running at the end)."""
    engine.add_request(list(range(10, 20)), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    steps, stopped_after = 0, 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if not profiler.running and not stopped_after:
            stopped_after = steps
    return stopped_after


def test_ten_start_stop_cycles_leave_ten_trace_files(llm: LLM, tmp_path: Path) -> None:
    profiler = TorchProfiler(str(tmp_path))
    written = []
    for _ in range(10):  # all within the same second: the names must still differ
        profiler.start(llm.engine)
        written.append(profiler.stop())
    assert len(set(written)) == 10
    assert sorted(str(p) for p in tmp_path.glob("kvscope-torch-profile-*.json")) == sorted(written)


def test_a_step_limit_stops_the_profile_after_that_many_steps(llm: LLM, tmp_path: Path) -> None:
    profiler = TorchProfiler(str(tmp_path))
    profiler.start(llm.engine, ProfileLimits.parse({"max_steps": "3"}))
    assert _steps_until_stopped(llm.engine, profiler) == 3
    assert profiler.stopped_itself is not None and "max_steps=3" in profiler.stopped_itself
    trace = Path(profiler.stop())  # /stop_profile after it stopped itself: the trace it wrote
    assert any("aten::" in str(e.get("name", "")) for e in json.loads(trace.read_text())["traceEvents"])
    with pytest.raises(UserError, match="not running"):  # that answer is given once
        profiler.stop()
    _steps_until_stopped(llm.engine, profiler, max_tokens=2)  # later steps write nothing more
    assert list(tmp_path.glob("*.json")) == [trace]


def test_the_default_cap_stops_a_forgotten_profile(llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiling, "DEFAULT_MAX_STEPS", 4)  # the real cap is 1,000 steps: too long for a test
    profiler = TorchProfiler(str(tmp_path))
    profiler.start(llm.engine)  # no limit asked for
    assert _steps_until_stopped(llm.engine, profiler) == 4
    assert "default cap" in (profiler.stopped_itself or "")
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_a_time_limit_is_counted_on_the_profilers_clock(llm: LLM, tmp_path: Path) -> None:
    now = [100.0]
    profiler = TorchProfiler(str(tmp_path), clock=lambda: now[0])
    profiler.start(llm.engine, ProfileLimits.capped(max_seconds=5.0))
    engine = llm.engine
    engine.add_request(list(range(10, 20)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()
    now[0] = 104.0
    engine.step()
    assert profiler.running  # 4 s of 5
    now[0] = 105.5
    engine.step()
    assert not profiler.running and "max_seconds=5" in (profiler.stopped_itself or "")
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("values", [{"max_steps": "0"}, {"max_steps": "many"}, {"max_steps": "2.5"}, {"max_steps": 2.5},
                                    {"max_seconds": "-1"}, {"max_seconds": "inf"}, {"max_steps": True}])
def test_a_bad_limit_says_what_to_send(values: dict[str, object]) -> None:
    name = next(iter(values))
    with pytest.raises(UserError, match=f"{name}=.*give .* above 0, e.g. {name}="):
        ProfileLimits.parse(values)


def test_limits_cross_to_a_data_parallel_core_and_back() -> None:
    asked = ProfileLimits.parse({"max_steps": 7})
    assert ProfileLimits.from_dict(asked.to_dict()) == asked
    assert ProfileLimits.from_dict(None) == ProfileLimits.capped() and ProfileLimits.capped().default
