"""The instrumented engine on the real bundled model: startup phases, the step
loop's events, refusals, and the block table rebuilt from events alone."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.errors import UserError
from engine.events import Event, EventBus, StartupPhase, StepEvent, read_events
from engine.events.folds.block_table import BlockTableState
from engine.llm import LLM
from engine.llm_engine import CheckedPrompt
from engine.logs import configure_logging
from engine.model.memory.device import measure_peak
from engine.sim.workload import VocabTokenIds, WorkloadSpec, generate_workload, ordinary_token_ids
from logparse.explain import explain
from logparse.options import Options

SMALL = dict(max_model_len=1024, kv_cache_memory_bytes=32 * 2**20, max_num_batched_tokens=512, max_num_seqs=32,
             stats_interval=0.0, dtype="bfloat16")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory):
    """One engine for the module, with every event kept and the log captured."""
    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    log = io.StringIO()
    configure_logging("console", stream=log)
    path = tmp_path_factory.mktemp("run") / "run.jsonl"
    llm = LLM("smollm2-135m", bus=bus, events=str(path), **SMALL)
    configure_logging("json", stream=sys.stderr)
    yield llm, events, log.getvalue(), path
    llm.close()


def phases(events: list[Event]) -> list[StartupPhase]:
    return [e for e in events if isinstance(e, StartupPhase)]


def test_phases_a_to_g_in_order_with_durations(recorded) -> None:
    _, events, _, _ = recorded
    ends = [p for p in phases(events) if p.status != "begin"]
    assert [p.phase for p in ends] == list("ABCDEFG")
    begins = [p.phase for p in phases(events) if p.status == "begin"]
    assert begins == list("ABCDEFG")
    assert all(p.duration_s is not None and p.duration_s >= 0 for p in ends)
    f = ends[5]
    # Phase F on CPU builds the paged-decode kernel; it is skipped only when no compiler is available.
    assert (f.status == "end" and f.data["cpu_decode_kernel"] == "enabled") or (
        f.status == "skipped" and "decode kernel unavailable" in (f.reason or ""))
    assert all(p.memory_before and p.memory_after for p in ends)
    assert events[0].type == "engine.config" and events[0].model["bytes_per_kv_token"] == 23_040


def test_measured_peak_is_positive_and_kv_tokens_are_exact(recorded) -> None:
    llm, events, _, _ = recorded
    by_phase = {p.phase: p for p in phases(events) if p.status == "end"}
    assert by_phase["D"].data["activation_peak_bytes"] > 0
    e = by_phase["E"].data
    block_bytes = e["block_size"] * e["bytes_per_token"]
    assert e["num_blocks"] == e["kv_pool_bytes"] // block_bytes
    assert e["kv_cache_tokens"] == e["num_blocks"] * e["block_size"]
    assert e["kv_pool_bytes"] == 32 * 2**20
    # the weights held: at least the file's blocks (the plan's copies on top vary with the plan measured)
    from pathlib import Path

    assert by_phase["C"].data["weights_bytes"] > 0.8 * Path(llm.engine.startup.model_config.path).stat().st_size


@pytest.mark.slow  # a second engine start at 4x the batch: ~15 s on 2 cores (make test-slow)
def test_peak_grows_with_max_num_batched_tokens(recorded) -> None:
    llm, _, _, _ = recorded
    runner = llm.engine.runner
    cpu = torch.device("cpu")
    _, small = measure_peak(cpu, lambda: runner.profile_run(512, 32))
    _, large = measure_peak(cpu, lambda: runner.profile_run(4096, 32))
    assert small.activation_peak_bytes > 0
    # The sampler's logits are the same in both runs; the forward's tensors grow by
    # at least one gate/up intermediate per extra token (bf16).
    config = llm.engine.startup.model_config
    assert large.activation_peak_bytes - small.activation_peak_bytes >= (4096 - 512) * config.intermediate_size * 2


def test_log_lines_parse_back_to_the_same_numbers(recorded) -> None:
    _, events, log, _ = recorded
    e = next(p for p in phases(events) if p.phase == "E" and p.status == "end").data
    assert f"CPU KV cache size: {e['kv_cache_tokens']:,} tokens" in log
    ledger = explain(io.StringIO(log).getvalue().splitlines(), Options()).ledger
    assert ledger["kv_cache_tokens"] == e["kv_cache_tokens"]
    assert ledger["max_concurrency"] == pytest.approx(e["max_concurrency"], abs=0.005)


def test_generate_france_and_step_events(recorded) -> None:
    llm, events, _, _ = recorded
    before = len(events)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24))[0]
    # The first token is a near tie ("The" / "L") in bf16; the float32 answer is checked
    # against transformers in test_model_reference. Here: the engine produced text and events.
    assert out.text.strip() and out.finish_reason in ("stop", "length") and 0 < len(out.token_ids) <= 24
    steps = [e for e in events[before:] if isinstance(e, StepEvent)]
    assert steps and steps[0].num_prefill_tokens > 20 and steps[-1].num_decode_tokens == 1
    assert all(s.duration_s >= s.forward_s > 0 for s in steps)
    kinds = [e.type for e in events[before:]]
    for needed in ("request.arrived", "request.scheduled", "request.first_token", "request.finished"):
        assert needed in kinds


def test_smollm2_prompts_keep_their_encoding_without_a_bos(recorded) -> None:
    """SmolLM2's GGUF says tokenizer.ggml.add_bos_token = false: completion prompts are the
    text's ids exactly as before (Gemma's, which says true, get <bos>: test_gemma3_hybrid)."""
    llm, _, _, _ = recorded
    engine, tokenizer = llm.engine, llm.tokenizer
    assert tokenizer.add_bos_token is False and tokenizer.bos_token_id is not None
    text = "Once upon a time, in a small village,"
    ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
    assert engine.encode_prompt(text) == ids == engine.encode_prompt(text, add_special_tokens=False)
    rendered = str(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]))
    assert engine.encode_prompt(rendered, add_special_tokens=False) == tokenizer.backend.encode(rendered).ids


def test_stop_string_and_max_tokens(recorded) -> None:
    llm, _, _, _ = recorded
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = llm.generate("Once upon a time, in a small village,", greedy)[0].text
    words = free.split()
    assert len(words) > 4
    stop = " " + words[3]
    cut = free.index(stop)
    stopped = llm.generate("Once upon a time, in a small village,",
                           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert stopped.text == free[:cut] and stopped.finish_reason == "stop"
    out = llm.generate("Count: one, two,", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_too_long_prompt_fails_before_compute_with_the_numbers(recorded) -> None:
    llm, events, _, _ = recorded
    before = len(events)
    with pytest.raises(UserError, match=r"1,100 tokens.*--max-model-len is 1,024"):
        llm.generate([[5] * 1100], SamplingParams(max_tokens=4))
    with pytest.raises(UserError, match=r"exceeds --max-model-len 1,024"):
        llm.generate([[5] * 1000], SamplingParams(max_tokens=100))
    assert not any(isinstance(e, StepEvent) for e in events[before:])


def test_a_prompt_is_checked_once_and_again_only_for_other_params(recorded) -> None:
    """add_request takes prepare_prompt's result as checked (the server's worker thread and
    LLM.generate check once); a raw prompt, or one checked for other params, is checked
    there with the same message and param."""
    llm, _, _, _ = recorded
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    checked = engine.prepare_prompt([5] * 1000, params)
    assert (checked.token_ids, checked.max_tokens) == ([5] * 1000, 4)
    too_many = SamplingParams(max_tokens=100)
    for refused in (lambda: engine.prepare_prompt([5] * 1000, too_many),
                    lambda: engine.add_request([5] * 1000, too_many),
                    lambda: engine.add_request(checked, too_many)):
        with pytest.raises(UserError, match=r"prompt \(1,000 tokens\) \+ max_tokens \(100\).*exceeds") as info:
            refused()
        assert info.value.param == "max_tokens"
    # taken as checked: a checked prompt's max_tokens is the one it carries, not recomputed
    rid = engine.add_request(CheckedPrompt([5] * 10, params, max_tokens=2))
    finals = []
    while engine.has_unfinished():
        finals += [out for out in engine.step() if out.finished]
    assert [(out.request_id, len(out.token_ids)) for out in finals] == [(rid, 2)]


@pytest.mark.slow  # ~20 s of folding every step's table; tests/events and the monitor's seek tests fold recordings in the default suite
def test_folding_events_rebuilds_the_block_table_at_every_step(recorded) -> None:
    """64 requests on a pool too small for them all: preemptions happen, and at
    every step the fold of the events equals the KV manager's own table."""
    llm, events, _, _ = recorded
    engine = llm.engine
    truth: list[tuple[int, dict[str, list[int]]]] = []

    def record_truth(event: Event) -> None:
        if isinstance(event, StepEvent):
            truth.append((event.index, engine.scheduler.block_table()))

    engine.bus.subscribe(record_truth)
    start = len(events)
    ids = VocabTokenIds(ordinary_token_ids(engine.startup.model_config.vocab_size, set()), seed=3)
    workload = generate_workload(WorkloadSpec(64, (24, 81), (8, 25), seed=3))  # prompts 24-80, outputs 8-24 tokens
    try:
        llm.generate([ids.prompt(w) for w in workload],
                     [SamplingParams(temperature=0.0, max_tokens=w.output_tokens, ignore_eos=True) for w in workload])
    finally:
        engine.bus.unsubscribe(record_truth)
    state = BlockTableState()
    # Start from the state before this run: nothing held.
    steps_seen = 0
    for event in events[start:]:
        state.apply_event(event)
        if isinstance(event, StepEvent):
            index, table = truth[steps_seen]
            assert index == event.index
            assert {r: b for r, b in state.tables.items() if b} == table, f"step {index}"
            steps_seen += 1
    assert steps_seen == len(truth) > 10
    assert sum(len(e.preempted) for e in events[start:] if isinstance(e, StepEvent)) > 0
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.config.num_blocks


