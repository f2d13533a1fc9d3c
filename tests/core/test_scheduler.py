"""Scheduler behaviour: vLLM V1 ordering, preemption, admission, rejection, events."""

from __future__ import annotations

import pytest

from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.step_loop import FixedTokenExecutor, run_step
from engine.events import Event, EventBus


def _config(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(
        num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256
    )
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def _recorder() -> tuple[EventBus, list[Event]]:
    events: list[Event] = []
    bus = EventBus(clock=lambda: 0.0)
    bus.subscribe(events.append)
    return bus, events


def _step(sched: Scheduler, now: float, token: int = 7):
    result = run_step(sched, FixedTokenExecutor(token), None, now)
    sched.check_integrity()
    return result.output, result.finished


def test_rejects_requests_that_can_never_fit() -> None:
    bus, events = _recorder()
    sched = Scheduler(_config(num_blocks=10, max_model_len=100), bus)
    assert not sched.add_request(Request("long", list(range(90)), 20), 0.0)
    assert not sched.add_request(Request("pool", list(range(60)), 30), 0.0)  # 23 blocks > 10
    assert sched.add_request(Request("ok", list(range(20)), 10), 0.0)
    assert not sched.add_request(Request("ok", list(range(20)), 10), 0.0)
    reasons = [e.reason for e in events if e.type == "request.rejected"]  # type: ignore[attr-defined]
    assert "exceeds --max-model-len 100" in reasons[0]
    assert "KV pool has only 10" in reasons[1]
    assert "already in use" in reasons[2]
    assert sched.num_waiting == 1


def test_chunked_prefill_then_decode_and_finish_by_length() -> None:
    sched = Scheduler(_config(max_num_batched_tokens=16))
    req = Request("a", list(range(40)), 3)
    sched.add_request(req, 0.0)
    kinds = []
    for t in range(6):
        out, finished = _step(sched, float(t))
        kinds.append([(s.num_tokens, s.kind, s.samples) for s in out.scheduled])
        if finished:
            break
    assert kinds == [
        [(16, "prefill", False)],
        [(16, "prefill", False)],
        [(8, "prefill", True)],
        [(1, "decode", True)],
        [(1, "decode", True)],
    ]
    assert req.status is RequestStatus.FINISHED_LENGTH and req.output_token_ids == [7, 7, 7]
    assert sched.kv.pool.num_free == 64 and not sched.has_unfinished()


def test_model_runner_view_of_a_step() -> None:
    sched = Scheduler(_config(max_num_batched_tokens=10))
    sched.add_request(Request("a", list(range(100, 114)), 2), 0.0)
    out = sched.schedule(0.0)
    (s,) = out.scheduled
    assert s.token_ids == list(range(100, 110)) and s.start_position == 0
    assert s.block_ids == [0, 1, 2] and not s.samples
    sched.update_from_output(out, {}, 0.0)
    out = sched.schedule(1.0)
    (s,) = out.scheduled
    assert s.token_ids == list(range(110, 114)) and s.start_position == 10 and s.samples
    assert s.block_ids == [0, 1, 2, 3]
    sched.update_from_output(out, {"a": [55]}, 1.0)
    out = sched.schedule(2.0)
    assert out.scheduled[0].token_ids == [55] and out.scheduled[0].start_position == 14


def test_stop_token_and_eos() -> None:
    sched = Scheduler(_config())
    a = Request("a", [1, 2, 3], 10, stop_token_ids=[42])
    b = Request("b", [1, 2, 3], 10, eos_token_id=2)
    c = Request("c", [1, 2, 3], 10, eos_token_id=2, ignore_eos=True)
    for r in (a, b, c):
        sched.add_request(r, 0.0)
    out = sched.schedule(0.0)
    finished = sched.update_from_output(out, {"a": [42], "b": [2], "c": [2]}, 0.0)
    assert {r.request_id for r in finished} == {"a", "b"}
    assert a.status is b.status is RequestStatus.FINISHED_STOPPED
    assert out.finished == {"a": "stop", "b": "stop"}
    assert c.status is RequestStatus.RUNNING


def test_budget_and_max_num_seqs_limit_admission() -> None:
    sched = Scheduler(_config(max_num_seqs=2, max_num_batched_tokens=30))
    for i in range(4):
        sched.add_request(Request(f"r{i}", list(range(i * 100, i * 100 + 12)), 5), 0.0)
    out, _ = _step(sched, 0.0)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert out.new_req_ids == ["r0", "r1"] and sched.num_waiting == 2


def test_long_prefill_threshold_shares_the_budget() -> None:
    sched = Scheduler(_config(max_num_batched_tokens=64, long_prefill_token_threshold=16))
    sched.add_request(Request("long", list(range(100)), 2), 0.0)
    sched.add_request(Request("short", list(range(500, 510)), 2), 0.0)
    out, _ = _step(sched, 0.0)
    assert {s.request_id: s.num_tokens for s in out.scheduled} == {"long": 16, "short": 10}


def test_a_step_with_decodes_keeps_to_the_decode_step_budget() -> None:
    """--max-decode-step-tokens: prompts alone may fill --max-num-batched-tokens; once a request
    decodes, a step holds at most the decode-step budget (its decodes included), so the next
    prompt is chunked beside it; a budget below the decodes still schedules every decode."""
    sched = Scheduler(_config(max_num_batched_tokens=64, max_decode_step_tokens=16, max_model_len=128))
    sched.add_request(Request("first", list(range(40)), 5), 0.0)
    out, _ = _step(sched, 0.0)
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("first", 40)]  # no decode: one step
    sched.add_request(Request("second", list(range(100, 140)), 5), 1.0)
    shapes = []
    for t in range(2, 6):
        out, _ = _step(sched, float(t))
        shapes.append([(s.request_id, s.num_tokens, s.kind) for s in out.scheduled])
    assert shapes == [[("first", 1, "decode"), ("second", 15, "prefill")],
                      [("first", 1, "decode"), ("second", 15, "prefill")],
                      [("first", 1, "decode"), ("second", 10, "prefill")],
                      [("first", 1, "decode"), ("second", 1, "decode")]]
    bus, _ = _recorder()  # a listener: the scheduler says why the waiting wait
    crowded = Scheduler(_config(max_num_batched_tokens=64, max_decode_step_tokens=2, max_model_len=128), bus)
    for i in range(4):
        crowded.add_request(Request(f"d{i}", list(range(i * 10, i * 10 + 8)), 5), 0.0)
    _step(crowded, 0.0)
    crowded.add_request(Request("late", list(range(300, 340)), 5), 1.0)
    result = run_step(crowded, FixedTokenExecutor(7), bus, 1.0)
    assert sorted(s.request_id for s in result.output.scheduled) == ["d0", "d1", "d2", "d3"]  # 4 decodes > 2
    assert result.event is not None and result.event.waiting_reasons == {"late": ["token_budget", 4]}
    with pytest.raises(ValueError, match="max_decode_step_tokens must be positive"):
        _config(max_decode_step_tokens=-1)


