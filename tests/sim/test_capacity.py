"""engine capacity: the step-cost fit on a recording, the rate search on traces whose capacity is
known by construction, each trace reader on a small sample, and the command end to end.

Nothing here reads a clock: every time is a simulated or a scripted one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from engine.cli import main
from engine.config import EngineConfig
from engine.errors import UserError
from engine.events import EventBus, JsonlSink, RequestScheduled, StepEvent, read_events
from engine.sim.capacity import (
    KV_BLOCKS,
    MAX_NUM_SEQS,
    QUEUE,
    Objective,
    binding_constraint,
    find_capacity,
    parse_slo,
    search_capacity,
)
from engine.sim.capacity_setup import Overrides, fixes_for, gpu_deployment
from engine.sim.simulate import SimSetup, build_setup
from engine.sim.step_fit import fit_recording, fit_step_cost, step_samples
from engine.sim.traces import arrival_rate, read_trace, repeat_requests, sniff
from engine.sim.workload import WorkloadRequest
from tests.paths import DATA, SAMPLES

TRACES = DATA / "traces"
LAW = (0.005, 0.0002, 0.001, 0.000002)  # intercept, per prompt token, per decode row, per context token read


# ------------------------------------------------------------------------ the fit
def scripted_steps(n: int = 60, gap_s: float = 0.0, with_kv: bool = True, seed: int = 3) -> list[StepEvent]:
    """Steps whose wall time follows LAW exactly: ``duration_s`` the law less a loop gap of
    ``gap_s`` that the next step's start shows (every step leaves work, so the engine goes on)."""
    rng = np.random.default_rng(seed)
    steps, t = [], 0.0
    for i in range(n):
        p, d, k = int(rng.integers(0, 600)), int(rng.integers(1, 40)), int(rng.integers(100, 20_000))
        total = LAW[0] + LAW[1] * p + LAW[2] * d + LAW[3] * k
        t += total
        steps.append(StepEvent(t=t, index=i, num_prefill_tokens=p, num_decode_tokens=d, num_running=d + 1,
                               kv_tokens_read=k if with_kv else 0, duration_s=total - gap_s,
                               scheduled={f"r{i}": [p, "prefill"]} if p else {f"r{i}": [d, "decode"]}))
    return steps


def test_the_fit_recovers_a_known_law_from_a_recording(tmp_path: Path) -> None:
    path = tmp_path / "scripted.jsonl"
    sink = JsonlSink(str(path), config={"model": "smollm2-135m"})
    now = [0.0]
    bus = EventBus(clock=lambda: now[0])  # the scripted clock: events carry the law's times
    bus.subscribe(sink)
    for ev in scripted_steps(gap_s=0.0015):
        now[0] = ev.t
        bus.publish(ev)
    sink.close()
    fit = fit_recording(read_events(path).events)
    assert fit.coefficients == pytest.approx(LAW, rel=1e-6, abs=1e-12)  # the loop's gap is in the step's time
    assert fit.r2 == pytest.approx(1.0) and fit.residual_p90_s < 1e-9 and fit.samples == 60 and not fit.zeroed
    assert fit.seconds(100, 10, 5000) == pytest.approx(0.005 + 0.02 + 0.01 + 0.01)


def test_the_fit_reports_noise_and_never_fits_a_negative_cost() -> None:
    rng = np.random.default_rng(0)
    samples = step_samples(scripted_steps(200))
    noisy = [dataclasses.replace(s, seconds=s.seconds * float(rng.uniform(0.8, 1.2))) for s in samples]
    fit = fit_step_cost(noisy)
    assert fit.per_prompt_token_s == pytest.approx(LAW[1], rel=0.1) and 0.8 < fit.r2 < 1.0
    assert 0 < fit.residual_p50_s < fit.residual_p90_s and 0.02 < fit.relative_p50 < 0.15
    # a decode row that seems to make steps cheaper is fixed at zero, not fitted below it
    cheaper = [dataclasses.replace(s, seconds=max(1e-4, s.seconds - 0.002 * s.decode)) for s in samples]
    assert "decode rows" in fit_step_cost(cheaper).zeroed
    with pytest.raises(UserError, match="at least 8"):
        fit_step_cost(samples[:3])


