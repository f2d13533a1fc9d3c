"""A request's life folded from events (engine/events/folds/request_record.py, issue 33): a
scripted run of the real scheduler in which every waiting reason and every prefix-cache
stop cause occurs, each named by the timeline at the step it happened (never_fits cannot
occur here: the scheduler refuses such a request on arrival, and the timeline says so)."""

from __future__ import annotations

from engine.core.encoder_cache import MultimodalInput
from engine.core.kv_cache_groups import KVCacheSpec, group_layers
from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.step_loop import FixedTokenExecutor, run_step
from engine.events import Event, EventBus, read_events
from engine.events.folds.request_record import RequestRecord, lifecycle_of
from tests.paths import SAMPLES

Plan = dict[int, list[tuple[str, list[int], int, int]]]  # step -> (id, prompt, max_tokens, priority)


def drive(config: SchedulerConfig, plan: Plan, max_steps: int = 400) -> list[Event]:
    """The scheduler with the fixed-token executor; the clock is the step number."""
    events: list[Event] = []
    holder: list[Scheduler] = []
    sched = Scheduler(config, EventBus(clock=lambda: float(holder[0].step_index) if holder else 0.0))
    holder.append(sched)
    assert sched.bus is not None
    sched.bus.subscribe(events.append)
    for step in range(max_steps):
        for rid, prompt, out, priority in plan.get(step, []):
            request = Request(rid, prompt, out, ignore_eos=True, arrival_time=float(step), priority=priority)
            assert sched.submit(request, float(step)) is None
        if not sched.has_unfinished() and step > max(plan):
            break
        run_step(sched, FixedTokenExecutor(7), sched.bus, float(step))
    return events


def ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def said(life: RequestRecord, step: int, words: str) -> bool:
    """The timeline has a line at ``step`` containing ``words``."""
    return any(s == step and words in text for s, text in life.timeline())


SHARED = ids(1000, 40)  # 2 full blocks and 8 tokens


def fcfs_run() -> dict[str, RequestRecord]:
    config = SchedulerConfig(num_blocks=32, block_size=16, max_num_seqs=3, max_num_batched_tokens=128,
                             max_model_len=1024)
    plan: Plan = {
        0: [("short", ids(50, 10), 2, 0), ("a", SHARED, 2, 0)],
        4: [("b", SHARED, 2, 0), ("c", SHARED[:32], 2, 0), ("d", SHARED[:16] + ids(2000, 24), 2, 0)],
        8: [("t1", ids(3000, 128), 1, 0), ("t2", ids(3200, 128), 1, 0), ("t3", ids(3400, 128), 1, 0)],
        16: [(f"s{i}", ids(4000 + 100 * i, 10), 4, 0) for i in range(1, 5)],
        30: [("b1", ids(5000, 300), 120, 0), ("b2", ids(6000, 250), 10, 0), ("b3", ids(7000, 20), 2, 0)],
        80: [("e", SHARED, 2, 0)],
    }
    fold = lifecycle_of(drive(config, plan))
    return dict(fold.lives)


def test_every_prefix_stop_cause_is_named_at_its_admission() -> None:
    lives = fcfs_run()
    assert said(lives["short"], 0, "0 tokens reused; the prompt is shorter than one block")
    assert said(lives["a"], 0, "diverged from the longest cached chain at token 0")
    assert said(lives["b"], 4, "32 tokens reused; every full block hit")
    assert said(lives["c"], 4, "16 tokens reused; the match stopped before the last block: the last prompt token")
    assert said(lives["d"], 4, "16 tokens reused; diverged from the longest cached chain at token 16")
    # b1's blocks took SHARED's cached blocks while e waited: the block and the taker are named
    assert said(lives["e"], 153, "stopped at token 0: the next block was evicted at step 30 (block 1) for b1")
    # the evicting step really gave b1 that block, and it had been SHARED's first
    window = lifecycle_of(drive(
        SchedulerConfig(num_blocks=40, block_size=16, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024,
                        kv_cache_groups=group_layers([KVCacheSpec(None), KVCacheSpec(32)])),
        {0: [("w1", ids(9000, 100), 4, 0)], 8: [("fill", ids(20000, 232), 1, 0)],
         12: [("w2", ids(9000, 64) + ids(9500, 40), 2, 0)]}))
    assert said(window.lives["w2"], 12, "stopped at token 0 by the sliding window (full attention alone would reuse 64)")