def test_fcfs_preempts_the_most_recent_and_admits_nothing_that_step() -> None:
    bus, events = _recorder()
    # 6 blocks of 4: a and b take 2 each at once, then grow into the last 2 and collide
    sched = Scheduler(_config(num_blocks=6, max_model_len=64), bus)
    sched.add_request(Request("a", list(range(8)), 12), 0.0)
    sched.add_request(Request("b", list(range(100, 108)), 12), 0.0)
    preempted_at = None
    for t in range(1, 20):
        if t == 2:
            sched.add_request(Request("c", list(range(200, 203)), 2), float(t))
        out, _ = _step(sched, float(t))
        if out.preempted_req_ids:
            preempted_at = t
            assert out.preempted_req_ids == ["b"]
            assert out.new_req_ids == [] and out.resumed_req_ids == []
            assert [s.request_id for s in out.scheduled] == ["a"]
            break
    assert preempted_at is not None
    b = sched.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1 and b.block_tables == ()
    assert next(iter(sched.waiting)) is b  # front of the queue
    assert next(e for e in events if e.type == "request.preempted").request_id == "b"  # type: ignore[attr-defined]
    # the output it already produced is kept and recomputed on resumption
    assert len(b.output_token_ids) > 0


def test_priority_policy_preempts_the_worst_priority() -> None:
    sched = Scheduler(_config(num_blocks=6, max_model_len=64, policy="priority"))
    sched.add_request(Request("low", list(range(8)), 12, priority=5), 0.0)
    sched.add_request(Request("high", list(range(100, 108)), 12, priority=0), 0.0)
    for t in range(1, 20):
        out, _ = _step(sched, float(t))
        if out.preempted_req_ids:
            assert out.preempted_req_ids == ["low"]
            assert [s.request_id for s in out.scheduled] == ["high"]
            break
    else:
        raise AssertionError("no preemption happened")


def test_abort_frees_at_once_and_reports() -> None:
    bus, events = _recorder()
    sched = Scheduler(_config(), bus)
    sched.add_request(Request("a", list(range(20)), 50), 0.0)
    sched.add_request(Request("w", list(range(20)), 50), 0.0)
    _step(sched, 0.0)
    assert sched.abort("a", 1.5)
    assert not sched.abort("a", 1.6)
    assert sched.abort("w", 1.7)
    assert sched.kv.pool.num_free == 64 and not sched.has_unfinished()
    sched.check_integrity()
    fin = [e for e in events if e.type == "request.finished"]
    assert [(e.request_id, e.reason) for e in fin] == [("a", "abort"), ("w", "abort")]  # type: ignore[attr-defined]
    out = sched.schedule(2.0)
    assert out.finished_req_ids == ["a", "w"] and "a" in out.freed


def test_lifecycle_event_times_come_from_now() -> None:
    bus, events = _recorder()
    sched = Scheduler(_config(max_num_batched_tokens=8), bus)
    sched.add_request(Request("a", list(range(12)), 3, arrival_time=1.0), 1.0)
    for t in (2.0, 3.0, 5.0, 8.0):
        _step(sched, t)
    by_type = {e.type: e for e in events}
    assert by_type["request.scheduled"].queue_time_s == 1.0  # type: ignore[attr-defined]
    assert by_type["request.first_token"].ttft_s == 2.0  # type: ignore[attr-defined]
    fin = by_type["request.finished"]
    assert (fin.queue_time_s, fin.ttft_s, fin.e2e_s) == (1.0, 2.0, 7.0)  # type: ignore[attr-defined]
    assert (fin.prefill_time_s, fin.decode_time_s, fin.inference_time_s) == (1.0, 5.0, 6.0)  # type: ignore[attr-defined]
    assert fin.inter_token_latencies_s == [2.0, 3.0] and fin.reason == "length"  # type: ignore[attr-defined]


def test_nothing_is_published_without_subscribers() -> None:
    bus = EventBus(clock=lambda: 0.0)
    sched = Scheduler(_config(), bus)
    sched.add_request(Request("a", list(range(12)), 3), 0.0)
    while sched.has_unfinished():
        _step(sched, 0.0)
    assert bus.publish(Event()).seq == 1  # no event went through the bus before this one