def test_context_read_is_rebuilt_for_recordings_without_it() -> None:
    events: list = [RequestScheduled(request_id="a", prefix_hit_tokens=32)]
    events.append(StepEvent(t=1.0, index=0, scheduled={"a": [100, "prefill"]}, num_prefill_tokens=100,
                            num_running=1, duration_s=1.0))
    events.append(StepEvent(t=2.0, index=1, scheduled={"a": [1, "decode"]}, num_decode_tokens=1, num_running=1,
                            duration_s=1.0))
    events.append(StepEvent(t=3.0, index=2, preempted=["a"], num_waiting=1, duration_s=1.0))
    events.append(StepEvent(t=4.0, index=3, scheduled={"a": [133, "prefill"]}, num_prefill_tokens=133,
                            num_running=1, duration_s=1.0))
    assert [s.kv_read for s in step_samples(events)] == [132, 133, 133]  # hit + chunk, +1, recomputed from 0


# ---------------------------------------------------------------------- the search
@dataclasses.dataclass(frozen=True)
class FlatCost:
    """Every step takes the same time, whatever it schedules."""

    step_s: float

    def seconds(self, prefill_tokens: int, decode_rows: int, kv_tokens_read: int) -> float:
        return self.step_s


def flat_setup(num_blocks: int, max_num_seqs: int, step_s: float = 0.01) -> SimSetup:
    setup = build_setup(engine=EngineConfig(max_model_len=4096), num_gpu_blocks_override=num_blocks)
    sched = dataclasses.replace(setup.scheduler, max_num_seqs=max_num_seqs)
    return dataclasses.replace(setup, scheduler=sched, step_cost=FlatCost(step_s))


def even_trace(n: int, prompt: int, output: int) -> list[WorkloadRequest]:
    return [WorkloadRequest(f"r{i}", prompt, output, arrival_time=float(i)) for i in range(n)]


def test_a_pool_of_exactly_n_requests_caps_the_rate_where_arithmetic_says() -> None:
    # 8 prompt + 8 output tokens fit one 16-token block for a request's whole life, so a
    # 4-block pool holds exactly 4 requests; each lives 8 steps of 10 ms: 4 / 0.08 s = 50 req/s
    requests = even_trace(400, 8, 8)
    slo = parse_slo("ttft_p99=50ms")
    search = search_capacity(flat_setup(4, 256), requests, arrival_rate(requests), slo, tolerance=0.01)
    assert 0.93 * 50 <= search.max_rate <= 50 * 1.01, search.max_rate
    assert search.broke is not None and search.broke.rate <= 50 * 1.1
    assert 8 <= search.runs <= 20
    binding = binding_constraint(search, slo)
    assert binding.name == KV_BLOCKS and binding.queued_share > 0.5, binding.detail


def test_max_num_seqs_caps_the_rate_and_its_fix_doubles_it() -> None:
    # 16 + 10 tokens on a pool of plenty, at most 5 running: 5 / (10 steps x 10 ms) = 50 req/s
    requests = even_trace(400, 16, 10)
    slo = parse_slo("ttft_p99=60ms")
    setup = flat_setup(10_000, 5)
    search = search_capacity(setup, requests, arrival_rate(requests), slo, tolerance=0.01)
    assert 0.93 * 50 <= search.max_rate <= 50 * 1.01, search.max_rate
    binding = binding_constraint(search, slo)
    assert binding.name == MAX_NUM_SEQS and binding.head_waits.get("max_num_seqs", 0) > 0


def test_each_constraint_has_its_fix_in_numbers() -> None:
    dep = gpu_deployment("llama-3.1-8b", "h100-80gb", Overrides(max_num_seqs=5, max_model_len=4096))
    [seqs] = fixes_for(dep, MAX_NUM_SEQS, 10.0)
    assert "--max-num-seqs 10" in seqs.label and seqs.deployment.setup.scheduler.max_num_seqs == 10
    pool, tp = fixes_for(dep, KV_BLOCKS, 10.0)
    assert pool.deployment.num_blocks == 2 * dep.num_blocks and f"{2 * dep.num_blocks:,}" in pool.label
    assert tp.label.startswith("-tp 2") and tp.deployment.num_blocks > 2 * dep.num_blocks  # half the weights per GPU
    assert tp.deployment.setup.cost.num_parameters == dep.setup.cost.num_parameters // 2
    *_, dp = fixes_for(dep, QUEUE, 10.0, target_rate=35.0)
    assert dp.label.startswith("-dp 4") and dp.deployment.setup.data_parallel_size == 4


