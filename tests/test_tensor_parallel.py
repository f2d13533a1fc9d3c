"""Tensor parallelism (issue 20): the refusals and the shard arithmetic in the default
suite; real replicas (worker processes over gloo on 127.0.0.1) under ``slow``: on two
cores each one takes 10-30 s to spawn, import torch and run phases A-G per rank.

The replicas: a dummy-weight Llama whose heads divide by 2 (TP=2) and the bundled
SmolLM2 (9 query heads, 3 KV heads: TP=3), compared with one rank of the same model.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import psutil
import pytest
import torch

from engine.budget.memory import GiB, bytes_per_kv_token
from engine.cli.main import build_parser
from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.errors import BudgetError, ReplicaError, UserError
from engine.events import PHASES, Event, EventBus, LogEvent, StartupPhase, StepEvent, event_from_dict
from engine.events.phase_data import KvCacheData, LoadWeightsData, read_phase
from engine.model.parallel import check_shardable, kv_head_start, rank_model_config, replica_free_bytes
from engine.modelspec.presets import MODEL_PRESETS
from engine.modelspec.readers import load_model_config
from engine.startup.resolve import resolve_config
from tests.processes import wait_gone

TINY_LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
              "max_position_embeddings": 1024, "torch_dtype": "float32", "tie_word_embeddings": True,
              "bos_token_id": 1, "eos_token_id": 2}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CPU = torch.device("cpu")


# ------------------------------------------------------------- default suite
def test_a_size_the_heads_do_not_divide_is_refused_with_the_sizes_that_do() -> None:
    smollm = MODEL_PRESETS["smollm2-135m"]
    with pytest.raises(UserError, match=r"--tensor-parallel-size 2 does not divide smollm2-135m's 9 attention "
                                        r"heads, 3 KV heads .*; use one of 1, 3$"):
        check_shardable(smollm, 2)
    check_shardable(smollm, 3)


def test_each_rank_holds_its_heads_columns_and_vocabulary_rows() -> None:
    smollm = rank_model_config(MODEL_PRESETS["smollm2-135m"], 3)
    assert (smollm.num_attention_heads, smollm.num_kv_heads, smollm.intermediate_size, smollm.vocab_size) == \
        (3, 1, 512, 16384)
    # More ranks than KV heads: each rank holds one, replicated as vLLM does (8 heads, 16 ranks: 2 per head).
    llama70 = MODEL_PRESETS["llama-3.1-70b"]
    assert rank_model_config(llama70, 16).num_kv_heads == 1
    assert [kv_head_start(llama70, 16, r) for r in (0, 1, 2, 15)] == [0, 0, 1, 7]
    assert [kv_head_start(llama70, 4, r) for r in range(4)] == [0, 2, 4, 6]
    # The budget's bytes per token are one rank's heads: 80 KiB per GPU for the 70B at TP=4 (seed 001).
    assert bytes_per_kv_token(llama70, tensor_parallel_size=4) == 80 * 1024


def test_unequal_free_memory_across_ranks_is_refused_with_each_ranks_numbers() -> None:
    assert replica_free_bytes([70 * GiB, 66 * GiB]) == 66 * GiB  # within 10 %: the emptiest rank's
    with pytest.raises(BudgetError, match=r"more than 10%: rank 0 70\.00 GiB, rank 1 40\.00 GiB, rank 2 70\.00 "
                                          r"GiB; every rank would get the pool rank 1 can hold"):
        replica_free_bytes([70 * GiB, 40 * GiB, 70 * GiB])


def test_quantized_weights_under_tensor_parallelism_are_refused_and_auto_runs_floats() -> None:
    model = MODEL_PRESETS["smollm2-135m"]
    with pytest.raises(UserError, match=r"--quantization int4 with --tensor-parallel-size 3: .* not sharded yet; "
                                        r"tensor parallelism runs float weights \(--quantization none\)"):
        resolve_config(EngineConfig(tensor_parallel_size=3, quantization="int4"), model, CPU)
    resolved = resolve_config(EngineConfig(tensor_parallel_size=3, quantization="auto"), model, CPU)
    assert resolved.config.quantization is None and "--tensor-parallel-size 3 runs float weights" in \
        resolved.quantization_reason
    with pytest.raises(UserError, match="--compile with --tensor-parallel-size > 1"):
        resolve_config(EngineConfig(tensor_parallel_size=3, compile=True), model, CPU)


def test_distributed_executor_backend_is_mp_as_vllm_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "hi", "-tp", "3", "--distributed-executor-backend", "mp"])
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (3, "mp")
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "hi", "--distributed-executor-backend", "ray"])
    assert "--distributed-executor-backend: invalid choice: 'ray' (choose from 'mp')" in capsys.readouterr().err


def test_a_ranks_phase_says_its_rank_and_a_single_rank_recording_is_unchanged() -> None:
    single = StartupPhase(phase="C", name=PHASES["C"], status="end")
    assert "rank" not in single.to_dict()
    ranked = StartupPhase(phase="C", name=PHASES["C"], status="end", rank=2)
    assert ranked.to_dict()["rank"] == 2 and event_from_dict(ranked.to_dict()) == ranked
    # under tensor parallelism rank 0's phases say so too (issue 35: only ranks 1+ did)
    first = StartupPhase(phase="C", name=PHASES["C"], status="end", rank=0)
    assert first.to_dict()["rank"] == 0 and event_from_dict(first.to_dict()) == first
    assert event_from_dict(single.to_dict()).rank is None
    step = StepEvent(index=1)
    assert not {"collective_s", "collective_bytes", "collective_calls"} & set(step.to_dict())


def test_the_view_keeps_each_ranks_phases_and_ledger_beside_rank_0s() -> None:
    from engine.events.folds.view import EngineView
    from monitor.widgets.memory_bar import rank_ledger_lines
    from monitor.widgets.startup_table import rank_row

    bus = EventBus()
    view = EngineView()
    bus.subscribe(view.apply)
    for rank, seconds, weights in ((0, 1.5, 300 << 20), (1, 2.5, 200 << 20)):
        for letter in PHASES:
            data = {"weights_bytes": weights} if letter == "C" else {"kv_pool_bytes": 64 << 20, "num_blocks": 96} \
                if letter == "E" else {}
            bus.publish(StartupPhase(phase=letter, name=PHASES[letter], status="begin", rank=rank))
            bus.publish(StartupPhase(phase=letter, name=PHASES[letter], status="end", rank=rank, data=data,
                                     duration_s=seconds if letter == "C" else 0.0))
    assert view.phases["C"].duration_s == 1.5 and view.ledger["weights_bytes"] == 300 << 20  # rank 0's: the replica's
    assert view.rank_phases[1]["C"].duration_s == 2.5 and view.rank_ledgers[1]["weights_bytes"] == 200 << 20
    again = EngineView.from_snapshot(view.snapshot())
    assert again.rank_phases[1]["C"].duration_s == 2.5 and again.rank_ledgers == view.rank_ledgers
    row = rank_row(1, view.rank_phases[1], view)
    assert row[:2] == ("r1", "rank 1") and row[3] == "2.50"
    assert row[5].startswith("A 0.00 B 0.00 C 2.50") and row[5].endswith("slowest: rank 1 (2.50 s, the replica's startup)")
    assert [line.plain for line in rank_ledger_lines(view)] == [
        "rank 1: weights 0.20 GiB · activation peak 0.00 GiB · KV pool 0.06 GiB (96 blocks)"]
    assert "ranks" not in EngineView().snapshot()


def test_metrics_take_the_replicas_pool_from_rank_0() -> None:
    from prometheus_client import CollectorRegistry

    from engine.events.exporters.metrics import PrometheusMetrics

    bus = EventBus()
    metrics = PrometheusMetrics(CollectorRegistry(), model_name="m")
    bus.subscribe(metrics)
    for rank, blocks in ((0, 96), (1, 95)):  # a rank's own numbers never replace the replica's
        bus.publish(StartupPhase(phase="E", name=PHASES["E"], status="end", rank=rank,
                                 data={"num_blocks": blocks, "block_size": 16}))
    body = metrics.render().decode()
    assert 'num_gpu_blocks="96"' in body and 'num_gpu_blocks="95"' not in body


# ------------------------------------------------------------- real replicas
def _tiny_model(folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(folder)


def _config(model: str, tp: int, **overrides: object) -> EngineConfig:
    flags = dict(model=model, tensor_parallel_size=tp, dtype="float32", quantization="none", max_model_len=256,
                 max_num_batched_tokens=64, max_num_seqs=8, stats_interval=0.0)
    flags.update(overrides)
    return EngineConfig(**flags)  # type: ignore[arg-type]


def _generate(engine: object, prompts: Sequence[Sequence[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    ids = [engine.add_request(list(p), params) for p in prompts]  # type: ignore[attr-defined]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():  # type: ignore[attr-defined]
        for out in engine.step():  # type: ignore[attr-defined]
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


def _run(config: EngineConfig, prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[Event]]:
    from engine.llm_engine import LLMEngine

    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    with LLMEngine(config, bus=bus) as engine:
        outputs = _generate(engine, prompts)
    return outputs, events


def _prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (length + i,), generator=generator).tolist() for i in range(count)]


# 12 blocks of 16 tokens, four 40-43-token prompts generating 12 each: 4 x 4 blocks > 12
# once they decode, so the run preempts; TP=2 holds half the heads per token, so the same 12
# blocks take half the bytes on each rank.
PRESSURE_BLOCKS = 12


def _pool_bytes(model: str, tp: int) -> int:
    return PRESSURE_BLOCKS * 16 * bytes_per_kv_token(load_model_config(model), "auto", tp, "float32")


@pytest.fixture(scope="module")
def tiny_replicas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    model = _tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    prompts = _prompts(4, 40)
    one, _ = _run(_config(model, 1, kv_cache_memory_bytes=_pool_bytes(model, 1), load_format="dummy",
                          max_model_len=128), prompts)
    two, events = _run(_config(model, 2, kv_cache_memory_bytes=_pool_bytes(model, 2), load_format="dummy",
                               max_model_len=128), prompts)
    return {"model": model, "one": one, "two": two, "events": events}


@pytest.mark.slow
def test_tp2_greedy_output_is_tp1s_under_preemption(tiny_replicas: dict[str, object]) -> None:
    events = tiny_replicas["events"]
    assert tiny_replicas["two"] == tiny_replicas["one"]
    steps = [e for e in events if isinstance(e, StepEvent)]  # type: ignore[union-attr]
    assert any(s.preempted for s in steps), "the pool was meant to force preemptions"


@pytest.mark.slow
def test_every_rank_runs_phases_a_to_g_and_phase_e_is_the_plans(tiny_replicas: dict[str, object]) -> None:
    events: list[Event] = tiny_replicas["events"]  # type: ignore[assignment]
    ended = [e for e in events if isinstance(e, StartupPhase) and e.status == "end"]
    assert {rank: [e.phase for e in ended if e.rank == rank] for rank in (0, 1)} == {0: list(PHASES), 1: list(PHASES)}
    model = load_model_config(str(tiny_replicas["model"]))
    pools = {e.rank: read_phase(e, KvCacheData) for e in ended if e.phase == "E"}
    per_token = bytes_per_kv_token(model, "auto", 2, "float32")  # one rank's heads: what engine plan says
    assert {r: (p.bytes_per_token, p.num_blocks) for r, p in pools.items() if p} == \
        {0: (per_token, PRESSURE_BLOCKS), 1: (per_token, PRESSURE_BLOCKS)}
    weights = {e.rank: read_phase(e, LoadWeightsData).weights_bytes for e in ended if e.phase == "C"}  # type: ignore[union-attr]
    whole = model.num_parameters * 4
    assert weights[0] == weights[1] and abs(weights[0] - whole / 2) < 2 * model.hidden_size * 4 * 2  # norms whole


@pytest.mark.slow
def test_step_events_carry_the_collectives_two_all_reduces_a_layer(tiny_replicas: dict[str, object]) -> None:
    events: list[Event] = tiny_replicas["events"]  # type: ignore[assignment]
    model = load_model_config(str(tiny_replicas["model"]))
    steps = [e for e in events if isinstance(e, StepEvent) and e.scheduled]
    assert steps
    for step in steps:
        tokens = step.num_prefill_tokens + step.num_decode_tokens
        # The embedding's and 2 per layer all-reduces of [tokens, hidden] fp32, then the gather
        # of rank 0's logits columns: half the vocabulary per sampled row.
        reduce_bytes = (2 * model.num_layers + 1) * tokens * model.hidden_size * 4
        assert step.collective_calls == 2 * model.num_layers + 2 and step.collective_s > 0
        gathered = step.collective_bytes - reduce_bytes
        assert gathered >= 0 and gathered % (model.vocab_size // 2 * 4) == 0


@pytest.mark.slow
def test_a_killed_worker_stops_the_replica_naming_its_rank_and_last_phase(tmp_path: Path) -> None:
    from engine.llm_engine import LLMEngine

    model = _tiny_model(tmp_path / "tiny-llama")
    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    engine = LLMEngine(_config(model, 2, kv_cache_memory_bytes=8 << 20, load_format="dummy"), bus=bus)
    try:
        worker_pids = engine.workers.pids()  # type: ignore[union-attr]
        for prompt in _prompts(2, 20):
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        for _ in range(3):
            engine.step()
        os.kill(worker_pids[0], signal.SIGKILL)
        with pytest.raises(ReplicaError, match=r"tensor-parallel rank 1 \(pid \d+\) was killed by SIGKILL during "
                                               r"step 4; its last phase: G \(ready\) end, then serving steps\. "
                                               r"The replica is stopped"):
            for _ in range(10):
                engine.step()
    finally:
        engine.close()
    logged = [e for e in events if isinstance(e, LogEvent) and e.level == "error"]
    assert logged and logged[-1].data == {"rank": 1}
    wait_gone(worker_pids, "a worker outlived its replica")
    assert not [c for c in psutil.Process().children() if c.name().startswith("kvscope-tp") or c.pid in worker_pids]


@pytest.mark.slow
def test_tp3_on_the_bundled_model_matches_tp1_greedy_and_logits(smollm_config, smollm_runner_fp32) -> None:
    """Greedy fp32 output of TP=3 is TP=1's over a set of prompts; logits agree within
    1e-3 absolute (measured: under 1e-4 on logits of magnitude ~20-30, the order of fp32 sums)."""
    from engine.llm_engine import LLMEngine
    from engine.model.runner import ScheduledSeq

    prompts = _prompts(4, 12, seed=1)
    common = dict(kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=128)
    reference, _ = _run(_config("smollm2-135m", 1, **common), prompts)
    with LLMEngine(_config("smollm2-135m", 3, **common)) as engine:
        assert _generate(engine, prompts) == reference
        greedy = SamplingParams(temperature=0.0)
        batch = [ScheduledSeq(f"p{i}", p, 0, [i * 4 + b for b in range(4)], True, greedy) for i, p in enumerate(prompts)]
        engine.workers.parallel.broadcast_from_driver(batch)  # type: ignore[union-attr]
        sharded = engine.runner.logits_for(batch)
    whole = smollm_runner_fp32.logits_for(batch)
    for rid, logits in whole.items():
        assert (sharded[rid] - logits).abs().max().item() < 1e-3
        assert sharded[rid].argmax() == logits.argmax()
