"""Each rule against a recording that exhibits its failure (tests/doctor/recordings.py
has the commands): the finding, its evidence (steps, request ids) and its numbers,
the fix computed through the budget formula; and silence on a healthy run."""

from __future__ import annotations

import json
from functools import cache

import pytest

from doctor.budget import replan
from doctor.facts import RunFacts
from doctor.inputs import facts_from_recording
from doctor.rules.finding import CRITICAL, WARNING, Finding, exit_status
from doctor.rules.registry import diagnose
from doctor.vllm_log import diagnose_log
from engine.budget.fixes import BudgetRefused, Fix, recorded_fixes
from engine.budget.memory import fixed_pool_fixes
from engine.events import EngineConfigEvent, EventBus, StartupPhase, dumps
from engine.events.validate import event_from_row
from tests.doctor.recordings import path_of
from tests.paths import DATA


@cache
def facts(name: str) -> RunFacts:
    return facts_from_recording(path_of(name))


def finding(name: str, rule: str) -> Finding:
    found = {f.rule: f for f in diagnose(facts(name))}
    assert rule in found, f"{name}: expected {rule}, found {sorted(found)}"
    return found[rule]


def fix_for(f: Finding, flag: str):  # type: ignore[no-untyped-def]
    return next(x for x in f.fixes if x.flag == flag)


def test_healthy_run_has_no_findings() -> None:
    assert diagnose(facts("healthy")) == []
    assert exit_status([]) == 0


