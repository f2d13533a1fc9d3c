"""The doctor names the request (issue 33): a stuck engine's head request and why, with
the fix in numbers; --max-num-seqs held by requests that get no tokens; prefix-cache
misses by cause; one request thrashing through preemptions.

kvscope's own scheduler refuses a request that can never fit its pool on arrival, and
serves every running request before admitting more, so the first two situations are
recorded here as vLLM's scheduler produces them (vllm#39734: a request over the KV pool
but within --max-model-len waits forever at the head of the queue; vllm#53130: slots held
by requests that do no work), as the events a recording of them holds."""

from __future__ import annotations

from pathlib import Path

from doctor.facts import RunFacts
from doctor.inputs import facts_from_recording
from doctor.rules.finding import CRITICAL
from doctor.rules.registry import diagnose
from engine.core.scheduler import SchedulerConfig
from engine.events import (
    EngineConfigEvent,
    Event,
    EventBus,
    JsonlSink,
    RequestArrived,
    StartupPhase,
    StepEvent,
)
from engine.events.phase_data import KvCacheData
from tests.events.test_request_lifecycle import drive, ids

BLOCK = 16


def facts_of(events: list[Event]) -> RunFacts:
    facts = RunFacts()
    for event in events:
        facts(event)
    return facts


def vllm_39734_recording(path: Path) -> Path:
    """r7's 2,064-token prompt needs 129 blocks of a 128-block pool while --max-model-len is
    4,096: it waits at the head of the queue, nothing runs, r8 and r9 wait behind it."""
    t = [0.0]
    bus = EventBus(clock=lambda: t[0])
    config = {"block_size": BLOCK, "max_model_len": 4096, "max_num_seqs": 8, "enable_prefix_caching": True}
    sink = JsonlSink(path, config=config)
    bus.subscribe(sink)
    bus.publish(EngineConfigEvent(config=config))
    bus.publish(StartupPhase(phase="E", name="kv_cache", status="end",
                             data=KvCacheData(num_blocks=128, block_size=BLOCK, kv_cache_tokens=128 * BLOCK).to_dict()))
    for rid, prompt in (("r7", 2064), ("r8", 100), ("r9", 300)):
        bus.publish(RequestArrived(request_id=rid, prompt_tokens=prompt, max_tokens=16))
    for index in range(30):
        t[0] += 0.5
        bus.publish(StepEvent(index=index, num_waiting=3, kv_blocks_total=128, waiting_reasons={
            "r7": ["never_fits", 129, 128], "r8": ["behind", "r7"], "r9": ["behind", "r7"]}))
    sink.close()
    return path


def test_a_stuck_engine_names_the_request_that_can_never_be_admitted(tmp_path: Path) -> None:
    findings = diagnose(facts_from_recording(vllm_39734_recording(tmp_path / "vllm_39734.jsonl")))
    (finding,) = [f for f in findings if f.rule == "stuck_engine"]
    assert finding.severity == CRITICAL and finding.where == "steps 0–29"
    assert finding.title == "stuck engine: r7 needs 129 blocks and the pool has 128 in total: it can never be admitted"
    assert "the head of the queue is r7 since step 0: can never fit: needs 129 blocks, the pool has 128 in total" \
        in finding.evidence
    assert "2 requests wait behind it" in finding.evidence
    assert [f.text().split(":")[0] for f in finding.fixes][:2] == ["--max-model-len 4096 -> 2048",
                                                                   "--num-gpu-blocks-override 128 -> 129"]


def test_max_num_seqs_held_by_requests_that_get_no_tokens() -> None:
    """vllm#53130's shape: 4 slots taken, 2 of their requests given no token step after
    step, r5 waiting for a slot."""
    events: list[Event] = [EngineConfigEvent(config={"max_num_seqs": 4, "max_num_batched_tokens": 2})]
    events.append(StepEvent(index=0, new=["r1", "r2", "r3", "r4"], num_running=4, num_waiting=1,
                            scheduled={"r1": [1, "prefill"], "r2": [1, "prefill"]},
                            waiting_reasons={"r5": ["max_num_seqs", 4]}))
    events += [StepEvent(index=i, num_running=4, num_waiting=1, scheduled={"r1": [1, "decode"], "r2": [1, "decode"]},
                         waiting_reasons={"r5": ["max_num_seqs", 4]}) for i in range(1, 8)]
    (finding,) = [f for f in diagnose(facts_of(events)) if f.rule == "seqs_held_by_deferred"]
    assert finding.where == "steps 0–7"
    assert "held a slot and did no work: r3 (8 steps), r4 (8 steps)" in finding.evidence
    assert "meanwhile r5 waited at the head of the queue: --max-num-seqs reached: all 4 sequence slots taken" \
        in finding.evidence
    assert [f.text().split(":")[0] for f in finding.fixes] == ["--max-num-seqs 4 -> 6", "--max-num-batched-tokens 2 -> 4"]


def test_prompts_shorter_than_a_block_are_the_misses_cause() -> None:
    """vllm#54607: a 12-token shared prompt never hits with 16-token blocks."""
    config = SchedulerConfig(num_blocks=64, block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=256,
                             max_model_len=1024)
    events = drive(config, {i: [(f"p{i}", ids(1, 12), 4, 0)] for i in range(6)})
    (finding,) = [f for f in diagnose(facts_of(events)) if f.rule == "prefix_miss_causes"]
    assert finding.evidence[0] == "6 prefix-cache lookups: 6 short_prompt (100%)"
    assert "the prompt (12–12 tokens) is shorter than one 16-token block" in finding.evidence[1]
    assert finding.fixes[0].text().startswith("--block-size 16 -> 8")


def test_one_request_thrashing_through_preemptions_is_named() -> None:
    config = SchedulerConfig(num_blocks=10, block_size=BLOCK, max_num_seqs=6, max_num_batched_tokens=64,
                             max_model_len=1024)
    events = drive(config, {0: [(f"t{i}", ids(1000 * i + 7, 30), 40 + 10 * i, 0) for i in range(5)]})
    findings = diagnose(facts_of(events))
    (finding,) = [f for f in findings if f.rule == "request_thrashing"]
    assert finding.title == "t4 thrashes: preempted 3 times"
    assert finding.evidence[1] == "step 3: kv_full for t0, holding 2 blocks and 30 computed tokens"
    assert finding.numbers["tokens_recomputed"] == 130
    assert all(f.severity != CRITICAL or f.rule == "pool_binds" for f in findings)