def test_recording_is_a_valid_event_file(recorded) -> None:
    _, _, _, path = recorded
    recording = read_events(path)
    assert recording.header["config"]["model"] == "smollm2-135m"
    assert recording.header["config"]["max_model_len"] == 1024
    assert len(recording.events) >= 15 and recording.events[0].type == "engine.config"


def run_engine(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, timeout=240)


def test_refuses_a_utilization_too_small_for_the_weights() -> None:
    out = run_engine("generate", "--prompt", "hi", "--device-memory", "4", "--gpu-memory-utilization", "0.01",
                     "--log-format", "json")
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "--gpu-memory-utilization" in last and "GiB" in last and "Traceback" not in out.stderr
    failed = [json.loads(x) for x in out.stderr.splitlines() if x.startswith("{") and "failed" in x]
    assert failed and "phase B" in failed[0]["event"]


@pytest.mark.parametrize(("pool", "fix"), [
    ("4Mi", "or lower --max-model-len to 176 or less"),  # 11 blocks of 16 x 23,040 bytes (bf16)
    ("1", "raise --kv-cache-memory-bytes to at least 94,371,840"),  # holds no block: lowering the length cannot help
])
def test_a_fixed_pool_too_small_is_refused_in_phase_b_before_weights_load(tmp_path: Path, pool: str,
                                                                          fix: str) -> None:
    events = tmp_path / "refused.jsonl"
    out = run_engine("generate", "--prompt", "hi", "--kv-cache-memory-bytes", pool, "--max-model-len", "4096",
                     "--max-num-batched-tokens", "256", "--max-num-seqs", "4", "--log-format", "json",
                     "--dtype", "bfloat16", "--events", str(events))
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "4,096" in last and fix in last and "Traceback" not in out.stderr
    assert "--gpu-memory-utilization" not in last  # it does not change a fixed pool
    assert pool != "1" or "--max-model-len to" not in last
    phases_seen = [e for e in read_events(events).events if isinstance(e, StartupPhase)]
    failed = [e for e in phases_seen if e.status == "failed"]
    assert [e.phase for e in failed] == ["B"] and "4,096" in (failed[0].reason or "")
    assert {e.phase for e in phases_seen} == {"A", "B"}  # refused before phase C loads anything
    first, refusal = phases_seen[0], failed[0]
    assert refusal.t - first.t < 2.0
    # the fixes are recorded as data, and engine doctor reads them from there (issue 48)
    flags = [(f["flag"], f["current"]) for f in refusal.fixes]
    assert flags[0] == ("--kv-cache-memory-bytes", 4 << 20 if pool == "4Mi" else 1)
    assert [f for f, _ in flags] == (["--kv-cache-memory-bytes", "--max-model-len"] if pool == "4Mi"
                                     else ["--kv-cache-memory-bytes"])
    from doctor.inputs import facts_from_recording
    from doctor.rules.registry import diagnose

    (finding,) = diagnose(facts_from_recording(events))
    assert finding.rule == "startup_refused" and [f.to_json() for f in finding.fixes] == refusal.fixes


