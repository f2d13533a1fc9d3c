"""engine simulate with --pipeline-parallel-size and --data-parallel-size (issue 37): the
stages' timing model against its closed form, the stage plans against ``engine plan -pp``'s,
the step events' pipeline fields and dp_rank, vLLM's balancer, and the CLI."""

from __future__ import annotations

import contextlib
import io

import pytest

from engine.budget.stages import DEFAULT_MICRO_BATCHES, fill_drain_bubble, plan_stages
from engine.cli import main
from engine.config import EngineConfig
from engine.errors import UserError
from engine.events import EventBus, RequestArrived, StepEvent, read_events
from engine.events.folds.dp_balance import DataParallelLoad
from engine.sim.data_parallel import DataParallelSimulation
from engine.sim.simulate import CostModel, PipelineCost, build_setup, simulate, split_micro_batches
from engine.sim.workload import WorkloadRequest, WorkloadSpec, generate_workload

# The bound this test states for DP=2 under a uniform Poisson load: the busiest rank gets at
# most 10 % more requests than the mean and holds at most 10 % more waiting + running on
# average over time (vLLM's rule sends each request to the emptier rank).
DP_BALANCE_BOUND = 1.10


def _flat_stage() -> CostModel:
    # compute-bound on tokens only (no weights, no KV): a stage's time is linear in its tokens
    return CostModel(weights_bytes=0, bytes_per_kv_token=0, num_parameters=10**9, bandwidth_bytes_s=1e12,
                     peak_flops=1e12, efficiency=1.0)


def test_equal_stages_and_micro_batches_idle_the_fill_drain_floor() -> None:
    """Two equal stages, two equal micro-batches, an instant link: every stage idles
    (P - 1) / (M + P - 1) = 1/3 of the step, and the step is 3 micro-batch times."""
    cost = PipelineCost((_flat_stage(), _flat_stage()), micro_batches=2, activation_bytes_per_token=0)
    timings = cost.step([(100, 0), (100, 0)])
    one = _flat_stage().step_seconds(100, 0)
    assert timings["duration_s"] == pytest.approx(3 * one)
    assert [b / timings["duration_s"] for b in timings["pipeline_bubble_s"]] == pytest.approx([1 / 3, 1 / 3])
    assert fill_drain_bubble(2, 2) == pytest.approx(1 / 3) and fill_drain_bubble(4, 4) == pytest.approx(3 / 7)
    # four stages, four micro-batches: the same closed form
    four = PipelineCost(tuple(_flat_stage() for _ in range(4)), micro_batches=4)
    t = four.step([(50, 0)] * 8)
    assert max(t["pipeline_bubble_s"]) / t["duration_s"] == pytest.approx(fill_drain_bubble(4, 4))
    # the link adds its transfer to every hop; the last stage samples and sends nothing
    linked = PipelineCost((_flat_stage(), _flat_stage()), micro_batches=2, activation_bytes_per_token=1000,
                          link_bytes_s=1e9)
    t = linked.step([(100, 0), (100, 0)])
    assert t["pipeline_bytes"] == [200_000, 0]
    assert t["duration_s"] == pytest.approx(3 * one + 100 * 1000 / 1e9)


def test_the_engine_and_the_simulator_split_micro_batches_alike() -> None:
    from engine.pipeline import MICRO_BATCHES, Stage

    assert MICRO_BATCHES == DEFAULT_MICRO_BATCHES
    for n in (1, 2, 3, 7):
        sequences = list(range(n))
        engine_split = Stage.micro_batches(None, sequences)  # type: ignore[arg-type]  # reads no state
        assert [list(mb) for mb in split_micro_batches(sequences, MICRO_BATCHES)] == engine_split


def test_pp2_on_h100_plans_each_stage_as_engine_plan_and_steps_carry_the_bubble() -> None:
    setup = build_setup("llama-3.1-8b", "h100-80gb", EngineConfig(pipeline_parallel_size=2, max_model_len=8192))
    plan = plan_stages(setup.model, 2, total_bytes=setup.plan.total_bytes, gpu_memory_utilization=0.9,
                       max_model_len=8192, dtype="bfloat16", max_num_batched_tokens=8192, max_num_seqs=256)
    assert setup.pipeline is not None and setup.pipeline.to_dict() == plan.to_dict()
    assert setup.scheduler.num_blocks == plan.num_blocks == setup.plan.num_blocks
    assert [s.layers for s in setup.pipeline.stages] == [(0, 16), (16, 32)]
    bus = EventBus()
    steps: list[StepEvent] = []
    bus.subscribe(lambda e: steps.append(e) if isinstance(e, StepEvent) else None)
    result = simulate(setup, generate_workload(WorkloadSpec(12, (200, 600), (20, 40))), bus)
    assert result.completed and result.finished == 12
    assert all(len(s.pipeline_bubble_s) == 2 and len(s.pipeline_bytes) == 2 for s in steps)
    fractions = result.pipeline.fractions
    assert all(fill_drain_bubble(2, 2) <= f < 0.6 for f in fractions), fractions
    # activations: tokens x hidden x 2 bytes (bf16) from stage 0; the last stage sends nothing
    assert steps[0].pipeline_bytes == [steps[0].num_prefill_tokens * 4096 * 2, 0]
    assert result.summary()["pipeline_bubble_fraction"] == fractions


