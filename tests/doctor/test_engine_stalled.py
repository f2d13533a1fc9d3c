"""``engine_stalled``: the doctor names a stalled engine core from a recording's
``engine.stalled`` / ``engine.recovered`` (engine/serve/stall.py), from a live server's
snapshot that says a core is stalled now, and from a real vLLM's ``/metrics`` where an
engine reports requests running while its token counters stay frozen
(doctor/vllm_stall.py)."""

from __future__ import annotations

from pathlib import Path

from doctor.cli import examine
from doctor.facts import RunFacts
from doctor.rules.finding import CRITICAL, WARNING
from doctor.rules.registry import diagnose
from doctor.vllm_dp import EngineRound, VllmFleet
from doctor.vllm_stall import stall_findings
from engine.events import EventBus, SnapshotEvent, StepEvent, open_sink
from engine.events.engine_records import EngineRecovered, EngineStalled
from engine.events.folds.frozen_counters import FROZEN_S


def _record(path: Path, recovered: bool) -> None:
    t = [0.0]
    bus = EventBus(clock=lambda: t[0])
    sink = open_sink(path, {"model": "smollm2-135m"})
    bus.subscribe(sink)
    for index in range(4):
        t[0] += 0.05
        bus.publish(StepEvent(index=index, num_running=1, num_decode_tokens=1, duration_s=0.05))
    t[0] += 45.0
    bus.publish(EngineStalled(rank=0, phase="forward", stalled_s=45.0, limit_s=30.0, last_step=3,
                              num_running=1, requests=["cmpl-7"], dump=str(path.with_name("run.stall-dp0-x.json"))))
    if recovered:
        t[0] += 15.0
        bus.publish(EngineRecovered(rank=0, stalled_s=60.0, last_step=4))
    sink.close()


def test_a_recorded_stall_is_a_critical_finding_with_its_phase_requests_and_dump(tmp_path: Path) -> None:
    for recovered in (True, False):
        path = tmp_path / f"run-{recovered}.jsonl"
        _record(path, recovered)
        _, findings, _ = examine(str(path), simulate=False)
        stalls = [f for f in findings if f.rule == "engine_stalled"]
        assert len(stalls) == 1, [f.rule for f in findings]
        stall = stalls[0]
        assert stall.severity == CRITICAL and findings[0] is stall  # critical first
        assert stall.where == "rank 0, after step 3"
        assert stall.numbers["phase"] == "forward" and stall.numbers["stalled_s"] == 45.0
        assert stall.numbers["recovered_after_s"] == (60.0 if recovered else None)
        text = " ".join(stall.evidence)
        assert "cmpl-7" in text and "run.stall-dp0-x.json" in text
        assert ("stepped again after 60.0 s" in text) is recovered
        assert "forward did not return" in stall.cause


def test_a_live_snapshot_that_says_a_core_is_stalled_now_is_a_finding() -> None:
    facts = RunFacts()
    facts(SnapshotEvent(state={"stalled": {"1": {"phase": "idle", "stalled_s": 33.0, "limit_s": 30.0,
                                                 "last_step": 12, "t": 5.0, "dump": None}}}))
    findings = [f for f in diagnose(facts) if f.rule == "engine_stalled"]
    assert [(f.numbers["rank"], f.numbers["phase"]) for f in findings] == [(1, "idle")]
    assert "engine loop stopped turning" in findings[0].cause


def _fleet(tokens_by_t: list[tuple[float, int, float]]) -> VllmFleet:
    return VllmFleet("metrics", [EngineRound(t, {0: (0, running, 0.5)}, i + 1, None, {}, {0: tokens})
                                 for i, (t, running, tokens) in enumerate(tokens_by_t)])


def test_vllm_metrics_with_running_requests_and_frozen_counters_are_a_stall() -> None:
    moving = [(float(t), 4, 1000.0 + 30 * t) for t in range(0, 20)]
    frozen = [(float(t), 4, 1000.0 + 30 * 19) for t in range(20, 20 + int(FROZEN_S) + 5)]
    findings = stall_findings(_fleet(moving + frozen), duration_s=len(moving + frozen))
    assert [(f.rule, f.severity) for f in findings] == [("engine_stalled", CRITICAL)]
    assert findings[0].numbers["running"] == 4 and findings[0].numbers["frozen_s"] >= FROZEN_S
    assert "Engine 000" in findings[0].title
    assert stall_findings(_fleet(moving), duration_s=20.0) == []  # tokens flow: no stall
    idle = [(float(t), 0, 1570.0) for t in range(0, 30)]
    assert stall_findings(_fleet(idle), duration_s=30.0) == []  # frozen, but nothing runs
    # a 10 s sample frozen throughout: a warning (a prefill that long freezes them too)
    short = stall_findings(_fleet([(float(t), 2, 800.0) for t in range(0, 11)]), duration_s=10.0)
    assert [f.severity for f in short] == [WARNING] and "--duration" in short[0].cause