def test_a_cost_that_grows_with_the_batch_breaks_the_itl_at_a_computable_rate() -> None:
    # a step costs 10 ms + 5 ms per decode row; n requests decoding take 10 + 5 n ms a token, so an
    # ITL limit of 40 ms allows 6 at once; each needs 1 prefill + 19 decode steps of 40 ms ~ 0.8 s:
    # Little's law gives 6 / 0.8 s ~ 7.5 req/s where the ITL breaks
    @dataclasses.dataclass(frozen=True)
    class RowCost:
        def seconds(self, prefill_tokens: int, decode_rows: int, kv_tokens_read: int) -> float:
            return 0.010 + 0.005 * decode_rows

    setup = dataclasses.replace(flat_setup(10_000, 256), step_cost=RowCost())
    requests = even_trace(300, 16, 20)
    slo = parse_slo("itl_p99=40ms")
    search = search_capacity(setup, requests, arrival_rate(requests), slo)
    assert 6.0 <= search.max_rate <= 9.0, search.max_rate
    assert binding_constraint(search, slo).name == "compute"


def test_the_search_brackets_both_ways_and_says_when_no_rate_works() -> None:
    from engine.sim.capacity import Point, RunFold

    def run(limit: float):
        return lambda s: Point(s, s, {}, s <= limit, RunFold(), 0.0)

    up = find_capacity(run(37.0), tolerance=0.01)
    assert up.best is not None and 37 / 1.01 <= up.best.scale <= 37 and up.broke.scale > 37
    down = find_capacity(run(0.01), tolerance=0.01)
    assert down.best is not None and 0.01 / 1.01 <= down.best.scale <= 0.01
    never = find_capacity(run(0.0), max_factor=64)
    assert never.best is None and never.runs == 7  # 1, then halved to 1/64
    always = find_capacity(run(1e9), max_factor=64)
    assert always.broke is None and always.best.scale == 64


def test_slo_parsing() -> None:
    assert parse_slo("ttft_p99=2s,itl_p99=200ms,tpot_mean=40ms,e2el_median=1.5s") == (
        Objective("ttft", "p99", 2.0), Objective("itl", "p99", 0.2), Objective("tpot", "mean", 0.04),
        Objective("e2e", "p50", 1.5))
    for bad in ("ttft_p99=2", "ttfb_p99=2s", "ttft_p200=1s", "", "ttft_p99=0s"):
        with pytest.raises(UserError):
            parse_slo(bad)


# ----------------------------------------------------------------------- the readers
def test_a_recording_is_a_trace_of_its_arrivals_and_outputs() -> None:
    trace = read_trace(SAMPLES / "smollm2_run.jsonl")
    assert trace.kind == "recording" and trace.model == "smollm2-135m" and trace.recording is not None
    assert len(trace.requests) == 40 and trace.requests[0].arrival_time == 0.0 and trace.timed
    assert all(r.output_tokens >= 1 for r in trace.requests)
    assert any(r.shared_prefix_tokens for r in trace.requests)  # the recorded prefix hits are kept


def test_a_bench_serve_result_is_read_with_its_start_times(tmp_path: Path) -> None:
    trace = read_trace(TRACES / "bench_serve.json")
    assert trace.kind == "bench-serve" and trace.model == "llama-3.1-8b"
    assert [(r.prompt_tokens, r.output_tokens, r.arrival_time) for r in trace.requests] == [
        (100, 10, 0.0), (300, 30, 1.25), (50, 30, 2.0)]  # the failed one (0 output tokens) left out
    doc = json.loads((TRACES / "bench_serve.json").read_text())
    del doc["start_times"]
    (tmp_path / "old.json").write_text(json.dumps(doc))
    old = read_trace(tmp_path / "old.json", "bench-serve", seed=1)
    assert not old.timed and len(old.requests) == 3 and old.rate > 0 and "request_rate" in old.notes[0]


