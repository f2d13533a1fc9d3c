"""The doctor's pipeline_bubble and dp_imbalance rules (issue 37), each firing and silent,
on scripted step events after a real startup record (the simulator's startup events for
Llama-3.1-8B on an H100: the budget the fixes are computed through), and pipeline_bubble
read from a simulated PP=2 run."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from doctor.budget import replan, replan_stages
from doctor.facts import RunFacts
from doctor.rules.finding import Finding
from doctor.rules.parallelism import DP_SUSTAINED_STEPS
from doctor.rules.registry import diagnose
from engine.budget.stages import fill_drain_bubble
from engine.config import EngineConfig
from engine.events import Event, EventBus, RequestArrived, StepEvent
from engine.events.folds.dp_balance import DP_IMBALANCE_BOUND
from engine.sim.simulate import build_setup, publish_startup, simulate
from engine.sim.workload import WorkloadSpec, generate_workload

STEP_S = 0.010


def _run(engine: EngineConfig, events: Iterable[Event]) -> RunFacts:
    """A RunFacts of the simulator's startup for ``engine`` on an H100, then ``events``,
    through a real bus whose clock moves one step at a time."""
    facts = RunFacts()
    now = [0.0]
    bus = EventBus(clock=lambda: now[0])
    bus.subscribe(facts)
    publish_startup(bus, build_setup("llama-3.1-8b", "h100-80gb", engine))
    for event in events:
        bus.publish(event)
        if isinstance(event, StepEvent):
            now[0] += STEP_S
    return facts


def _found(facts: RunFacts, rule: str) -> list[Finding]:
    return [f for f in diagnose(facts) if f.rule == rule]


def _pp_steps(bubbles: list[float], n: int = 20, seqs: int = 8) -> list[StepEvent]:
    scheduled = {f"r{i}": [1, "decode"] for i in range(seqs)}
    return [StepEvent(index=i, scheduled=scheduled, num_decode_tokens=seqs, num_running=seqs, kv_blocks_used=40,
                      kv_blocks_total=10_000, duration_s=STEP_S, forward_s=STEP_S, pipeline_bubble_s=list(bubbles),
                      pipeline_bytes=[seqs * 4096 * 2, 0]) for i in range(n)]


PP2 = EngineConfig(pipeline_parallel_size=2, max_model_len=8192)


def test_pipeline_bubble_names_the_stage_the_steps_and_a_layout_through_the_stage_budget() -> None:
    facts = _run(PP2, _pp_steps([0.004, 0.0035]))
    (f,) = _found(facts, "pipeline_bubble")
    assert (f.first_step, f.last_step) == (0, 19) and f.numbers["worst_stage"] == 0
    assert f.numbers["bubble_fractions"] == pytest.approx([0.40, 0.35])
    assert f.numbers["fill_drain_floor"] == pytest.approx(fill_drain_bubble(2, 2))
    assert f.title == "pipeline bubble: stage 0 idles 40% of the step time over 2 stages"
    assert f.evidence[0] == ("steps 0–19 (20 steps): stage 0 idle 40%, stage 1 idle 35% of the step time; the "
                             "fill-drain floor for 2 stages and 2 micro-batches is 33%")
    assert "stage 1 idles least (35%): the others wait on its layers 16–31" in f.evidence
    fewer = next(x for x in f.fixes if x.flag == "--pipeline-parallel-size")
    plan = replan_stages(facts, 1)
    assert plan is not None and (fewer.current, fewer.proposed) == (2, 1)
    assert fewer.numbers["plan"] == plan.to_dict() and plan.kv_cache_tokens >= 8192
    assert f"stage 0 layers 0–31: {plan.stages[0].plan.weights_bytes / 2**30:,.2f} GiB of weights" in fewer.why
    tp = next(x for x in f.fixes if x.flag == "--tensor-parallel-size")
    tp_plan = replan(facts, tensor_parallel_size=2)
    assert tp_plan is not None and (tp.current, tp.proposed) == (1, 2) and tp.numbers["kv_cache_tokens"] == tp_plan.kv_cache_tokens
    micro = next(x for x in f.fixes if x.flag == "micro-batches per step")
    assert (micro.current, micro.proposed) == (2, 4) and micro.numbers["fill_drain_floor"] == pytest.approx(0.2)


def test_pipeline_bubble_is_silent_when_stages_are_busy_and_without_stages() -> None:
    assert _found(_run(PP2, _pp_steps([0.001, 0.0012])), "pipeline_bubble") == []
    assert _found(_run(PP2, _pp_steps([0.004, 0.004], n=3)), "pipeline_bubble") == []  # too few steps
    assert _found(_run(EngineConfig(max_model_len=8192), _pp_steps([])), "pipeline_bubble") == []


def test_pipeline_bubble_read_from_a_simulated_pp2_run_on_a_gpu_preset() -> None:
    setup = build_setup("llama-3.1-8b", "h100-80gb", PP2)
    facts = RunFacts()
    bus = EventBus()
    bus.subscribe(facts)
    result = simulate(setup, generate_workload(WorkloadSpec(16, (200, 600), (20, 40))), bus)
    assert all(b > 0 for b in result.pipeline.fractions)
    (f,) = _found(facts, "pipeline_bubble")
    assert f.numbers["bubble_fractions"] == pytest.approx(result.pipeline.fractions)
    assert f.numbers["steps"] == result.steps


# ------------------------------------------------------------------ data parallelism
DP2 = EngineConfig(data_parallel_size=2, max_model_len=8192)


def _dp_steps(loads: list[tuple[tuple[int, int], tuple[int, int]]]) -> list[Event]:
    """Each entry: ((waiting, running) of rank 0, (waiting, running) of rank 1), one step of each."""
    events: list[Event] = []
    for i, ranks in enumerate(loads):
        for rank, (waiting, running) in enumerate(ranks):
            events.append(StepEvent(index=i, num_waiting=waiting, num_running=running, num_decode_tokens=running,
                                    kv_blocks_used=running * 50, kv_blocks_total=1000, duration_s=STEP_S,
                                    dp_rank=rank))
    return events


def _arrivals(per_rank: tuple[int, int]) -> list[Event]:
    return [RequestArrived(request_id=f"q{rank}-{i}", prompt_tokens=500, max_tokens=50, dp_rank=rank)
            for rank, n in enumerate(per_rank) for i in range(n)]


def test_dp_imbalance_names_the_busiest_rank_and_the_even_share() -> None:
    steps = 12
    facts = _run(DP2, [*_arrivals((14, 2)), *_dp_steps([((6, 8), (0, 1))] * steps)])
    (f,) = _found(facts, "dp_imbalance")
    assert f.numbers["busiest_rank"] == 0 and f.numbers["requests_by_rank"] == [14, 2]
    # the peak: rank 0's first step, before rank 1 reported anything (a rank not heard from holds 0)
    assert f.numbers["loads_at_peak"] == [14, 0] and f.numbers["peak_imbalance"] == pytest.approx(2.0)
    assert f.title == "data-parallel imbalance: rank 0 queues at 2.00x the mean load of 2 ranks"
    assert (f.first_step, f.last_step) == (0, steps - 1) and f.numbers["imbalanced_steps"] == 2 * steps
    assert f.evidence[1] == "at 0.00 s, waiting + running by rank: 0: 14, 1: 0 (max/mean 2.00); KV usage 40%, 0%"
    assert "rank 0 was sent 14 of 16 requests (1.75x an even share)" in f.cause
    (fix,) = f.fixes
    assert fix.numbers == {"even_load": 7.0, "busiest_load": 14, "even_requests": 8.0}
    # each rank's own steps fold apart: rank 1's steps are not rank 0's
    assert len(facts.steps) == steps and len(facts.ranks[1].steps) == steps
    assert {s.num_waiting for s in facts.ranks[1].steps} == {0}


def test_dp_imbalance_is_silent_when_balanced_draining_or_brief() -> None:
    balanced = _run(DP2, [*_arrivals((8, 8)), *_dp_steps([((3, 5), (2, 6))] * 20)])
    assert _found(balanced, "dp_imbalance") == []
    # one rank finishing its last requests while the other is done: nobody queues
    tail = _run(DP2, [*_arrivals((8, 8)), *_dp_steps([((0, 4), (0, 0))] * 20)])
    assert _found(tail, "dp_imbalance") == []
    brief = _run(DP2, [*_arrivals((8, 8)),
                       *_dp_steps([((6, 8), (0, 1))] * (DP_SUSTAINED_STEPS // 2 - 1) + [((3, 5), (2, 6))] * 10)])
    assert _found(brief, "dp_imbalance") == []
    assert DP_IMBALANCE_BOUND == 1.5


def test_one_cores_own_recording_is_not_called_imbalanced() -> None:
    """run.dp1.jsonl holds rank 1's events only: the other rank's are in its own file."""
    one_core = EngineConfig(data_parallel_size=2, data_parallel_rank=1, max_model_len=8192)
    facts = _run(one_core, [*_arrivals((0, 8)), *[e for e in _dp_steps([((0, 1), (6, 8))] * 20)
                                                  if getattr(e, "dp_rank", 0) == 1]])
    assert _found(facts, "dp_imbalance") == []


def test_a_cores_recording_is_read_with_the_other_cores_beside_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """engine serve -dp 2 --events run.jsonl writes run.dp0.jsonl and run.dp1.jsonl (each core
    its own, events stamped with its rank): engine doctor on either reads both."""
    from doctor.inputs import facts_from_recording
    from engine.events import JsonlSink
    from tests.scripted_events import ScriptClock

    steps = _dp_steps([((6, 8), (0, 1))] * 12)
    for rank, requests in enumerate((14, 2)):
        config = EngineConfig(data_parallel_size=2, data_parallel_rank=rank, max_model_len=8192).to_dict()
        sink = JsonlSink(tmp_path / f"run.dp{rank}.jsonl", config=config)
        clock = ScriptClock()
        bus = EventBus(clock=clock)
        bus.subscribe(sink)
        for event in _arrivals((requests, 0)) + [e for e in steps if getattr(e, "dp_rank", 0) == rank]:
            if rank and hasattr(event, "dp_rank"):
                event.dp_rank = rank  # type: ignore[attr-defined]
            bus.publish(event)
            clock.now += STEP_S if isinstance(event, StepEvent) else 0.0
        sink.close()
    for name in ("run.dp0.jsonl", "run.dp1.jsonl"):
        (f,) = _found(facts_from_recording(tmp_path / name), "dp_imbalance")
        assert f.numbers["busiest_rank"] == 0 and f.numbers["requests_by_rank"] == [14, 2]
    (tmp_path / "run.dp0.jsonl").unlink()  # rank 1's file alone: its rank only, nothing to compare
    assert _found(facts_from_recording(tmp_path / "run.dp1.jsonl"), "dp_imbalance") == []


def test_each_ranks_bubble_is_judged_on_its_own_steps_and_its_fix_simulated_on_its_own_requests() -> None:
    from doctor.remedies import add_effects
    from engine.sim.data_parallel import DataParallelSimulation

    setup = build_setup("llama-3.1-8b", "h100-80gb", EngineConfig(pipeline_parallel_size=2, data_parallel_size=2,
                                                                  max_model_len=8192))
    facts = RunFacts()
    bus = EventBus()
    bus.subscribe(facts)
    workload = generate_workload(WorkloadSpec(16, (200, 600), (20, 40), arrival="poisson", rate=20.0, unit="s"))
    result = DataParallelSimulation(setup, bus).run(workload)
    found = _found(facts, "pipeline_bubble")
    assert [f.numbers.get("dp_rank", 0) for f in found] == [0, 1]
    assert found[1].title.startswith("DP rank 1: pipeline bubble: ")
    assert [f.numbers["steps"] for f in found] == [result.balance.rank(r).steps for r in (0, 1)]
    add_effects(facts, found)
    for rank, f in enumerate(found):
        fewer = next(x for x in f.fixes if x.flag == "--pipeline-parallel-size")
        assert fewer.effect is not None
        assert f"the same {result.balance.rank(rank).requests} requests" in fewer.effect
        assert fewer.numbers["simulated"]["output_tokens_per_s"]["after"] > 0