def test_a_stage_that_cannot_hold_one_request_is_refused() -> None:
    with pytest.raises(UserError, match=r"stage 0's GPU holds .* tokens of KV, less than one --max-model-len"):
        build_setup("llama-3.1-70b", "l4", EngineConfig(pipeline_parallel_size=2, max_model_len=4096))
    with pytest.raises(UserError, match="sliding-window layers and vision encoders are not simulated in stages"):
        build_setup("llama-3.1-8b", "h100-80gb", EngineConfig(pipeline_parallel_size=2),
                    layer_pattern="5:1", sliding_window=1024)


def test_dp2_balances_a_uniform_load_within_the_stated_bound_and_stamps_dp_rank() -> None:
    setup = build_setup("llama-3.1-8b", "h100-80gb", EngineConfig(data_parallel_size=2, max_model_len=8192))
    workload = [WorkloadRequest(f"r{i}", 800, 100, arrival_time=i * 0.05) for i in range(80)]
    bus = EventBus()
    events: list[object] = []
    bus.subscribe(events.append)
    result = DataParallelSimulation(setup, bus).run(workload)
    assert result.completed and result.finished == 80
    balance = result.balance
    summary = balance.summary()
    assert summary["size"] == 2
    assert summary["requests_spread"] <= DP_BALANCE_BOUND and summary["load_spread"] <= DP_BALANCE_BOUND, summary
    assert summary["imbalanced_share"] == 0.0
    # every event of rank 1 says so; the recording's own fold agrees with the simulator's
    arrived = [e for e in events if isinstance(e, RequestArrived)]
    assert {e.dp_rank for e in arrived} == {0, 1}
    refold = DataParallelLoad(declared_size=2)
    for event in events:
        refold(event)  # type: ignore[arg-type]
    assert refold.summary() == summary
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert {s.dp_rank for s in steps} == {0, 1}
    by_rank = {r: [s.index for s in steps if s.dp_rank == r] for r in (0, 1)}
    assert all(idx == list(range(len(idx))) for idx in by_rank.values())  # each rank its own scheduler's steps


def test_the_balancer_sends_each_request_to_the_least_four_waiting_plus_running() -> None:
    """Three requests at once on two idle ranks: 0 (tie, lowest rank), then 1 (rank 0 has one
    waiting: score 4), then 0 (both score 4: the lowest rank)."""
    setup = build_setup("llama-3.1-8b", "h100-80gb", EngineConfig(data_parallel_size=2, max_model_len=4096))
    bus = EventBus()
    arrived: list[RequestArrived] = []
    bus.subscribe(lambda e: arrived.append(e) if isinstance(e, RequestArrived) else None)
    DataParallelSimulation(setup, bus).run([WorkloadRequest(f"r{i}", 100, 5) for i in range(3)])
    assert [(e.request_id, e.dp_rank) for e in arrived] == [("r0", 0), ("r1", 1), ("r2", 0)]


def test_dp_refuses_arrivals_by_step_but_takes_all_at_once() -> None:
    setup = build_setup("llama-3.1-8b", "h100-80gb", EngineConfig(data_parallel_size=2, max_model_len=4096))
    with pytest.raises(UserError, match="arrivals by step"):
        DataParallelSimulation(setup).run([WorkloadRequest("r0", 100, 5, arrival_step=3)])
    # step 0 for every request is engine simulate's default "all at once": time 0
    result = DataParallelSimulation(setup).run([WorkloadRequest(f"r{i}", 100, 5, arrival_step=0) for i in range(4)])
    assert result.finished == 4 and [r.requests for r in result.balance.ranks.values()] == [2, 2]


def test_cli_prints_the_stages_bubbles_and_ranks_and_records_every_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "pp2dp2.jsonl"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["simulate", "-pp", "2", "-dp", "2", "--max-model-len", "8192", "--num-prompts", "16",
                     "--random-input-len", "200:400", "--random-output-len", "20:40", "--arrival", "poisson",
                     "--request-rate", "8", "--arrival-unit", "s", "--events", str(path)])
    text = out.getvalue()
    assert code == 0
    assert "stage  layers" in text and "bubble (share of step time each stage waited): stage 0 " in text
    assert "data parallel: 2 ranks behind vLLM's balancer" in text and "    rank 1: " in text
    recording = read_events(path.read_bytes(), name=str(path))
    assert recording.header["config"]["simulation"]["pipeline_micro_batches"] == DEFAULT_MICRO_BATCHES
    steps = [e for e in recording.events if isinstance(e, StepEvent)]
    assert {s.dp_rank for s in steps} == {0, 1} and all(len(s.pipeline_bubble_s) == 2 for s in steps)