def test_an_aiperf_export_is_read_from_its_profiling_records() -> None:
    trace = read_trace(TRACES / "aiperf_profile_export.jsonl")
    assert trace.kind == "aiperf"
    assert [(r.prompt_tokens, r.output_tokens, r.arrival_time) for r in trace.requests] == [
        (550, 9, 0.0), (120, 32, 0.25), (300, 64, 1.0)]
    assert "1 failed" in trace.notes[0]


def test_a_mooncake_trace_keeps_times_sessions_and_its_main_prefix_tree() -> None:
    trace = read_trace(TRACES / "mooncake.jsonl")
    assert trace.kind == "mooncake"
    rows = [(r.prompt_tokens, r.output_tokens, r.arrival_time, r.shared_prefix_tokens) for r in trace.requests]
    assert rows == [(600, 20, 0.0, 0), (1100, 30, 0.5, 1024), (300, 10, 1.0, 0), (700, 5, 2.0, 512),
                    (200, 10, 3.0, 0), (400, 12, 4.5, 0)]


def test_a_vllm_log_gives_rates_only() -> None:
    trace = read_trace(TRACES / "vllm_stats.log", input_len=512)
    assert trace.kind == "vllm-log" and not trace.timed
    assert len(trace.requests) == 8 and {(r.prompt_tokens, r.output_tokens) for r in trace.requests} == {(512, 241)}
    assert "2 engine(s)" in trace.notes[0] and "--random-input-len" in trace.notes[0]


def test_formats_are_told_apart_and_an_unknown_file_is_refused(tmp_path: Path) -> None:
    assert [sniff(TRACES / f) for f in ("bench_serve.json", "aiperf_profile_export.jsonl", "mooncake.jsonl",
                                       "vllm_stats.log")] == ["bench-serve", "aiperf", "mooncake", "vllm-log"]
    (tmp_path / "x.txt").write_text("hello\n")
    with pytest.raises(UserError, match="--trace-format"):
        read_trace(tmp_path / "x.txt")


def test_a_trace_repeats_back_to_back() -> None:
    requests = even_trace(3, 8, 8)
    out = repeat_requests(requests, 2)
    assert [r.arrival_time for r in out] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and len({r.request_id for r in out}) == 6


# ------------------------------------------------------------------------ the command
def test_the_command_end_to_end_on_a_sample_recording(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "capacity.png"
    argv = ["capacity", "--trace", str(SAMPLES / "smollm2_run.jsonl"), "--slo", "ttft_p99=20s,itl_p99=2s"]
    assert main([*argv, "--json", "--plot", str(plot), "--tolerance", "0.05"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["deployment"]["hardware"] == "this" and out["deployment"]["num_blocks"] == 45
    assert out["fit"]["samples"] > 100 and 0.0 <= out["fit"]["r2"] <= 1.0
    assert out["max_rate"] > 0 and out["bounded"] and out["simulations"] == len(out["points"])
    assert out["binding"]["constraint"] in ("kv-blocks", "compute", "max-num-seqs", "queue")
    assert out["fixes"] and plot.stat().st_size > 10_000
    assert main([*argv, "--no-fixes", "--tolerance", "0.1"]) == 0
    text = capsys.readouterr().out
    assert "max rate:" in text and "binding constraint:" in text and "R²" in text and "simulations" in text


def test_the_command_on_a_gpu_preset_and_its_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["capacity", "--trace", str(TRACES / "mooncake.jsonl"), "--slo", "ttft_p99=1s"]
    assert main(argv) == 2  # no recording to fit: a GPU preset is needed
    assert "--hardware" in capsys.readouterr().err
    assert main([*argv, "--hardware", "h100-80gb", "--max-model-len", "4096", "--no-fixes", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["deployment"]["model"] == "llama-3.1-8b" and out["fit"] is None and out["max_rate"] > 0
    sample = ["capacity", "--trace", str(SAMPLES / "smollm2_run.jsonl"), "--slo", "ttft_p99=2s"]
    assert main([*sample, "-tp", "2"]) == 2
    assert main([*sample, "--slo", "ttft=2s"]) == 2