def test_text_reaches_events_only_with_log_prompts(recorded) -> None:
    llm, events, _, _ = recorded
    engine = llm.engine
    start = len(events)
    llm.generate("The sky is", SamplingParams(temperature=0.0, max_tokens=4))
    assert all("The sky is" not in json.dumps(e.to_dict()) for e in events[start:])
    engine.config.log_prompts = True
    try:
        start = len(events)
        out = llm.generate("The sky is", SamplingParams(temperature=0.0, max_tokens=4))[0]
    finally:
        engine.config.log_prompts = False
    arrived = next(e for e in events[start:] if e.type == "request.arrived")
    finished = next(e for e in events[start:] if e.type == "request.finished")
    assert arrived.prompt == "The sky is" and finished.output_text == out.text


def test_long_phases_publish_progress_inside_their_phase(recorded) -> None:
    from engine.events import StartupProgress

    _, events, log, _ = recorded
    open_phase = None
    seen: dict[tuple[str, str], list[StartupProgress]] = {}
    for e in events:
        if isinstance(e, StartupPhase):
            open_phase = e.phase if e.status == "begin" else None
        elif isinstance(e, StartupProgress):
            assert e.phase == open_phase, f"progress of {e.phase} outside its phase"
            seen.setdefault((e.phase, e.what), []).append(e)
    weights = seen[("C", "weights")]
    assert weights[-1].done == weights[-1].total == 272 and weights[-1].unit == "tensors"
    assert [p.done for p in weights] == sorted(p.done for p in weights)
    assert [p.done for p in seen[("D", "profile run")]] == [0, 1]
    assert seen[("F", "warm-up")][-1].done == seen[("F", "warm-up")][-1].total == 3
    # the log is not a terminal here: progress arrives as log lines, the last one complete
    assert "phase C weights: 272/272 tensors (100%)" in log