def test_preemption_storm_names_requests_steps_and_the_pool() -> None:
    f = finding("pool_binds", "pool_binds")
    assert f.severity == CRITICAL and (f.first_step, f.last_step) == (132, 361)
    assert f.evidence[0] == "16 preemptions of 11 requests at steps 132–361, KV usage 95–98 % when they happened"
    assert f.evidence[1] == "request r28 was preempted 3 times at steps 169–357 (1,278 computed tokens recomputed)"
    assert f.numbers["worst_request"] == "r28" and f.numbers["worst_preemptions"] == 3
    assert f.numbers["pool_tokens"] == 10_992 and f.numbers["peak_running"] == 32
    assert "need 19,295 tokens, 1.8x the pool's 10,992" in f.cause
    seqs = fix_for(f, "--max-num-seqs")
    assert (seqs.current, seqs.proposed) == (256, 10_992 // 603)
    fp8 = fix_for(f, "--kv-cache-dtype")
    assert fp8.proposed == "fp8" and fp8.numbers["kv_cache_tokens"] == replan(facts("pool_binds"), kv_cache_dtype="fp8").kv_cache_tokens == 21_984
    util = fix_for(f, "--gpu-memory-utilization")
    assert (util.current, util.proposed) == (0.8, "0.85")
    assert replan(facts("pool_binds"), gpu_memory_utilization=0.85).kv_cache_tokens >= 19_295


def test_max_num_seqs_binds_with_kv_to_spare() -> None:
    f = finding("max_num_seqs_binds", "max_num_seqs_binds")
    assert f.severity == WARNING and (f.first_step, f.last_step) == (0, 580)
    assert f.numbers["peak_waiting"] == 40 and f.numbers["max_kv_usage"] < 0.02
    assert "request r47 waited 4.75 s in the queue" in f.evidence
    fix = fix_for(f, "--max-num-seqs")
    assert (fix.current, fix.proposed) == (8, 48) and fix.numbers["fits"] > 1000


def test_long_prompts_cause_latency_spikes() -> None:
    f = finding("long_prompts", "long_prompt_spikes")
    assert (f.first_step, f.last_step) == (74, 116)
    assert f.evidence[0].startswith("request doc1 (16,000-token prompt) arrived at step 74; its prefill chunks at "
                                    "steps 74–75 made 24 decoding requests wait 222 ms")
    assert f.numbers["worst_itl_s"] > 20 * f.numbers["baseline_itl_s"]
    assert fix_for(f, "--max-num-batched-tokens").proposed == 512


def test_decode_starved_by_prefill() -> None:
    f = finding("decode_starved", "decode_starved")
    assert 0.2 < f.numbers["starved_share"] < 0.3 and f.numbers["slowed_steps"] == 30
    assert f.numbers["median_slowed_s"] > 3 * f.numbers["baseline_itl_s"]
    assert {x.flag for x in f.fixes} == {"--max-num-batched-tokens", "--long-prefill-token-threshold"}


def test_ttft_rises_while_the_token_budget_is_full() -> None:
    f = finding("ttft_token_budget", "ttft_token_budget")
    assert f.numbers["full_steps"] == 167
    assert f.numbers["ttft_last_third_s"] > 4 * f.numbers["ttft_first_third_s"]
    fix = fix_for(f, "--max-num-batched-tokens")
    assert (fix.current, fix.proposed) == (512, 1024)


def test_ttft_rule_names_the_decode_step_budget_that_binds() -> None:
    """Under kvscope's two budgets the steps that fill are those with decodes, at
    --max-decode-step-tokens, far below --max-num-batched-tokens: the rule counts them full
    against their own budget and names that flag."""
    f = finding("ttft_decode_step", "ttft_token_budget")
    assert f.numbers["full_steps"] == 165 and "pool_tokens_after" not in f.numbers
    assert f.evidence[0].startswith("the 512-token step budget was full on 165 steps")
    fix = fix_for(f, "--max-decode-step-tokens")
    assert (fix.current, fix.proposed) == (512, 1024)
    assert not any(x.flag == "--max-num-batched-tokens" for x in f.fixes)


def test_shared_prefix_evicted() -> None:
    f = finding("prefix_evicted", "prefix_cache_low")
    assert f.numbers["shared_prefix_tokens"] == 512 and f.numbers["evicted_prefix_blocks"] > 0
    assert f.evidence[0].startswith("37 requests reused a shared prefix of about 512 tokens")
    assert fix_for(f, "--max-num-seqs").proposed == (2_560 - 512) // 825


def test_startup_refused_from_a_real_start() -> None:
    """A recording made before the budget check recorded its fixes: the one fallback that
    reads them out of the sentence (doctor/rules/startup.py ``fixes_from_old_sentence``)."""
    (f,) = diagnose(facts("startup_refused"))
    assert f.rule == "startup_refused" and f.severity == CRITICAL and f.where == "startup"
    assert "phase B (budget) failed" in f.evidence[0]
    assert [x.why for x in f.fixes] == ["raise --kv-cache-memory-bytes to at least 377,487,360 (0.352 GiB)",
                                        "lower --max-model-len to 16 or less"]
    assert exit_status([f]) == 2


def refused_run(reason: str, fixes: list[Fix]) -> RunFacts:
    """A run whose phase B failed, its event read back from its JSON line as a recording's is."""
    bus, run = EventBus(), RunFacts()
    bus.subscribe(run)
    event = StartupPhase(phase="B", name="budget", status="failed", reason=reason,
                         fixes=recorded_fixes(BudgetRefused("refused", fixes)))
    bus.publish(event_from_row(json.loads(dumps(event.to_dict()))))
    return run


def test_startup_refused_takes_the_recorded_fixes_not_the_sentence() -> None:
    fixes = fixed_pool_fixes(4 << 20, 94_371_840, 4096, 176)
    # a sentence the old parser would split differently: the fixes come from the data alone
    (f,) = diagnose(refused_run("--kv-cache-memory-bytes 4,194,304 is too small; try something else", fixes))
    assert f.rule == "startup_refused" and f.fixes == fixes
    assert [(x.flag, x.current, x.proposed) for x in f.fixes] == [
        ("--kv-cache-memory-bytes", 4 << 20, 94_371_840), ("--max-model-len", 4096, 176)]
    assert f.fixes[1].text() == "--max-model-len 4096 -> 176: the longest request the pool holds"


def test_startup_refused_from_an_old_sentence_only_event() -> None:
    reason = ("the model's max seq len (4,096) is larger than the maximum number of tokens that can be stored in "
              "KV cache (176); try increasing --gpu-memory-utilization to 0.95 (needs 0.35 GiB of KV pool, have "
              "0.01) or decreasing --max-model-len to 176 or less")
    (f,) = diagnose(refused_run(reason, []))
    assert [(x.flag, x.proposed) for x in f.fixes] == [("--gpu-memory-utilization", None), ("--max-model-len", None)]
    assert f.fixes[1].why == "decreasing --max-model-len to 176 or less"


@pytest.mark.parametrize("name", [pytest.param("pool_binds", marks=pytest.mark.slow),
                                  pytest.param("max_num_seqs_binds", marks=pytest.mark.slow), "long_prompts"])
def test_findings_are_the_same_on_a_remade_recording(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The recordings are reproducible: the committed command gives the same diagnosis."""
    from tests.doctor.recordings import simulate_recording

    again = tmp_path / f"{name}.jsonl.gz"
    again.write_bytes(simulate_recording(name))
    assert [f.to_json() for f in diagnose(facts_from_recording(again))] == [f.to_json() for f in diagnose(facts(name))]


def test_oom_at_graph_capture_with_another_process_on_the_device() -> None:
    """Phase F failing with CUDA's out-of-memory, as the engine's PhaseRecorder publishes it
    (a CPU machine cannot run out of device memory, so the events are published here)."""
    bus, run = EventBus(), RunFacts()
    bus.subscribe(run)
    gib = 2**30
    bus.publish(EngineConfigEvent(config={"gpu_memory_utilization": 0.92, "cuda_graph_sizes": [1, 2, 4, 8, 256]}))
    before = {"total": 80 * gib, "free": 4 * gib, "allocated": 66 * gib, "reserved": 68 * gib}
    bus.publish(StartupPhase(phase="F", name="graphs_compile", status="failed", memory_before=before,
                             reason="OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"))
    (f,) = diagnose(run)
    assert (f.rule, f.severity, f.title) == ("startup_oom", CRITICAL, "out of memory at CUDA-graph capture")
    assert f.numbers["held_by_others_bytes"] == 8 * gib
    assert "8.00 GiB held by other processes" in f.evidence[1]
    fixes = {x.flag: x for x in f.fixes}
    assert fixes["--cuda-graph-sizes"].proposed == 128 and "--enforce-eager" in fixes
    assert fixes["--gpu-memory-utilization"].proposed == "0.77"  # 0.92 - 0.05 - 8/80


def test_free_memory_below_the_request_in_a_vllm_log() -> None:
    (f,) = diagnose_log(DATA / "vllm-logs" / "v0.15dev-ci-l4-tp1-ansi-caret-freemem-fail.log")
    assert (f.rule, f.severity) == ("startup_oom", CRITICAL)
    assert f.evidence[0] == "line 1: only 1.54 of 22.05 GiB free at startup, but 0.9 x 22.05 = 19.84 GiB requested"
    fix = f.fixes[0]  # the structured fix logparse computed (engine/budget/fixes.py), not re-parsed text
    assert (fix.flag, fix.current, fix.proposed) == ("--gpu-memory-utilization", 0.9, "0.06")
    assert fix.why.startswith("fits the 1.54 GiB free now")


def test_tp_scaling_proposes_the_smallest_size_that_fits() -> None:
    """A healthy run's facts as if split two ways with the collectives taking 40 % of
    every step (what `make bench`'s TP=2 on this CPU shows): the finding quotes the share
    and the bytes, and the fix is TP=1 through the budget formula, because it fits."""
    import copy
    import dataclasses

    split = copy.deepcopy(facts("healthy"))
    split.config["tensor_parallel_size"] = 2
    split.steps = [dataclasses.replace(s, collective_s=0.4 * s.duration_s, collective_bytes=700 * 1024)
                   for s in split.steps]
    f = finding_in(split, "tp_scaling")
    assert f.severity == WARNING and f.numbers["tensor_parallel_size"] == 2
    assert abs(f.numbers["collective_share"] - 0.4) < 1e-9
    assert "collectives took 40% of step time at --tensor-parallel-size 2" in f.evidence[0]
    assert "700 KiB exchanged per step" in f.evidence[0]
    tp = fix_for(f, "--tensor-parallel-size")
    one = replan(split, tensor_parallel_size=1)
    assert (tp.current, tp.proposed) == (2, 1) and tp.numbers["kv_cache_tokens"] == one.kv_cache_tokens > 0
    assert "activation_peak" in one.estimated  # another split: the rank's measured peak is not reused
    # the same run with cheap collectives, or unsplit, says nothing
    cheap = copy.deepcopy(split)
    cheap.steps = [dataclasses.replace(s, collective_s=0.05 * s.duration_s) for s in split.steps]
    assert "tp_scaling" not in {x.rule for x in diagnose(cheap)}
    assert "tp_scaling" not in {x.rule for x in diagnose(facts("healthy"))}


def finding_in(run: RunFacts, rule: str) -> Finding:
    found = {f.rule: f for f in diagnose(run)}
    assert rule in found, f"expected {rule}, found {sorted(found)}"
    return found[rule]


def test_engine_doctor_reads_the_graph_capture_oom_as_its_startup_oom_rule(tmp_path) -> None:
    from tests.logparse.test_vllm_0_3x import GRAPH_OOM

    log = tmp_path / "graph-oom.log"
    log.write_text(GRAPH_OOM)
    (finding,) = [f for f in diagnose_log(log) if f.numbers["check"] == "oom_graph_capture"]
    assert finding.rule == "startup_oom" and finding.severity == "critical"
    assert [fix.flag for fix in finding.fixes] == ["--gpu-memory-utilization", "--enforce-eager",
                                                   "--max-cudagraph-capture-size"]