def test_every_waiting_reason_is_named_at_its_steps() -> None:
    lives = fcfs_run()
    assert said(lives["t2"], 8, "waited 1 step: the step's token budget (128 tokens) was spent")
    assert said(lives["t3"], 8, "waited 2 steps (to step 9): the step's token budget")
    assert said(lives["s4"], 16, "waited 4 steps (to step 19): --max-num-seqs reached: all 3 sequence slots taken")
    b2 = lives["b2"]
    assert said(b2, 33, "a running request was preempted this step")
    assert said(b2, 33, "preempted (kv_full)") and said(b2, 36, "blocks short: needs 16, 13 free")
    assert said(b2, 152, "resumed; prefix cache: 80 tokens reused")
    assert said(lives["b3"], 36, "waited 116 steps (to step 151): behind b2, the head of the queue")
    priority = lifecycle_of(drive(
        SchedulerConfig(num_blocks=12, block_size=16, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024,
                        policy="priority"),
        {0: [("low", ids(100, 150), 30, 5)], 1: [("hi", ids(300, 100), 5, 0), ("lo2", ids(500, 20), 2, 9)]}))
    assert said(priority.lives["hi"], 1, "blocks short: needs 7, 2 free")
    assert said(priority.lives["lo2"], 1, "waited 29 steps (to step 29): a higher-priority request ahead (hi)")


def test_a_request_that_can_never_fit_is_refused_and_the_timeline_says_why() -> None:
    events: list[Event] = []
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=16, max_model_len=1024), EventBus(clock=lambda: 0.0))
    assert sched.bus is not None
    sched.bus.subscribe(events.append)
    sched.submit(Request("big", ids(3000, 200), 2, ignore_eos=True), 0.0)  # 13 blocks: more than the 8 there are
    life = lifecycle_of(events).lives["big"]
    assert life.state == "rejected" and "rejected: 202 tokens need 13 blocks but the KV pool has only 8" in life.render()


def test_an_encoder_input_over_the_budget_left_waits() -> None:
    config = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=512,
                             max_model_len=1024, encoder_compute_budget=100, encoder_cache_size=200)
    events: list[Event] = []
    sched = Scheduler(config, EventBus(clock=lambda: 0.0))
    assert sched.bus is not None
    sched.bus.subscribe(events.append)
    for rid, start in (("m1", 1000), ("m2", 2000)):
        sched.submit(Request(rid, ids(start, 120), 2, ignore_eos=True, mm_inputs=(MultimodalInput(0, 80),)), 0.0)
    for step in range(8):
        if sched.has_unfinished():
            run_step(sched, FixedTokenExecutor(7), sched.bus, float(step))
    m2 = lifecycle_of(events).lives["m2"]
    assert said(m2, 0, "encoder budget: its 80-token input does not fit the 20 tokens left this step")
    assert said(m2, 1, "admitted")


def test_a_recording_before_the_reasons_still_folds() -> None:
    """Old recordings (no waiting_reasons / prefix_lookups) fold: waits are 'unrecorded'."""
    events = read_events(SAMPLES / "smollm2_run.jsonl").events
    fold = lifecycle_of(events)
    finished = [life for life in fold.lives.values() if life.state == "finished"]
    assert finished and all(life.finish_step is not None for life in finished)
    preempted = next(life for life in fold.lives.values() if life.preemptions)
    assert "preempted (kv_full)" in preempted.render()


def test_per_request_metrics_are_the_finish_events_figures() -> None:
    """request_metrics (what include_metrics answers) against each request.finished."""
    from engine.events import RequestFinished
    from engine.events.folds.request_record import request_metrics

    config = SchedulerConfig(num_blocks=10, block_size=16, max_num_seqs=6, max_num_batched_tokens=64,
                             max_model_len=1024)
    events = drive(config, {0: [(f"t{i}", ids(1000 * i + 7, 30), 40 + 10 * i, 0) for i in range(5)]})
    fold = lifecycle_of(events)
    for finished in (e for e in events if isinstance(e, RequestFinished)):
        metrics = request_metrics(fold.lives[finished.request_id])
        assert finished.ttft_s is not None
        assert metrics["time_to_first_token_ms"] == finished.ttft_s * 1e3
        assert metrics["generation_time_ms"] == finished.e2e_s * 1e3
        assert metrics["queue_time_ms"] == finished.queue_time_s * 1e3
        itls = finished.inter_token_latencies_s
        assert metrics["mean_itl_ms"] == sum(itls) / len(itls) * 1e3
        assert metrics["tokens_per_second"] == finished.output_tokens / finished.e2e_s
        assert metrics["kvscope"]["preemptions"] == finished.num_preemptions
    assert request_metrics(fold.lives["t4"])["kvscope"]["preemptions"] == 3


def test_engine_replay_request_prints_the_timeline_and_json(capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from engine.cli import main

    sample = str(SAMPLES / "monitor_sim.jsonl")
    assert main(["replay", sample, "--request", "r13"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("request r13: finished")
    assert "step 73  preempted (kv_full) to make room for r5: held 8 blocks and 126 computed tokens" in out
    assert main(["replay", sample, "--request", "r13", "--json"]) == 0
    life = json.loads(capsys.readouterr().out)
    assert life["preemptions"][0]["for_request"] == "r5" and life["finish_reason"] == "length"
    assert main(["replay", sample, "--request", "nobody"]) == 2
    assert "--request nobody: no such request" in capsys.readouterr().err
