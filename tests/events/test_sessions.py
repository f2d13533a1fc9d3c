"""Sessions (engine/events/folds/sessions.py) on a scripted multi-turn workload through the real
scheduler: three agent sessions of five turns, each turn's prompt the previous turn's whole
context (prompt and answer) plus a new message, sent when the previous turn finished, with
long unrelated requests between turns. In a large pool every turn finds the previous turn's
blocks resident; in a small one the unrelated requests' allocations evict them, and the fold
names each lost block's taker and step, which the recorded step events confirm. The
doctor's ``session_context_lost`` fires there, and its pool fix, re-run, keeps every context.
``engine replay --session`` prints the same fold from a recording."""

from __future__ import annotations

from pathlib import Path

import pytest

from doctor.facts import RunFacts
from doctor.rules.requests import session_context_lost
from engine.cli.main import main as engine_main
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.events import EngineConfigEvent, Event, EventBus, StepEvent
from engine.events.folds.sessions import SessionFold
from engine.events.recording import JsonlSink
from engine.sim.driver import SAMPLED_TOKEN_ID, driver_step

BLOCK = 16
SESSIONS = ("agent-a", "agent-b", "agent-c")
TURNS = 5
ANSWER = 24  # tokens each turn generates


def run_sessions(num_blocks: int, bus: EventBus) -> None:
    """Each session's next turn is sent two steps after its previous turn finished; between turns
    a 200-token unrelated request per session churns the pool."""
    config = SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=256,
                             max_model_len=1024)
    sched = Scheduler(config, bus)
    context = {key: [1000 * (i + 1) + k for k in range(40)] for i, key in enumerate(SESSIONS)}  # system prompts
    turn = dict.fromkeys(SESSIONS, 0)
    live: dict[str, Request] = {}
    due: dict[str, int] = dict.fromkeys(SESSIONS, 0)  # step at which a session's next turn is sent
    noise = 0
    for step in range(3000):
        for key in SESSIONS:
            if due.get(key) == step:
                turn[key] += 1
                message = [50_000 + 100 * turn[key] + k for k in range(30)]
                prompt = context[key] + message
                req = Request(f"{key}-t{turn[key]}", prompt, ANSWER, ignore_eos=True, arrival_time=float(step),
                              sampling=SamplingParams(max_tokens=ANSWER, session=key))
                sched.add_request(req, float(step))
                live[key] = req
                del due[key]
                noise += 1  # an unrelated long request alongside each turn
                sched.add_request(Request(f"other-{noise}", [90_000 + 1000 * noise + k for k in range(200)], 40,
                                          ignore_eos=True, arrival_time=float(step)), float(step))
        if not sched.has_unfinished() and not due:
            return
        if sched.has_unfinished():
            driver_step(sched, bus, float(step))
        for key, req in list(live.items()):
            if req.is_finished:
                context[key] = req.prompt_token_ids + [SAMPLED_TOKEN_ID] * ANSWER
                if turn[key] < TURNS:
                    due[key] = step + 2
                del live[key]
    raise AssertionError("the workload did not finish")


def fold_run(num_blocks: int) -> tuple[SessionFold, RunFacts, list[Event]]:
    events: list[Event] = []
    bus = EventBus(clock=lambda: 0.0)
    fold, facts = SessionFold(), RunFacts()
    for sink in (events.append, fold, facts):
        bus.subscribe(sink)
    bus.publish(EngineConfigEvent(config={"block_size": BLOCK, "num_gpu_blocks_override": num_blocks}))
    run_sessions(num_blocks, bus)
    return fold, facts, events


def test_a_large_pool_keeps_every_turns_context() -> None:
    fold, facts, _ = fold_run(num_blocks=400)
    assert sorted(fold.sessions) == sorted(SESSIONS)
    for session in fold.sessions.values():
        assert [t.index for t in session.turns] == list(range(1, TURNS + 1))
        first, *later = session.turns
        assert first.prev_blocks is None and first.previous is None
        for turn in later:
            assert turn.prev_blocks and turn.resident == turn.prev_blocks and not turn.lost, turn.to_dict()
            # the previous context's full blocks all hit (the last, partly filled one never does)
            assert turn.hit_tokens == turn.prev_blocks * BLOCK
            assert not turn.context_lost
    assert list(session_context_lost(facts)) == []


def test_a_small_pool_loses_contexts_and_names_who_evicted_them() -> None:
    fold, facts, events = fold_run(num_blocks=40)
    steps = {e.index: e for e in events if isinstance(e, StepEvent)}
    lost_turns = fold.lost_turns()
    assert lost_turns, "the small pool lost no context: the test does not exercise eviction"
    for _session, turn in lost_turns:
        assert turn.lost and turn.resident is not None and turn.prev_blocks is not None
        assert turn.resident + len(turn.lost) == turn.prev_blocks
        assert (turn.hit_tokens or 0) <= turn.resident * BLOCK
        for lost in turn.lost:
            step = steps[lost.step]  # the recorded step confirms the fold: evicted there, handed to the taker
            assert lost.block in step.evicted
            assert lost.block in step.allocated[lost.by_request]
            assert lost.by_request != turn.request_id
    rendered = lost_turns[0][0].render()
    assert "CONTEXT LOST" in rendered and "evicted at step" in rendered

    findings = list(session_context_lost(facts))
    assert len(findings) == 1
    finding = findings[0]
    override = next(f for f in finding.fixes if f.flag == "--num-gpu-blocks-override")
    assert override.current == 40 and override.proposed > 40
    # the fix in numbers: the same workload on the proposed pool loses far fewer contexts; a bigger
    # pool admits more at once, so the doctor on that run may ask for a little more, and then none is lost
    fixed, fixed_facts, _ = fold_run(num_blocks=int(override.proposed))
    assert len(fixed.lost_turns()) <= len(lost_turns) // 4
    again = [f for finding in session_context_lost(fixed_facts) for f in finding.fixes
             if f.flag == "--num-gpu-blocks-override"]
    if again:
        assert again[0].proposed > override.proposed
        final, final_facts, _ = fold_run(num_blocks=int(again[0].proposed))
        assert final.lost_turns() == [] and list(session_context_lost(final_facts)) == []


def test_replay_prints_a_sessions_turns_from_a_recording(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sessions.jsonl"
    sink = JsonlSink(path, {"block_size": BLOCK})
    bus = EventBus(clock=lambda: 0.0)
    bus.subscribe(sink)
    run_sessions(40, bus)
    sink.close()
    assert engine_main(["replay", str(path), "--session", "agent-b"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("session agent-b: 5 turns")
    assert "turn 2  agent-b-t2" in out and "blocks of agent-b-t1" in out
    assert engine_main(["replay", str(path), "--session", "agent-b", "--json"]) == 0
    assert '"session":"agent-b"' in capsys.readouterr().out
    assert engine_main(["replay", str(path), "--session", "nobody"]) == 2
    assert "no request of the recording names this session (3 sessions: agent-a" in capsys.readouterr().err