def test_a_fixed_pool_is_sized_by_the_hybrid_layout_when_the_model_has_a_window() -> None:
    """Phase B's check sizes Gemma 3's pool as phase E will (one request's blocks summed over
    its six groups, a window holding only its own), not as full attention: 1 GiB holds a
    32,768-token request (full attention would need 1.125 GiB); 8 MiB does not hold 4,096."""
    import dataclasses

    from engine.budget.memory import bytes_per_kv_token, bytes_per_kv_token_per_layer
    from engine.config import EngineConfig
    from engine.errors import BudgetError
    from engine.modelspec.readers import load_model_config
    from engine.startup.device_budget import check_fixed_pool
    from engine.startup.inputs import model_kv_cache_groups

    model = load_model_config("gemma-3-270m")
    groups = model_kv_cache_groups(model)
    assert len(groups) == 6
    per_token, per_layer = bytes_per_kv_token(model, "auto", 1, "float32"), bytes_per_kv_token_per_layer(
        model, "auto", 1, "float32")
    config = EngineConfig(model="gemma-3-270m", kv_cache_memory_bytes=1 << 30, max_model_len=32_768,
                          max_num_batched_tokens=512, dtype="float32")
    with pytest.raises(BudgetError, match="fewer than one request"):
        check_fixed_pool(config, per_token)  # as full attention: 29,120 tokens < 32,768
    check_fixed_pool(config, per_token, groups, per_layer)  # hybrid: 10,922 blocks >= 2,048 + 5 x (ceil(1,023 / 16) + 1) = 2,373
    small = dataclasses.replace(config, kv_cache_memory_bytes=8 << 20, max_model_len=4096)
    # 8 MiB // (16 x 4,096 bytes x 3 layers) = 85 blocks < 256 (full) + 5 x (ceil(1,023 / 16) + 1) = 581
    with pytest.raises(BudgetError, match=r"85 blocks .* fewer than the 581 .* 6 KV cache groups"):
        check_fixed_pool(small, per_token, groups, per_layer)


def test_a_cpu_start_at_defaults_needs_its_capped_pool_not_most_of_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """With neither --device-memory nor --kv-cache-memory-bytes the CPU pool is capped at 4 GiB
    (vLLM's VLLM_CPU_KVCACHE_SPACE), so a host whose other processes (or this process: the
    budget's total counts its own RSS) hold more than 10 % still starts; a host without room
    for the weights and that pool is refused, with the numbers."""
    import dataclasses

    from engine.errors import BudgetError
    from engine.startup import recorder

    real = recorder.read_memory
    gib = 1 << 30

    def host(free_gib: float):
        return lambda device, memory_gib=None: dataclasses.replace(real(device, memory_gib), total=24 * gib,
                                                                   free=int(free_gib * gib))

    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    monkeypatch.setattr(recorder, "read_memory", host(12.0))  # half the host free: 0.9 x 24 GiB is not
    with LLM("smollm2-135m", bus=bus, max_model_len=256, max_num_batched_tokens=64, stats_interval=0.0) as llm:
        assert llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=2))[0].token_ids
    phase_e = next(e for e in events if isinstance(e, StartupPhase) and e.phase == "E" and e.status == "end")
    assert phase_e.data["cpu_default_cap"] is True
    monkeypatch.setattr(recorder, "read_memory", host(3.0))  # not even the 4 GiB pool
    with pytest.raises(BudgetError, match=r"free memory on device \(3.00/24.00 GiB\) is less than"):
        LLM("smollm2-135m", max_model_len=256, max_num_batched_tokens=64, stats_interval=0.0)
